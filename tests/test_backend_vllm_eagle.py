"""specrl's EAGLE head on vLLM: the vllm-eagle3 export drafts exactly what specrl drafts, and trains online.

Runs only where vLLM is installed (`make test-vllm`). The head is an EAGLE-3 layer for SmolLM2-135M trained for
seconds on the test prompts' own continuations, so it drafts them well, over a reduced draft vocabulary: the
d2t mapping, multi-token catch-up after accepted drafts and drafts 2..k (fed back hidden states) are all
exercised. Both engines run fp32 and greedy, one prompt at a time; the drafts every verification step proposes
must be identical, token for token.
"""

from __future__ import annotations

import json
import os

import pytest

vllm = pytest.importorskip("vllm", reason="vLLM is not installed here (make venv-vllm / make test-vllm)")

import torch  # noqa: E402
from safetensors.torch import load_file  # noqa: E402

from specrl.backends.vllm import VLLMBackend, VLLMOptions  # noqa: E402
from specrl.drafters.kinds.eagle import EagleDrafter  # noqa: E402
from specrl.drafters.storage.export import export_vllm_eagle3  # noqa: E402
from specrl.drafters.storage.io import save_drafter  # noqa: E402
from specrl.errors import SpecRLError  # noqa: E402
from specrl.model.loader import load_model  # noqa: E402
from specrl.model.presets import prepare  # noqa: E402
from specrl.rollout.engine import RolloutEngine  # noqa: E402
from specrl.rollout.sampling import SamplingParams  # noqa: E402

os.environ.setdefault("HF_HUB_OFFLINE", "1")
K = 3
NEW = 24


@pytest.fixture(scope="module")
def ckpt():
    return prepare("smollm2-135m", verbose=False)


@pytest.fixture(scope="module")
def target(ckpt):
    model, tok = load_model(ckpt, dtype=torch.float32)
    return model.eval(), tok


@pytest.fixture(scope="module")
def prompts(target):
    _, tok = target
    qs = ["What is 7 + 5?", "Name three colours.", "Count from one to ten.",
          "Here is a list: " + ", ".join(str(i) for i in range(40)) + ". Continue it."]
    return [list(tok.apply_chat_template([{"role": "user", "content": q}], add_generation_prompt=True,
                                         return_dict=False)) for q in qs]


@pytest.fixture(scope="module")
def head(tmp_path_factory, target, prompts):
    """An EAGLE-3 head for SmolLM2 trained for a few seconds on the test prompts' own greedy continuations (so it
    drafts them well), over a reduced draft vocabulary: those sequences' tokens plus every 7th id."""
    from specrl.drafters.training.offline import train_drafter

    model, _ = target
    outs = RolloutEngine(model, max_batch_size=len(prompts), max_seq_len=512).generate(
        prompts, SamplingParams(temperature=0.0, max_new_tokens=NEW + 2 * K))
    seqs = [p + o.token_ids for p, o in zip(prompts, outs, strict=True)]
    vocab = sorted({t for s in seqs for t in s} | set(range(0, model.args.vocab_size, 7)))
    torch.manual_seed(0)
    d = EagleDrafter(model, draft_vocab=vocab).float()
    report = train_drafter(d, model, seqs * 4, epochs=12, lr=3e-3, batch_size=4, progress=False,
                           heldout_fraction=0.2, prompt_lens=[len(p) for p in prompts] * 4)
    print(f"\ntest head: held-out top-1 {report['heldout_top1']:.2f} after {report['seconds']:.0f} s")
    return save_drafter(d.eval(), tmp_path_factory.mktemp("specrl-eagle") / "head"), vocab


@pytest.fixture(scope="module")
def backend(ckpt, head):
    b = VLLMBackend(ckpt, VLLMOptions(dtype="float32", max_model_len=512, drafter=f"eagle:{head[0]}",
                                      num_draft_tokens=K, max_num_seqs=8, kv_cache_space_gib=0.5))
    yield b
    b.close()


def test_export_layout(head, ckpt, tmp_path, target):
    out = export_vllm_eagle3(head[0], ckpt, tmp_path / "e3")
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["architectures"] == ["LlamaForCausalLMEagle3"] and cfg["fc_norm"] is True
    assert cfg["eagle_config"]["eagle_aux_hidden_state_layer_ids"] == [2, 15, 27]  # specrl layers 1, 14, 26
    w = load_file(str(out / "model.safetensors"))
    assert "embed_tokens.weight" not in w and "midlayer.self_attn.q_proj.weight" in w
    assert w["midlayer.self_attn.q_proj.weight"].shape[1] == 2 * cfg["hidden_size"]
    d2t, ids = w["d2t"], torch.tensor(head[1])
    assert torch.equal(torch.arange(d2t.numel()) + d2t, ids) and int(w["t2d"].sum()) == ids.numel()
    with pytest.raises(SpecRLError, match="not empty"):
        export_vllm_eagle3(head[0], ckpt, tmp_path / "e3")


