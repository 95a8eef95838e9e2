"""The end-of-run losslessness certificate (`specrl.run.certificate`) on a config's fresh trainer: its plan,
verdict, tokens tested per position, detectable bias and wall time (what it adds to a run). The trainer's own
rollout engine is certified, so its k policy runs as configured (auto k starts unmeasured here, as at a run's
first step); with no steps run there is no measured speed, so the size follows run.certificate.target_w alone
(`--budget-seconds` with `--tokens-per-second` sizes it to a budget instead).

    .venv/bin/python tools/certificate_cost.py                    # examples/default.yaml: the main job
    .venv/bin/python tools/certificate_cost.py --json cert.json --set speculative.drafter=ngram
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
os.environ.setdefault("HF_HUB_OFFLINE", "1")


def main(argv: list[str] | None = None) -> None:
    import torch

    from specrl.device import processor_class
    from specrl.run.certificate import certify, line
    from specrl.trainer.config_check import load_config
    from specrl.trainer.sync_trainer import GRPOTrainer

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--config", default="examples/default.yaml")
    ap.add_argument("--set", action="append", default=[], dest="overrides")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--budget-seconds", type=float, default=None)
    ap.add_argument("--tokens-per-second", type=float, default=None, help="the run's speed, for a budget")
    ap.add_argument("--json", default=None)
    a = ap.parse_args(argv)
    torch.set_num_threads(a.threads)
    cfg = load_config(a.config, a.overrides + ["run.threads=" + str(a.threads)])
    trainer = GRPOTrainer.from_config(cfg)
    records = []
    if a.tokens_per_second:  # one record carrying the speed the budget is spent at
        from specrl.observability.step_record import StepRecord

        records = [StepRecord(step=1, step_seconds=1.0, stage_seconds={"gen": 1.0},
                              generated_tokens=int(a.tokens_per_second))]
    t0 = time.perf_counter()
    cert = certify(trainer, records, budget_seconds=a.budget_seconds)
    wall = time.perf_counter() - t0
    print(f"{line(cert)}; wall {wall:.1f} s, processor class {processor_class()}, {a.threads} threads")
    if a.json and cert is not None:
        Path(a.json).write_text(json.dumps({**cert, "wall_seconds": wall, "processor_class": processor_class(),
                                            "threads": a.threads}, indent=1) + "\n")


if __name__ == "__main__":
    main()
