"""The config checked against the registries that own its names, right after loading and before any training work.

`specrl.config` is a leaf: it knows a loss, a rollout backend and a drafter spec only as strings. This module asks
each registry about the name it owns, where that registry is looked up: `specrl.algorithms.losses` (`grpo.loss_type`,
and the loss's clip range and std scaling, filled in where the config leaves them unset), `specrl.backends.registry`
(`rollout.backend`) and `specrl.rollout.drafter_spec` (`speculative.drafter`, and whether `drafter.online` can train
it). Problems are reported as the config's own errors are (`invalid SOURCE:` then one `path: problem` line each).
`load_config` / `validate_config` are `specrl.config.schema`'s, followed by `check_config`: what every entry point
that takes a user's config calls (the CLI, `specrl.train`, the run directory, the async actors).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from specrl.algorithms.losses import check_loss_name, clip_range, scales_by_std
from specrl.backends.registry import check_backend_name
from specrl.config import schema
from specrl.config.schema import TrainConfig
from specrl.errors import SpecRLError
from specrl.rollout.drafter_spec import parse_drafter_spec


def _problems(cfg: TrainConfig) -> list[str]:
    """One `path: problem` line per name a registry refuses; fills the loss's clip defaults on the way."""
    out = []
    g = cfg.grpo
    try:
        check_loss_name(g.loss_type)
    except SpecRLError as e:
        out.append(f"grpo.loss_type: {e}")
    else:
        low, high = clip_range(g.loss_type, g.clip_low, g.clip_high)
        object.__setattr__(g, "clip_low", low)  # the loss's default where unset (as pydantic would have set it)
        object.__setattr__(g, "clip_high", high)
        if g.normalize_rewards and not scales_by_std(g.loss_type, None):
            out.append(f"grpo: loss_type={g.loss_type} does not divide advantages by the group std, but "
                       "normalize_rewards=true asks for it; leave normalize_rewards unset (or false), or choose a "
                       "loss_type that scales by the std (dapo, grpo, gspo)")
    try:
        spec = parse_drafter_spec(cfg.speculative.drafter)
    except SpecRLError as e:
        out.append(f"speculative.drafter: {e}")
    else:
        if cfg.drafter.online and not spec.info.trainable:
            out.append(f"config: drafter.online trains a learned drafter, but speculative.drafter is "
                       f"{cfg.speculative.drafter!r}; use eagle:PATH / eagle:default / mtp:PATH or "
                       "drafter.online=false")
    try:
        check_backend_name(cfg.rollout.backend)
    except SpecRLError as e:
        out.append(f"rollout.backend: {e}")
    return out


def check_config(cfg: TrainConfig, source: str = "config") -> TrainConfig:
    """`cfg` with every registry-owned name checked (and the loss's clip defaults filled in); a SpecRLError listing
    every problem otherwise."""
    problems = _problems(cfg)
    if problems:
        raise SpecRLError(f"invalid {source}:\n  " + "\n  ".join(problems))
    return cfg


def validate_config(data: dict[str, Any], source: str = "config") -> TrainConfig:
    """A nested dict validated into a TrainConfig (`specrl.config.schema.validate_config`), then checked."""
    return check_config(schema.validate_config(data, source), source)


def load_config(path: str | Path | None, sets: list[str] | None = None) -> TrainConfig:
    """A YAML config (or the defaults) with --set overrides (`specrl.config.schema.load_config`), then checked."""
    return check_config(schema.load_config(path, sets), schema.describe_source(path, sets))
