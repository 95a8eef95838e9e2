"""A run's own losslessness certificate: the verifier's distribution test on the run's final policy and drafter.

At the end of a speculative run, `certify` samples continuations of the task's validation prompts through the
rollout engine the run ended with (its final policy weights, its drafter as synced, the run's temperature /
top-p / top-k, verify mode and k: the configured k, or k_max where the run chose k itself, so every draft depth
is verified) and tests them against that policy's exact distribution with the losslessness probe
(`specrl.backends.probe`: a chi-square test of the randomised probability integral transform of every sampled
token), sized from a target bias (`TARGET_W`, Cohen's w, at power `POWER`: the tokens needed grow as 1 / w^2)
and announced before it samples. It returns the probe's result (p-value, the smallest effect it detects, tokens
tested, the accepted drafts per depth and the bonus tokens, and each position's power: a depth with too few tokens
for the target is "not tested"), which the run prints beside its speed-up and writes to `certificate.json`; a
compare fails when it does not pass. Greedy runs (T = 0) are checked token for token elsewhere and get no
certificate; an async run's engines live in Ray workers and are not probed here (the start-up probe covers vLLM).
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

from specrl.errors import SpecRLError

TARGET_W = 0.10  # the bias (Cohen's w) the pooled test detects with power POWER: it sizes the sample
POWER = 0.99
NUM_SAMPLES = 192  # the fewest continuations of max(8, k + 2) tokens each (its cost: docs/losslessness.md)
MAX_PROMPTS = 4
PROBE_BATCH = 64  # sequences verified at once (the batch does not change the distribution, only the time)


def sample_size(k: int, target_w: float = TARGET_W, alpha: float = 1e-3, bins: int = 10,
                num_samples: int = NUM_SAMPLES) -> tuple[int, int]:
    """(continuations, tokens each) that detect `target_w` at power POWER: the tokens needed grow as 1 / w^2."""
    from specrl.backends.probe import tokens_needed

    tokens = max(8, k + 2)  # every draft depth reached by each sequence's first verify step
    need = tokens_needed(target_w, bins - 1, alpha, POWER)
    return max(num_samples, -(-need // tokens)), tokens


def certify(trainer: Any, num_samples: int = NUM_SAMPLES, alpha: float = 1e-3,
            target_w: float = TARGET_W) -> dict[str, Any] | None:
    """The certificate of a sync trainer's final state, or None (with no test run) where none applies."""
    from specrl.backends.probe import probe_backend
    from specrl.rollout.engine import RolloutEngine
    from specrl.rollout.sampling import SamplingParams

    cfg = trainer.cfg
    sc, g = cfg.speculative, cfg.generation
    backend = getattr(getattr(trainer, "producer", None), "backend", None)
    if not sc.enabled or g.temperature <= 0 or not isinstance(backend, RolloutEngine) or backend.drafter is None:
        return None
    k = sc.num_draft_tokens if isinstance(sc.num_draft_tokens, int) else backend.k_max
    producer = trainer.producer
    split = "val" if len(producer.val_data) else "train"
    n = min(MAX_PROMPTS, len(producer.val_data if split == "val" else producer.train_data))
    prompts = [producer.prompt(split, i) for i in range(n)]
    samples, tokens = sample_size(k, target_w, alpha, num_samples=max(num_samples, n))
    print(f"[specrl] losslessness certificate: {samples} continuations x {tokens} tokens = {samples * tokens} "
          f"tokens at k={k}, sized to detect a bias of Cohen's w >= {target_w:g} with power {POWER:g}", flush=True)
    engine = RolloutEngine(backend.model, max_batch_size=PROBE_BATCH,
                           max_seq_len=max(len(p) for p in prompts) + tokens + k + 2, drafter=backend.drafter,
                           num_draft_tokens=k, verify=sc.verify, k_max=max(k, 1))
    t0 = time.perf_counter()
    setting = (f"the run's final policy and drafter ({sc.drafter}), k={k}, verify={sc.verify}, T={g.temperature}, "
               f"top_p={g.top_p}, top_k={g.top_k}")
    r = probe_backend(engine, backend.model, prompts, SamplingParams(temperature=g.temperature, top_p=g.top_p,
                                                                       top_k=g.top_k, seed=cfg.run.seed),
                      num_samples=samples, num_tokens=tokens, alpha=alpha, power_target=POWER, setting=setting,
                      target_w=target_w)
    return {**r.as_dict(), "k": k, "seconds": time.perf_counter() - t0, "summary": r.summary()}


def write_certificate(run_dir: Path, cert: dict[str, Any] | None) -> None:
    if cert is not None:
        (Path(run_dir) / "certificate.json").write_text(json.dumps(cert, indent=1) + "\n")


def line(cert: dict[str, Any] | None) -> str:
    """One line for the run's summary."""
    if cert is None:
        return "losslessness certificate: none (no speculation, greedy, or an async run)"
    verdict = "PASS" if cert["passed"] else "FAIL"
    untested = [p["position"] for p in cert.get("positions", []) if not p["tested"]]
    per = (f"; accepted drafts per depth {cert['accepted_per_position']}, bonus tokens {cert['bonus_tokens']}; "
           f"not tested (too few tokens for w <= {cert['target_w']:g}): {', '.join(untested) or 'none'}"
           if cert.get("positions") else "")
    return (f"losslessness certificate: {verdict} — p = {cert['p_value']:.3g} (alpha {cert['alpha']:g}) over "
            f"{cert['num_tokens']} tokens at k={cert['k']}; detects a bias of Cohen's w >= "
            f"{cert['detectable_w']:.3f} with power {cert['power_target']:g} ({cert['seconds']:.0f} s){per}")


def require(cert: dict[str, Any] | None, report: Path) -> None:
    """Raise when a certificate failed (a compare exits non-zero)."""
    if cert is not None and not cert["passed"]:
        raise SpecRLError(f"the speculative run's own losslessness certificate failed: {cert['summary']}; see "
                          f"{report}. The sampler does not draw from the policy's distribution at these settings")
