"""Compare mode (the main job of `specrl run`, and `specrl train --compare`): the same config run autoregressively
and speculatively with the same seeds, steps interleaved so machine noise hits both arms, step 0 validated once for
both (the same initial weights, greedy), seed-exact identity checked after every step; `report.md` (led by the
speed-ups and the certificate, then the identity evidence) with `compare.json` / `compare.md` beside the two arms'
own run directories. Where the arms part (a numeric difference
between the verify forward and the plain one), the report says at which step; `specrl train --compare` then exits
with an error, `specrl run` finishes normally.
"""

from __future__ import annotations

from pathlib import Path

import torch

from specrl.config.schema import TrainConfig
from specrl.errors import SpecRLError
from specrl.observability.metrics import ProgressDisplay
from specrl.observability.step_record import read_records
from specrl.run import certificate
from specrl.run.compare_report import identity_checks, write_compare_report
from specrl.run.session import Budget, Run, certify_run, governor_for
from specrl.run.sizing import read_sizing
from specrl.trainer.config_check import validate_config
from specrl.trainer.weight_check import NonFiniteError


def weights_equal(a: torch.nn.Module, b: torch.nn.Module) -> bool:
    pb = dict(b.named_parameters())
    return all(torch.equal(p, pb[n]) for n, p in a.named_parameters())


_COMPARE = "a compare (`specrl run`, `specrl train --compare`)"


def shared_tokens(a: list[list[int]], b: list[list[int]]) -> dict[str, int]:
    """How far two arms' rollouts of one step agree: tokens in common before each pair of responses parts, summed,
    next to the tokens the two arms generated."""
    common = 0
    for x, y in zip(a, b, strict=True):
        n = 0
        for s, t in zip(x, y, strict=False):
            if s != t:
                break
            n += 1
        common += n
    return {"shared": common, "autoregressive": sum(map(len, a)), "speculative": sum(map(len, b))}


