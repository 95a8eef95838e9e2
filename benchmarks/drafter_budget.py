"""Held-out acceptance length of an in-domain drafter against its training budget (rollouts x epochs).

Reads the rollouts an embedded drafter was built from (`data.jsonl` of e.g. eagle:think, ~/.cache/specrl/drafters/
smollm2-135m-eagle-think), trains a fresh drafter on the first N of them for each budget, and measures each one's
held-out acceptance length with the real engine on the workload's held-out prompts (never trained on), at the
workload's temperature and length. Prints one row per budget and writes --json ({"hardware": processor class, cores,
threads, dtypes; "rows": [...]}). The target runs in --dtype (auto: bf16 on CPUs with bf16 units, else float32).

    .venv/bin/python benchmarks/drafter_budget.py --name think --budgets 40,80,160,309 --epochs 3 --threads 1
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import DTYPES, dtype_name, run_header  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--name", default="think", help="embedded drafter build whose rollouts to reuse (default|think)")
    ap.add_argument("--kind", default="eagle")
    ap.add_argument("--budgets", default="40,80,160,309", help="numbers of training rollouts")
    ap.add_argument("--epochs", default="3", help="comma-separated epochs per budget")
    ap.add_argument("--lr", type=float, default=1e-3, help="peak learning rate (the first-use builds use 1e-3)")
    ap.add_argument("--k", type=int, default=3)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--json", default=None)
    ap.add_argument("--dtype", default="auto", choices=DTYPES,
                    help="the target's dtype for rollouts and features (auto: bf16 where the CPU has bf16 units)")
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    a.dtype = dtype_name(a.dtype)
    hw = run_header({"target": a.dtype}, a.threads)
    from specrl.drafters import default_drafter_dir
    from specrl.drafters.storage.default import DEFAULT_BUILDS, task_prompts
    from specrl.drafters.training.build.from_rollouts import train_drafter_offline

    b = DEFAULT_BUILDS[a.name]
    src = default_drafter_dir(a.kind, a.name) / "data.jsonl"
    if not src.exists():
        raise SystemExit(f"{src} is missing: build the drafter first (specrl prepare --drafter {a.kind}:{a.name})")
    rows = src.read_text().splitlines()
    print(f"{len(rows)} rollouts in {src}; T={b['temperature']} max_new_tokens={b['max_new_tokens']} k={a.k}")
    print(f"{'rollouts':>8} {'tokens':>8} {'epochs':>6} {'top1':>6} {'AL':>6} {'train_s':>8}", flush=True)
    out = []
    for n in [int(x) for x in a.budgets.split(",")]:
        if n > len(rows):
            raise SystemExit(f"budget {n} exceeds the {len(rows)} rollouts available")
        for ep in [int(x) for x in a.epochs.split(",")]:
            with tempfile.TemporaryDirectory() as tmp:
                data = Path(tmp) / "data.jsonl"
                data.write_text("\n".join(rows[:n]) + "\n")
                d = train_drafter_offline("smollm2-135m", a.kind, prompts=task_prompts(b["task"], 2,
                                                                               answer_format=b["answer_format"]),
                                  samples=n, epochs=ep, out=Path(tmp) / "out", data_jsonl=str(data),
                                  max_new_tokens=b["max_new_tokens"], temperature=b["temperature"], k=a.k, lr=a.lr,
                                  progress=False, dtype=a.dtype)
                rep = json.loads((d / "train_report.json").read_text())
            row = dict(rollouts=n, tokens=rep["tokens"], epochs=ep, lr=a.lr, heldout_top1=rep["heldout_top1"],
                       acceptance_length=rep["heldout_acceptance_length"], train_seconds=rep["seconds"])
            out.append(row)
            print(f"{n:>8} {row['tokens']:>8} {ep:>6} {row['heldout_top1']:>6.3f} {row['acceptance_length']:>6.2f} "
                  f"{row['train_seconds']:>8.0f}", flush=True)
    if a.json:
        Path(a.json).write_text(json.dumps({"hardware": hw, "rows": out}, indent=1) + "\n")


if __name__ == "__main__":
    main()
