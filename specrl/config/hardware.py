"""A training config's hardware settings resolved once, at the start of a run: device and precisions.

`resolve_hardware(cfg)` returns the config with `run.device`, `model.rollout_dtype`, `policy.precision` and (for
the vLLM backend) `rollout.vllm.dtype` turned from `auto` into concrete values by `specrl.device` (bf16 where the
device has bf16 matrix units, fp32 elsewhere). It is idempotent, so the run directory's `config.yaml`, written
after it, holds the resolved values, and a resumed run keeps them (an explicit bf16 resumed on a machine
without bf16 units is honoured, with `specrl.device`'s warning). `hardware_fields(cfg)` is what every step
record carries about it.
"""

from __future__ import annotations

from typing import Any

from specrl.config.schema import TrainConfig
from specrl.device import processor_class, resolve_device, resolve_dtype, resolve_precision


def resolve_hardware(cfg: TrainConfig) -> TrainConfig:
    """A copy of `cfg` with device and precision settings resolved (`auto` -> what this machine runs fast).

    Only those fields change (section copies, no re-validation of the rest: the config was validated when built).
    """
    dev = resolve_device(cfg.run.device)
    rollout_dtype = resolve_dtype(cfg.model.rollout_dtype, dev, "model.rollout_dtype")
    precision = resolve_precision(cfg.policy.precision, dev, "policy.precision")
    vc = cfg.rollout.vllm
    vllm_dtype = rollout_dtype if vc.dtype == "auto" else vc.dtype
    if vc.dtype != "auto" and cfg.rollout.backend == "vllm":
        resolve_dtype(vc.dtype, dev, "rollout.vllm.dtype")  # the warning for bf16 without bf16 units
    return cfg.model_copy(update={
        "run": cfg.run.model_copy(update={"device": str(dev)}),
        "model": cfg.model.model_copy(update={"rollout_dtype": rollout_dtype}),
        "policy": cfg.policy.model_copy(update={"precision": precision}),
        "rollout": cfg.rollout.model_copy(update={"vllm": vc.model_copy(update={"dtype": vllm_dtype})}),
    })


def hardware_fields(cfg: TrainConfig) -> dict[str, Any]:
    """The step record's resolved hardware settings (a config that still says auto is resolved first)."""
    if "auto" in (cfg.run.device, cfg.model.rollout_dtype, cfg.policy.precision):
        cfg = resolve_hardware(cfg)
    return {"device": cfg.run.device, "processor_class": processor_class(),
            "rollout_dtype": cfg.model.rollout_dtype, "precision": cfg.policy.precision}
