"""docs/extending.md runs: each section's Python block is executed as written, then selected by name in one tiny
GRPO step (a toy drafter kind, a backend wrapping the native engine, a loss and a reward function), and each test
checks that its piece was used."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import yaml

from specrl.errors import SpecRLError
from tests.tiny import make_tiny_checkpoint

DOC = Path(__file__).resolve().parents[1] / "docs" / "extending.md"


def doc_blocks(lang: str) -> dict[str, str]:
    """Section heading -> the section's fenced block in `lang` (one per section)."""
    out = {}
    for section in re.split(r"^## ", DOC.read_text(), flags=re.M)[1:]:
        title, _, body = section.partition("\n")
        blocks = re.findall(rf"^```{lang}\n(.*?)^```", body, flags=re.M | re.S)
        if blocks:
            assert len(blocks) == 1, f"{title}: one {lang} block per section"
            out[title.strip()] = blocks[0]
    return out


@pytest.fixture(scope="module")
def extended(tmp_path_factory):
    """Run the documented snippets, then one GRPO step that selects all four; unregister them afterwards."""
    from specrl.algorithms.losses import LOSSES
    from specrl.backends.registry import unregister_backend
    from specrl.rollout.drafter_spec import unregister_drafter_kind
    from specrl.trainer.config_check import validate_config
    from specrl.trainer.sync_trainer import GRPOTrainer

    tmp = tmp_path_factory.mktemp("ext")
    code = doc_blocks("python")
    ns = {name: {} for name in code}
    for name in ("A drafter kind", "A rollout backend", "A policy loss"):
        exec(compile(code[name], f"{DOC}:{name}", "exec"), ns[name])
    (tmp / "my_rewards.py").write_text(code["A reward function"])
    reward = yaml.safe_load(doc_blocks("yaml")["A reward function"])["reward"]
    reward["functions"] = [str(tmp / f) for f in reward["functions"]]
    cfg = validate_config({
        "model": {"name": str(make_tiny_checkpoint(tmp / "ckpt")), "max_seq_len": 192, "rollout_dtype": "float32"},
        "task": {"train_size": 8, "val_size": 2, "system_prompt": "Be brief."},
        "grpo": {"num_prompts_per_step": 2, "num_generations": 2, "loss_type": "dapo_logged"},
        "policy": {"learning_rate": 1e-3, "train_micro_batch_size": 4, "precision": "fp32"},
        "generation": {"max_new_tokens": 8, "max_batch_size": 4},
        "speculative": {"drafter": "fixed:7", "num_draft_tokens": 2},
        "rollout": {"backend": "counting"},
        "reward": reward,
        "run": {"steps": 1, "tensorboard": False, "progress": False},
    })
    try:
        trainer = GRPOTrainer.from_config(cfg)
        rec = trainer.step()
        yield ns, trainer, rec
    finally:
        unregister_drafter_kind("fixed")
        unregister_backend("counting")
        LOSSES.pop("dapo_logged", None)


def test_drafter_kind(extended):
    from specrl.rollout.drafter_spec import parse_drafter_spec

    ns, trainer, rec = extended
    assert isinstance(trainer.backend.engine.drafter, ns["A drafter kind"]["FixedTokenDrafter"])
    assert trainer.backend.engine.drafter.token == 7
    assert rec["acceptance_length"] is not None  # drafts were verified
    with pytest.raises(SpecRLError, match=r"'fixed' needs.*'fixed:TOKEN'"):
        parse_drafter_spec("fixed")


def test_backend(extended):
    ns, trainer, _ = extended
    assert isinstance(trainer.backend, ns["A rollout backend"]["CountingBackend"])
    assert trainer.backend.calls >= 1 and trainer.backend.policy_version == 0


def test_loss(extended):
    ns, _, _ = extended
    assert ns["A policy loss"]["seen_tokens"] and all(n > 0 for n in ns["A policy loss"]["seen_tokens"])


def test_reward_function(extended):
    _, _, rec = extended
    assert any("short_answer" in name for name in rec["reward_components"]), rec["reward_components"]


def test_registry_errors():
    from specrl.backends.registry import register_backend, unregister_backend
    from specrl.drafters import register_drafter
    from specrl.rollout.drafter_spec import DrafterKind, register_drafter_kind, unregister_drafter_kind
    from specrl.trainer.config_check import load_config

    with pytest.raises(SpecRLError, match=r"'eagle' is already registered"):
        register_drafter("eagle", lambda spec, target, dtype: None)
    with pytest.raises(SpecRLError, match="must be non-empty, without ':'"):
        register_drafter_kind(DrafterKind("a:b"))
    with pytest.raises(SpecRLError, match="build must be callable"):
        register_drafter("toy", None)
    with pytest.raises(SpecRLError, match="'ngram' is built in"):
        unregister_drafter_kind("ngram")
    with pytest.raises(SpecRLError, match=r"backend 'native'.*already registered"):
        register_backend("native", lambda cfg, policy: None)
    with pytest.raises(SpecRLError, match="factory must be callable"):
        register_backend("toy", "not a function")
    with pytest.raises(SpecRLError, match=r"'a b'.*non-empty word"):
        register_backend("a b", lambda cfg, policy: None)
    with pytest.raises(SpecRLError, match="'vllm' is built in"):
        unregister_backend("vllm")
    with pytest.raises(SpecRLError, match=r"backend 'toy'.*native, vllm"):
        load_config(None, ["rollout.backend=toy"])
