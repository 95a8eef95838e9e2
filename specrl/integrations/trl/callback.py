"""The end of training: the losslessness certificate of the final policy and drafter, in TRL's logs.

`SpecRLCallback` is added to the trainer by the rollout function's first call. At `on_train_end` it loads the
trainer's final weights into the engine (acknowledged like every refit), samples continuations of the run's own
prompts through the engine its rollouts used (its drafter, verify mode, batch and k policy: auto k as it learned
during training; the tokens per draft position are recorded), tests them against an fp32 copy of the final policy
with the losslessness probe (`specrl.backends.probe`), logs `specrl/certificate_*` through `trainer.log` and writes
`OUTPUT_DIR/specrl_certificate[.rankN].json`. Plain decoding (no drafter) and greedy sampling get no certificate.
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

from transformers import TrainerCallback

MAX_PROMPTS = 4


def certify(rollouts, trainer, num_samples: int, target_w: float) -> dict[str, Any] | None:
    """The probe's result on the engine as the run ended, or None where no certificate applies."""
    import torch

    from specrl.backends.probe import chat_prompts, probe_backend
    from specrl.errors import SpecRLError
    from specrl.integrations.trl.weights import engine_model
    from specrl.rollout.engine import RolloutEngine
    from specrl.rollout.sampling import SamplingParams
    from specrl.run.certificate import POWER, sample_size

    if not rollouts.speculative or float(trainer.temperature) <= 0:
        return None
    rollouts.sync(trainer)
    engine = rollouts.engine
    k = rollouts.num_draft_tokens if isinstance(rollouts.num_draft_tokens, int) else engine.k_max  # the deepest
    policy = f"k={rollouts.num_draft_tokens}" + ("" if isinstance(rollouts.num_draft_tokens, int) else f" (0..{k})")
    prompts = rollouts.seen_prompts[:MAX_PROMPTS] or chat_prompts(rollouts.tokenizer)
    samples, tokens = sample_size(k, target_w, num_samples=max(num_samples, len(prompts)))
    print(f"[specrl] losslessness certificate: {samples} continuations x {tokens} tokens = {samples * tokens} tokens "
          f"at {policy}, sized to detect a bias of Cohen's w >= {target_w:g} with power {POWER:g}", flush=True)
    reference = engine_model(rollouts.model, torch.float32, trainer.accelerator.device)
    backend = engine  # the run's own decoding path: the engine (native or vLLM) its rollouts used
    if isinstance(engine, RolloutEngine) and max(len(p) for p in prompts) + tokens > engine.max_seq_len:
        raise SpecRLError(f"the certificate's {tokens}-token continuations of the run's prompts do not fit the "
                          f"engine's max_seq_len {engine.max_seq_len}: pass rollout_func(max_seq_len=...) or "
                          "certificate=False")
    setting = (f"TRL's final policy and drafter ({rollouts.drafter_spec}), {policy}, verify={rollouts.verify}, "
               f"T={trainer.temperature}, top_p={trainer.top_p}, top_k={trainer.top_k}")
    t0 = time.perf_counter()
    r = probe_backend(backend, reference, prompts,
                      SamplingParams(temperature=float(trainer.temperature), top_p=float(trainer.top_p or 1.0),
                                     top_k=int(trainer.top_k or 0), seed=rollouts.seed),
                      num_samples=samples, num_tokens=tokens, power_target=POWER, setting=setting, target_w=target_w)
    return {**r.as_dict(), "k": rollouts.num_draft_tokens, "policy_version": rollouts.version,
            "seconds": time.perf_counter() - t0, "summary": r.summary()}


class SpecRLCallback(TrainerCallback):
    """Runs the certificate when training ends and puts its figures in the trainer's logs."""

    def __init__(self, rollouts):
        self.rollouts = rollouts

    def on_train_end(self, args, state, control, **kwargs):
        r = self.rollouts
        if not r.certificate_enabled or r.trainer is None:
            return
        cert = certify(r, r.trainer, r.certificate_samples, r.certificate_target_w)
        if cert is None:
            return
        r.certificate = cert
        out = Path(args.output_dir)
        out.mkdir(parents=True, exist_ok=True)
        suffix = f".rank{r.process_index}" if r.process_index else ""
        (out / f"specrl_certificate{suffix}.json").write_text(json.dumps(cert, indent=1) + "\n")
        r.trainer.log({"specrl/certificate_passed": float(cert["passed"]),
                       "specrl/certificate_p_value": cert["p_value"],
                       "specrl/certificate_detectable_w": cert["detectable_w"],
                       "specrl/certificate_tokens": float(cert["num_tokens"]),
                       "specrl/certificate_target_w": cert["target_w"],
                       "specrl/certificate_positions_tested": float(sum(bool(p.get("tested"))
                                                                        for p in cert["positions"])),
                       "specrl/certificate_positions_not_tested": float(sum(not p.get("tested")
                                                                            for p in cert["positions"])),
                       "specrl/certificate_seconds": cert["seconds"]})
