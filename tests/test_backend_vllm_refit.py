"""Refit acknowledgement on the vLLM backend: `load_weights` returns the digest of what vLLM's model holds (fused
q/k/v and gate/up rows, padded vocabulary cut back), and `refit` refuses a load that was dropped, partial, went to
the wrong layer name or left the old weights under the new version (faults injected at the worker call).

Runs only where vLLM is installed (`make test-vllm`, in .venv-vllm; skipped in specrl's main venv)."""

from __future__ import annotations

import os

import pytest

vllm = pytest.importorskip("vllm", reason="vLLM is not installed here (make venv-vllm / make test-vllm)")

import torch  # noqa: E402

from specrl.backends.vllm import VLLMBackend, VLLMOptions  # noqa: E402
from specrl.model.hf_checkpoint import hf_named_tensors  # noqa: E402
from specrl.model.loader import load_model  # noqa: E402
from specrl.model.presets import prepare  # noqa: E402
from specrl.rollout.digest import HEAD_SUFFIX, OPAQUE, READBACK, RefitError  # noqa: E402
from specrl.trainer.weight_sync import refit  # noqa: E402
from tests.test_backend_vllm import perturbed  # noqa: E402

os.environ.setdefault("HF_HUB_OFFLINE", "1")


@pytest.fixture(scope="module")
def ckpt():
    return prepare("smollm2-135m", verbose=False)


@pytest.fixture(scope="module")
def model(ckpt):
    return load_model(ckpt, dtype=torch.float32)[0].eval()


@pytest.fixture(scope="module")
def backend(ckpt):
    b = VLLMBackend(ckpt, VLLMOptions(dtype="float32", max_model_len=768, drafter=f"draft-model:{ckpt}",
                                      num_draft_tokens=3, max_num_seqs=16, kv_cache_space_gib=1.0))
    yield b
    b.close()


def _faulty_rpc(monkeypatch, backend, method, change):
    """The worker call `method` receives `change(pairs)` instead of the pairs sent (None: the call is dropped)."""
    real = backend.llm.collective_rpc

    def rpc(name, *a, args=(), **k):
        if name == method:
            pairs = change(list(args[0]))
            if pairs is None:
                return [0.0]
            args = (pairs, *args[1:])
        return real(name, *a, args=args, **k)

    monkeypatch.setattr(backend.llm, "collective_rpc", rpc)


def test_a_good_refit_is_acknowledged_and_compares_real_values(backend, model):
    sent = hf_named_tensors(perturbed(model, seed=1))
    ack = refit(backend, "policy", sent, backend.policy_version + 1)
    compared = [n for n, d in ack.items() if d != OPAQUE]
    assert "model.embed_tokens.weight" in compared and any("norm" in n for n in compared)
    assert set(sent) <= set(ack)
    # every prepacked linear is read back through its kernel (none is acknowledged by name only, OPAQUE), and the
    # tied LM head's packed copy of the embedding too
    assert [n for n in sent if ack[n] == OPAQUE] == []
    assert any(ack[n].startswith(READBACK) for n in sent if n.endswith("q_proj.weight"))
    assert ack["model.embed_tokens.weight" + HEAD_SUFFIX].startswith(READBACK)
    refit(backend, "drafter", hf_named_tensors(perturbed(model, seed=2)), 1)


def test_a_dropped_drafter_refit_is_caught(backend, model, monkeypatch):
    refit(backend, "drafter", hf_named_tensors(model), 2)
    _faulty_rpc(monkeypatch, backend, "specrl_load_drafter", lambda pairs: None)
    with pytest.raises(RefitError, match=r"\(drafter, version 3\).*vllm"):
        refit(backend, "drafter", hf_named_tensors(perturbed(model, seed=3)), 3)


def test_a_partial_policy_load_is_caught(backend, model, monkeypatch):
    refit(backend, "policy", hf_named_tensors(model), backend.policy_version + 1)
    _faulty_rpc(monkeypatch, backend, "specrl_load_policy", lambda pairs: [p for p in pairs if "norm" not in p[0]])
    with pytest.raises(RefitError, match=r"vllm.*other values.*norm"):
        refit(backend, "policy", hf_named_tensors(perturbed(model, seed=4)), backend.policy_version + 1)


def test_a_load_into_the_wrong_layer_name_is_caught(backend, model, monkeypatch):
    refit(backend, "policy", hf_named_tensors(model), backend.policy_version + 1)
    a, b = "model.layers.0.input_layernorm.weight", "model.layers.1.input_layernorm.weight"
    swap = {a: b, b: a}
    _faulty_rpc(monkeypatch, backend, "specrl_load_policy", lambda pairs: [(swap.get(n, n), t) for n, t in pairs])
    with pytest.raises(RefitError, match=r"other values.*\.[01]\.input_layernorm"):
        refit(backend, "policy", hf_named_tensors(perturbed(model, seed=5)), backend.policy_version + 1)


def test_an_old_version_reported_as_new_is_caught(backend, model, monkeypatch):
    refit(backend, "policy", hf_named_tensors(model), backend.policy_version + 1)
    _faulty_rpc(monkeypatch, backend, "specrl_load_policy", lambda pairs: None)
    v = backend.policy_version + 1
    with pytest.raises(RefitError, match=rf"\(policy, version {v}\).*vllm"):
        refit(backend, "policy", hf_named_tensors(perturbed(model, seed=6)), v)


def test_a_tied_head_left_with_the_old_packed_embedding_is_caught(backend, model, monkeypatch):
    """The failure the worker records (the LM head's GEMM kept the old embedding after a reload): without the
    repack, the acknowledgement's readback of the head differs from the embedding that was sent."""
    import specrl.backends.vllm_worker as worker

    refit(backend, "policy", hf_named_tensors(model), backend.policy_version + 1)
    monkeypatch.setattr(worker, "repack_embeddings", lambda m: None)
    sent = hf_named_tensors(model)
    sent["model.embed_tokens.weight"] = sent["model.embed_tokens.weight"] * 1.05
    with pytest.raises(RefitError, match=r"other values.*embed_tokens\.weight#lm_head"):
        refit(backend, "policy", sent, backend.policy_version + 1)