def run_compare(cfg: TrainConfig, run_dir: Path, stop_on_divergence: bool = True, resume: bool = False,
                started: float | None = None) -> Path:
    """Same config twice — autoregressive and speculative — steps interleaved; write report.md, compare.json/.md.

    The arms run in `run_dir/autoregressive` and `run_dir/speculative` (the latter is the training run to keep).
    With `stop_on_divergence`, a seed_exact compare whose arms parted raises `SpecRLError` after the reports are
    written; without it the run ends normally and the report says where they parted. With `resume`, each arm
    continues from its newest checkpoint (`run.checkpoint_every`); an arm that got further before the kill waits
    until the other has caught up, and the steps go on in pairs from there. `started`: when the command began, for
    `run.wall_budget_minutes` (default: SPECRL_WALL_START, else now)."""
    if cfg.pipeline.mode != "sync":
        raise SpecRLError(f"{_COMPARE} runs the sync pipeline twice, got pipeline.mode={cfg.pipeline.mode!r}; set "
                          "pipeline.mode=sync, or run this config alone with `specrl train --config FILE` "
                          "(benchmarks/pipelines.py compares sync and async)")
    if not cfg.speculative.enabled:
        raise SpecRLError(f"{_COMPARE} needs speculative rollouts to compare against: set speculative.drafter "
                          "(e.g. ngram or eagle:default) and speculative.num_draft_tokens > 0 or 'auto'")
    data = cfg.model_dump(mode="json")
    data["speculative"]["drafter"] = "none"
    data["drafter"]["online"] = False
    ar_cfg = validate_config(data, "compare (autoregressive copy)")
    display = ProgressDisplay(cfg.run.steps, cfg.run.progress, live=False)
    governor = governor_for(cfg)
    runs = {"autoregressive": Run(ar_cfg, run_dir / "autoregressive", resume, display),
            "speculative": Run(cfg, run_dir / "speculative", resume, display)}
    budget = Budget.for_run(cfg, started)
    for r in runs.values():
        (r.run_dir / "config.yaml").write_text(r.cfg.to_yaml())
    fresh = [r for r in runs.values() if r.trainer.step_count == 0]
    if len(fresh) == 2:
        # both arms hold the config's initial weights, and validation decodes greedily, so either engine gives the
        # same answers: step 0 is validated once, by plain decoding, and recorded for both arms; the final
        # validations of both arms are kept in the budget as two of this one
        v = runs["autoregressive"].validate(0)
        runs["speculative"].record_validation(0, {**v, "shared_from": "autoregressive"})
        budget.reserve += 2 * v["val_seconds"]
    else:  # resumed: an arm still at step 0 validates its own
        for r in fresh:
            budget.reserve += r.validate(0)["val_seconds"]
    exact = cfg.speculative.verify == "seed_exact"
    same_rollouts: list[bool] = []
    same_weights: list[bool] = []
    shared: list[dict[str, int]] = []  # per step: tokens the arms' rollouts shared before they parted
    ar, sd = runs["autoregressive"], runs["speculative"]
    try:
        while (target := min(r.trainer.step_count for r in runs.values()) + 1) <= cfg.run.steps:
            if not budget.fits_another():
                break
            budget.begin()
            threads = governor.update() if governor else None  # once per pair: both arms on the same threads
            stepped = [r.trainer.step_count < target for r in runs.values()]
            for name, r in runs.items():
                if r.trainer.step_count >= target:
                    continue  # resumed ahead of the other arm: wait for it
                rec = r.trainer.step()
                if threads is not None:
                    rec.torch_threads = threads
                r.after_step(rec, label="[ar]   " if name == "autoregressive" else "[spec] ")
            if not all(stepped):
                budget.end()
                continue
            shared.append(shared_tokens(ar.trainer.last_rollouts.responses, sd.trainer.last_rollouts.responses))
            if exact:
                same_rollouts.append(ar.trainer.last_rollouts.responses == sd.trainer.last_rollouts.responses)
                same_weights.append(weights_equal(ar.trainer.policy, sd.trainer.policy))
            budget.end()
        done = min(r.trainer.step_count for r in runs.values())
        budget_note = budget.note(done, cfg.run.steps) if done < cfg.run.steps else None
        if budget_note:
            display.message(f"[specrl] {budget_note}")
            if governor:
                governor.update()  # the final validation runs on the cores free now
            for r in runs.values():
                r.end_early(done, budget_note)
    except NonFiniteError as e:
        raise SpecRLError(f"compare run: {e}") from None
    for r in runs.values():
        r.finish()
    cert = certify_run(sd) if cfg.run.certify else None
    checks = {**identity_checks(cfg.speculative.verify, same_rollouts, same_weights), "shared_tokens_per_step": shared,
              "stopped_early": budget_note, "sizing": read_sizing(run_dir)}
    report, lines = write_compare_report(
        run_dir, read_records(ar.writer.path), read_records(sd.writer.path), checks,
        validation={name: read_records(r.val_path) for name, r in runs.items()}, certificate=cert)
    print("\n[specrl] " + lines[0] + ":\n" + "\n".join(f"  - {line}" for line in lines[1:]), flush=True)
    certificate.require(cert, report)
    bad = checks["parted_at_step"]
    if bad is not None and stop_on_divergence:
        raise SpecRLError(f"seed_exact compare: the autoregressive and speculative runs diverged at step {bad} "
                          f"(rollouts identical: {same_rollouts[bad - 1]}, weights identical: "
                          f"{same_weights[bad - 1]}); see {report}. seed_exact emits plain decoding's token wherever "
                          "the verify forward over k+1 tokens computes bit-identical logits to the plain one-token "
                          "forwards. On CPUs it does not in every (batch, k) shape, in bfloat16 nor in float32 "
                          "(tools/forward_shape_drift.py prints the differences for this machine; docs/results.md), "
                          "because GEMM kernels round B "
                          "and B*(k+1) rows differently; a uniform that falls within that rounding of a CDF boundary "
                          "picks another token and the runs part (float32 makes it rarer, not impossible). The "
                          "sampled distribution is exact either way; for runs that parted, compare.md's speed-up on "
                          "the autoregressive arm's work compares the same work")
    return run_dir
