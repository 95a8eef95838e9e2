"""GPU readiness without a GPU: the engine's hot path creates its tensors on the model's device.

Off CPU, `RolloutEngine` runs `generate` (and the drafter's `bind`) inside a default-device context, so every
tensor the engine, the verifier, the sampler and the drafters create without naming a device lands on the
model's device. What can break that is code that names the CPU itself: `.cpu()`, `device="cpu"`, `.numpy()`.
The first test checks the mechanism on the `meta` device; the second forbids those calls in the hot-path modules
(a static check: on this CPU-only machine a stray CPU tensor would go unnoticed at run time). Host reads of
results (`.tolist()`, `int()`, `float()`) are fine on any device.
"""

import ast
from pathlib import Path

import torch

from specrl import RolloutEngine
from specrl.model.transformer import tiny_model

ROOT = Path(__file__).resolve().parents[1] / "specrl"
HOT_PATH = ["rollout/engine.py", "rollout/spec_decode/verify.py", "rollout/sampling.py",
            "rollout/spec_decode/adaptive.py", "rollout/generation_metrics.py", "model/transformer.py",
            "model/packed.py", "drafters/base.py", "drafters/kinds/ngram.py", "drafters/kinds/suffix.py",
            "drafters/kinds/hybrid.py", "drafters/kinds/eagle.py", "drafters/kinds/mtp.py",
            "drafters/kinds/draft_model.py", "drafters/trainable.py",
            # training follows run.device too: the learner's stages, drafter training and the online drafter
            "trainer/learner.py", "drafters/training/offline.py", "drafters/training/online.py",
            "algorithms/grpo.py"]


def test_the_engine_generates_under_its_models_device():
    cpu = RolloutEngine(tiny_model(), max_batch_size=2, max_seq_len=32)
    assert cpu.device.type == "cpu"
    with cpu._on_device():
        assert torch.zeros(1).device.type == "cpu"
    meta = RolloutEngine(tiny_model().to("meta"), max_batch_size=2, max_seq_len=32)
    assert meta.device.type == "meta" and meta.cache.k[0].device.type == "meta"
    assert meta.packed_layers == 0  # packing is a CPU kernel
    with meta._on_device():
        made = [torch.zeros(2), torch.arange(3), torch.tensor([1, 2]), torch.full((2,), 1.0)]
    assert all(t.device.type == "meta" for t in made)
    assert torch.zeros(1).device.type == "cpu"  # the context ends with the call


def _cpu_calls(path: Path) -> list[str]:
    bad = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr in ("cpu", "numpy"):
            bad.append(f"{path.name}:{node.lineno} .{node.func.attr}()")
        if isinstance(node, ast.keyword) and node.arg == "device" and isinstance(node.value, ast.Constant) \
                and node.value.value == "cpu":
            bad.append(f"{path.name}:{node.lineno} device='cpu'")
    return bad


# The explicit CPU list: calls that put data in host memory on purpose, each with its reason.
HOST_ON_PURPOSE = {
    # target_outputs(): the drafter's training corpus (each sequence's captured layers, final hidden state, top-K ids
    # and probabilities, argmax) is kept in host memory or written to feature shards; _pad moves each batch back
    "offline.py": 5,
}


def test_no_hot_path_module_names_the_cpu():
    found = [b for rel in HOT_PATH for b in _cpu_calls(ROOT / rel)]
    for name, allowed in HOST_ON_PURPOSE.items():
        mine = [b for b in found if b.startswith(name + ":")]
        assert len(mine) == allowed, f"{name}: expected {allowed} host copies on purpose, found {mine}"
        found = [b for b in found if b not in mine]
    assert not found, "tensors pinned to the CPU on the rollout hot path:\n" + "\n".join(found)


def test_the_static_check_catches_a_cpu_pin(tmp_path):
    f = tmp_path / "x.py"
    f.write_text("import torch\na = torch.zeros(2, device='cpu')\nb = a.cpu()\nc = a.numpy()\n")
    assert len(_cpu_calls(f)) == 3


def test_a_wrong_host_kv_len_is_caught_on_cpu():
    import pytest

    from specrl.model.transformer import cache_mask

    pos = torch.tensor([[3, 4], [6, 7]])
    assert cache_mask(pos)[1] == 8 and cache_mask(pos, 8)[1] == 8
    with pytest.raises(ValueError, match=r"kv_len=5\b.*position is 7"):
        cache_mask(pos, 5)