def native_drafts(model, drafter, prompt):
    engine = RolloutEngine(model, max_batch_size=1, max_seq_len=512, drafter=drafter, num_draft_tokens=K)
    seen, propose = [], drafter.propose

    def recording(batch, k):
        p = propose(batch, k)
        seen.append(p.tokens[0].tolist())
        return p

    drafter.propose = recording
    try:
        out = engine.generate([prompt], SamplingParams(temperature=0.0, max_new_tokens=NEW))
    finally:
        del drafter.propose
    return out[0].token_ids, seen, out.metrics


def test_vllm_drafts_equal_specrl_drafts(backend, target, head, prompts):
    from specrl.drafters.storage.io import load_drafter

    model, _ = target
    drafter = load_drafter(head[0], model, expected_kind="eagle").float()
    accepted_any = 0
    for i, p in enumerate(prompts):
        toks, ours, m = native_drafts(model, drafter, p)
        backend.llm.collective_rpc("specrl_record_drafts", args=(True,))
        res = backend.generate([p], SamplingParams(temperature=0.0, max_new_tokens=NEW))
        theirs = [step[0] for step in backend.llm.collective_rpc("specrl_record_drafts", args=(False,))[0]]
        assert res[0].token_ids == toks, f"prompt {i}: greedy output differs"
        n = min(len(ours), len(theirs))
        assert n >= 4 and abs(len(ours) - len(theirs)) <= 1, (len(ours), len(theirs))
        for j in range(n):
            m_ = min(len(ours[j]), len(theirs[j]))
            assert ours[j][:m_] == theirs[j][:m_], f"prompt {i}, step {j}: specrl drafted {ours[j]}, vLLM {theirs[j]}"
        accepted_any += m["accepted_tokens"]
        assert res.metrics["accepted_tokens"] == m["accepted_tokens"], (res.metrics, m)
    print(f"accepted draft tokens over {len(prompts)} prompts: {accepted_any}")
    assert accepted_any >= 12  # the head drafts well enough that catch-up over accepted entries is exercised


def test_drafter_refit_under_specrl_names_moves_vllm_drafts_with_specrl(backend, target, head, prompts):
    """What online drafter training sends (the specrl head's state dict) is renamed and reloaded: afterwards vLLM
    drafts what the changed head drafts in specrl, the greedy output is unchanged, and restoring the head
    restores vLLM's acceptance exactly."""
    from specrl.drafters.storage.io import load_drafter

    model, _ = target
    drafter = load_drafter(head[0], model, expected_kind="eagle").float()
    sp = SamplingParams(temperature=0.0, max_new_tokens=NEW)
    base = backend.generate(prompts, sp)
    changed = load_drafter(head[0], model, expected_kind="eagle").float()
    g = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for p in changed.block.parameters():
            p.add_(torch.randn(p.shape, generator=g) * 0.3 * p.abs().mean())
    backend.load_weights("drafter", changed.state_dict(), 1)
    print(f"EAGLE drafter refit {backend.last_refit_seconds['drafter']:.3f} s")
    toks, ours, _ = native_drafts(model, changed, prompts[0])
    backend.llm.collective_rpc("specrl_record_drafts", args=(True,))
    worse = backend.generate([prompts[0]], sp)
    theirs = [step[0] for step in backend.llm.collective_rpc("specrl_record_drafts", args=(False,))[0]]
    assert worse[0].token_ids == toks == base[0].token_ids
    n = min(len(ours), len(theirs))
    assert [o[:K] for o in ours[:n - 1]] == [t[:K] for t in theirs[:n - 1]]
    assert ours != native_drafts(model, drafter, prompts[0])[1]  # the change did change the drafts
    backend.load_weights("drafter", drafter.state_dict(), 2)
    again = backend.generate(prompts, sp)
    assert [o.token_ids for o in again] == [o.token_ids for o in base]
    assert again.metrics["accepted_tokens"] == base.metrics["accepted_tokens"]


