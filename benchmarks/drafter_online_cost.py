"""The online drafter's cost as a share of an RL step: the learner's seconds with drafter.online true and false.

The config (default examples/think.yaml: long step-by-step replies, EAGLE drafter `eagle:think`) runs --steps sync
steps with drafter.online=true and drafter.online_mode=every_step (the "online" arm). After each step, a second
learner built from the same seed with drafter.online=false (the "frozen" arm: it captures nothing and trains no
drafter) trains on that step's own rollouts; the policy update does not depend on the drafter, so the two policies
stay bit-identical (checked and printed every step) and both learners do the same policy work on the same tokens.
The learner-side difference is the drafter's.

It prints per step and on average: both learners' seconds (`logprob` + `train` stages), the seconds of the drafter
trainer's part (`Learner.train_drafter`: the drafter's updates, staleness loop and collapse check, timed directly),
the seconds of capturing its inputs (the learner-side extra minus those updates: hidden states and top-K in the
policy's forward, packing), the online step's seconds, and the drafter's gradient norm before its clip beside the
policy's. The drafter's share of a step is (learner seconds online - frozen) / the online step's seconds; the
updates' share alone is printed beside it. Writes OUT (JSON, with the `"hardware"` record).

    .venv/bin/python benchmarks/drafter_online_cost.py --steps 2 --threads 1 [--config examples/think.yaml] \\
        [--set key=value ...] [--out runs/drafter_online_cost.json]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import config_dtypes, run_header  # noqa: E402

ONLINE = ["drafter.online=true", "drafter.online_mode=every_step"]
FROZEN = ["drafter.online=false"]


def learner_seconds(rec) -> float:
    return rec.stage_seconds["logprob"] + rec.stage_seconds["train"]


def run(config: str, sets: list[str], steps: int) -> list[dict]:
    """`steps` sync steps of the online arm; after each, the frozen arm's learner trains on the same rollouts.
    Per step: both arms' stage seconds, the drafter trainer's seconds, gradient norms, and whether the two
    policies are still bit-identical."""
    import torch

    from specrl.trainer.config_check import load_config
    from specrl.trainer.sync_trainer import GRPOTrainer, seed_everything

    def build(extra: list[str], label: str) -> GRPOTrainer:
        cfg = load_config(config, [*sets, *extra, f"run.steps={steps}", "run.checkpoint_every=0"])
        seed_everything(cfg.run.seed)
        t = GRPOTrainer.from_config(cfg)
        t.log = lambda msg: print(f"[{label}] {msg}", flush=True)
        return t

    online, frozen = build(ONLINE, "online"), build(FROZEN, "frozen")
    learner, drafter_seconds = online.learner, []
    real = learner.train_drafter

    def timed(batch, al):
        t = time.perf_counter()
        try:
            return real(batch, al)
        finally:
            drafter_seconds.append(time.perf_counter() - t)

    learner.train_drafter = timed
    out = []
    for _ in range(steps):
        rec = online.step()
        r = online.last_rollouts
        producer = {k: rec.stage_seconds[k] for k in ("data", "prepare", "gen")}
        frec = frozen.learner.learn(r, producer)  # the same rollouts, the same (bit-identical) policy
        same = all(torch.equal(v, frozen.policy.state_dict()[k]) for k, v in online.policy.state_dict().items())
        dgn = learner.drafter_trainer.grad_norms  # this step's drafter gradient norms, before its clip
        row = {"step": rec.step, "generated_tokens": rec.generated_tokens, "acceptance_length": rec.acceptance_length,
               "online_stage_seconds": rec.stage_seconds, "frozen_stage_seconds": frec.stage_seconds,
               "step_seconds": rec.step_seconds, "drafter_seconds": drafter_seconds[-1],
               "draft_updates": rec.draft_updates, "draft_refreshed": rec.draft_refreshed, "draft_loss": rec.draft_loss,
               "grad_norm": rec.grad_norm, "draft_grad_norm": statistics.fmean(dgn) if dgn else None,
               "policies_identical": same}
        out.append(row)
        print(f"step {rec.step}: {rec.generated_tokens} tokens, AL {rec.acceptance_length:.2f}; learner online "
              f"{learner_seconds(rec):.2f} s (drafter trainer {drafter_seconds[-1]:.2f} s, {rec.draft_updates} "
              f"updates{', refreshed' if rec.draft_refreshed else ''}), frozen {learner_seconds(frec):.2f} s; gen "
              f"{rec.stage_seconds['gen']:.2f} s, step {rec.step_seconds:.2f} s; gradient norm: policy "
              f"{rec.grad_norm:.3g}" + (f", drafter {statistics.fmean(dgn):.3g} (before its clip)" if dgn else "")
              + f"; policies identical: {same}", flush=True)
    online.close()
    frozen.close()
    return out


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--config", default="examples/think.yaml")
    ap.add_argument("--steps", type=int, default=2, help="RL steps")
    ap.add_argument("--threads", type=int, default=1, help="torch threads")
    ap.add_argument("--set", dest="sets", action="append", default=[], metavar="KEY=VALUE",
                    help="config override (repeatable), as for `specrl train --set`")
    ap.add_argument("--out", default="runs/drafter_online_cost.json")
    a = ap.parse_args(argv)
    import torch

    torch.set_num_threads(a.threads)
    hardware = run_header(config_dtypes(a.config, a.sets), a.threads)
    rows = run(a.config, a.sets, a.steps)

    def mean(f) -> float:
        return statistics.fmean(f(x) for x in rows)

    train_on = mean(lambda x: x["online_stage_seconds"]["train"])
    train_off = mean(lambda x: x["frozen_stage_seconds"]["train"])
    learner_on = mean(lambda x: x["online_stage_seconds"]["train"] + x["online_stage_seconds"]["logprob"])
    learner_off = mean(lambda x: x["frozen_stage_seconds"]["train"] + x["frozen_stage_seconds"]["logprob"])
    step_on, updates_s = mean(lambda x: x["step_seconds"]), mean(lambda x: x["drafter_seconds"])
    extra = learner_on - learner_off
    share, update_share = extra / step_on, updates_s / step_on
    result = {"config": a.config, "sets": a.sets, "steps": rows, "hardware": hardware,
              "train_seconds_online": train_on, "train_seconds_frozen": train_off, "step_seconds_online": step_on,
              "drafter_learner_seconds": extra, "drafter_update_seconds": updates_s,
              "capture_seconds": extra - updates_s, "drafter_share_of_step": share,
              "drafter_update_share_of_step": update_share}
    print(f"train stage per step: online {train_on:.2f} s, frozen {train_off:.2f} s (same rollouts); online step "
          f"{step_on:.2f} s")
    print(f"online drafter: {extra:.2f} s of the learner per step = {share:.1%} of the online step (its updates "
          f"{updates_s:.2f} s = {update_share:.1%}; capturing its inputs {extra - updates_s:.2f} s)")
    out = Path(a.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {out}")
    return result


if __name__ == "__main__":
    main()