def test_failed_refit_restarts_the_engine_with_the_newest_weights(backend, target, head, prompts):
    """A reload that dies half-way leaves vLLM's weights partly replaced: the backend restarts the engine and
    loads the newest policy and drafter into it, so generation continues with exactly those weights."""
    from specrl.backends.vllm import VLLMEngineError, VLLMRefitError
    from specrl.drafters.storage.io import load_drafter
    from specrl.model.hf_checkpoint import hf_named_tensors

    model, _ = target
    new = copy_perturbed(model)
    backend.llm.collective_rpc("specrl_fail_next_loads", args=(1,))
    backend.load_weights("policy", hf_named_tensors(new), 7)
    assert backend.restarts == 1 and "injected failure" in backend.restart_log[0] and backend.policy_version == 7
    print(f"restart + reload {backend.last_refit_seconds['policy']:.1f} s")
    drafter = load_drafter(head[0], model, expected_kind="eagle").float()
    toks, ours, m = native_drafts(new, drafter, prompts[0])
    res = backend.generate([prompts[0]], SamplingParams(temperature=0.0, max_new_tokens=NEW))
    assert res[0].token_ids == toks and res.policy_versions == [7]
    assert res.metrics["accepted_tokens"] == m["accepted_tokens"]  # the newest drafter came back too

    named = hf_named_tensors(model)
    bad = {n: t[:, :-1] for n, t in named.items() if n.startswith("model.layers.0.self_attn.") and "_proj" in n}
    with pytest.raises(VLLMRefitError, match=r"restarted engine.*newest weights"):
        backend.load_weights("policy", bad, 8)
    with pytest.raises(VLLMEngineError, match="unusable"):
        backend.generate([prompts[0]], SamplingParams(temperature=0.0, max_new_tokens=4))


def copy_perturbed(model, seed: int = 5, scale: float = 0.02):
    import copy

    m = copy.deepcopy(model)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in m.parameters():
            p.add_(torch.randn(p.shape, generator=g) * scale * p.abs().mean())
    return m


def test_online_drafter_training_reaches_vllm(ckpt, head, prompts, tmp_path):
    """GRPO on the vLLM backend with the specrl head trained online: every step the learner's drafter is pushed
    (under specrl's names, renamed by the backend), and afterwards vLLM drafts exactly what the learner's
    drafter drafts in specrl's engine on the learner's policy."""
    from specrl.trainer.config_check import load_config
    from specrl.trainer.sync_trainer import GRPOTrainer

    cfg = load_config("examples/short.yaml", [
        "rollout.backend=vllm", "rollout.vllm.dtype=float32", "rollout.vllm.probe=false",
        "rollout.vllm.kv_cache_space_gib=0.5",
        f"speculative.drafter=eagle:{head[0]}", "speculative.num_draft_tokens=3", "speculative.verify=rejection",
        "drafter.online=true", "drafter.online_mode=every_step", "drafter.learning_rate=1e-2",
        "grpo.num_prompts_per_step=2",
        "grpo.num_generations=2", "policy.train_micro_batch_size=4", "generation.max_new_tokens=12",
        "generation.max_batch_size=4", "run.steps=2",
        f"run.out_dir={tmp_path}", "run.threads=1"])
    trainer = GRPOTrainer.from_config(cfg)
    try:
        start = {k: v.clone() for k, v in trainer.drafter.state_dict().items()}
        for _ in range(2):
            rec = trainer.step()
            assert rec["acceptance_length"] >= 1.0
        backend = trainer.backend
        assert backend.drafter_version == backend.policy_version == 1  # each step pushes before it generates
        trainer.stage_prepare()  # push the learner's newest weights (version 2), policy and drafter
        assert backend.drafter_version == backend.policy_version == 2
        moved = max(float((v.float() - start[k].float()).abs().max()) for k, v in trainer.drafter.state_dict().items()
                    if v.is_floating_point())
        assert moved > 0  # the learner did train the drafter
        policy = trainer.policy.float().eval()
        toks, ours, _ = native_drafts(policy, trainer.drafter.float().eval(), prompts[1])
        backend.llm.collective_rpc("specrl_record_drafts", args=(True,))
        res = backend.generate([prompts[1]], SamplingParams(temperature=0.0, max_new_tokens=NEW))
        theirs = [step[0] for step in backend.llm.collective_rpc("specrl_record_drafts", args=(False,))[0]]
        assert res[0].token_ids == toks
        n = min(len(ours), len(theirs))
        assert n >= 4 and [o[:K] for o in ours[:n - 1]] == [t[:K] for t in theirs[:n - 1]]
    finally:
        trainer.close()
