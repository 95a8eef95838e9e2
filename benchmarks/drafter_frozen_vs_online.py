"""Frozen vs online-trained drafter: the same GRPO config run twice, acceptance length over the RL steps.

The "frozen" arm sets drafter.online=false (the engine keeps the drafter it loaded), the "online" arm
drafter.online=true (the trainer trains it every step, plus the staleness refreshes); both use the same seed
and run one after the other. Writes OUT/frozen and OUT/online (metrics.jsonl, config.yaml, report.md and its
plots, drafter_final/ = the engine's drafter after the last step, loadable as eagle:DIR / mtp:DIR) and
OUT/acceptance_frozen_vs_online.{png,json,md} (AL per step of both arms; mean AL over the first / last third; the
processor class, cores, threads and the dtypes the config resolves to on this machine: `"hardware"` in the JSON, a
line under the markdown's title). OUT/frozen and OUT/online are removed at the end unless --keep-runs; the
acceptance_frozen_vs_online files stay.

`--arms frozen` or `--arms online` runs one arm only (so the two can run at once, one core each, when only AL is
measured); an arm whose OUT/ARM already holds the asked steps of the same config (its config.yaml) is read, not
rerun, so after two such runs (with --keep-runs) a third call writes the comparison from both.

    .venv/bin/python benchmarks/drafter_frozen_vs_online.py --config examples/drafter_online.yaml --steps 30 \
        --out runs/frozen-vs-online [--drafter eagle:DIR] [--set key=value ...] [--threads 1] [--arms frozen]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import KEEP_RUNS_HELP, config_dtypes, hardware_line, run_dirs, run_header  # noqa: E402

ARMS = {"frozen": False, "online": True}


def run_arm(cfg, arm_dir: Path, label: str) -> list:
    """Train cfg for cfg.run.steps in arm_dir; return the step records."""
    from specrl.drafters.storage.io import save_drafter
    from specrl.observability.metrics import MetricsWriter, ProgressDisplay
    from specrl.observability.run_report import write_report
    from specrl.observability.step_record import read_records
    from specrl.trainer.sync_trainer import GRPOTrainer, seed_everything

    arm_dir.mkdir(parents=True, exist_ok=True)
    (arm_dir / "config.yaml").write_text(cfg.to_yaml())
    seed_everything(cfg.run.seed)
    trainer = GRPOTrainer.from_config(cfg)
    display = ProgressDisplay(cfg.run.steps, cfg.run.progress, live=False)
    trainer.log = display.message
    writer = MetricsWriter(arm_dir, tensorboard=False)
    try:
        for _ in range(cfg.run.steps):
            rec = trainer.step()
            writer.write(rec)
            display.update(rec, f"[{label}] ")
    finally:
        writer.close()
        display.close()
    # the online arm's newest drafter is the learner's; a frozen drafter lives only in the (native) backend
    final = trainer.drafter if trainer.drafter is not None else getattr(trainer.backend, "drafter", None)
    if final is not None and hasattr(final, "state_dict"):
        save_drafter(final, arm_dir / "drafter_final")
    records = read_records(writer.path)
    write_report(arm_dir, records, cfg.to_yaml())
    return records


def completed_records(arm_dir: Path, cfg) -> list | None:
    """The records of an arm that already ran cfg.run.steps steps in arm_dir with this very config, else None (a
    run of another config there is rerun, not read)."""
    from specrl.observability.step_record import read_records

    path, saved = arm_dir / "metrics.jsonl", arm_dir / "config.yaml"
    if not path.exists() or not saved.exists():
        return None
    if saved.read_text() != cfg.to_yaml():
        print(f"[specrl] {arm_dir} holds a run of another config: not read", flush=True)
        return None
    records = read_records(path)
    return records if len(records) >= cfg.run.steps else None


def main(argv: list[str] | None = None) -> Path:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--config", default="examples/drafter_online.yaml")
    ap.add_argument("--steps", type=int, default=None, help="RL steps per arm (default: the config's run.steps)")
    ap.add_argument("--out", default="runs/frozen-vs-online")
    ap.add_argument("--drafter", default=None, help="speculative.drafter override, e.g. eagle:DIR or mtp:DIR")
    ap.add_argument("--set", dest="sets", action="append", default=[], metavar="KEY=VALUE",
                    help="config override (repeatable), as for `specrl train --set`")
    ap.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's choice)")
    ap.add_argument("--keep-runs", action="store_true", help=KEEP_RUNS_HELP + ": here OUT/frozen and OUT/online")
    ap.add_argument("--arms", default=",".join(ARMS),
                    help="comma-separated arms to run (default: both); an arm already complete in OUT is read")
    a = ap.parse_args(argv)
    import torch

    from specrl.errors import SpecRLError
    from specrl.observability.acceptance_compare import write_acceptance_compare
    from specrl.trainer.config_check import load_config, validate_config

    if a.threads:
        torch.set_num_threads(a.threads)
    sets = list(a.sets)
    if a.steps is not None:
        sets.append(f"run.steps={a.steps}")
    if a.drafter is not None:
        sets.append(f"speculative.drafter={a.drafter}")
    base = load_config(a.config, sets)
    hw = run_header(config_dtypes(a.config, sets), a.threads)
    if base.speculative.drafter.partition(":")[0] not in ("eagle", "mtp") or not base.speculative.enabled:
        raise SpecRLError(f"frozen vs online compares a trainable drafter; speculative.drafter is "
                          f"{base.speculative.drafter!r} (k={base.speculative.num_draft_tokens}); use eagle:DIR or "
                          "mtp:DIR with num_draft_tokens > 0")
    out = Path(a.out)
    wanted = [x for x in a.arms.split(",") if x]
    unknown = sorted(set(wanted) - set(ARMS))
    if unknown:
        raise SpecRLError(f"--arms {a.arms!r}: unknown arm(s) {unknown}; the arms are {sorted(ARMS)}")
    runs = {}
    with run_dirs(a.keep_runs) as dirs:
        for arm, online in ARMS.items():
            data = base.model_dump(mode="json")
            data["drafter"]["online"] = online
            cfg = validate_config(data, f"{a.config} ({arm} arm)")
            done = completed_records(out / arm, cfg)
            if done is not None:
                print(f"[specrl] {arm}: {len(done)} steps read from {out / arm}/metrics.jsonl", flush=True)
                runs[arm] = done
            elif arm in wanted:
                runs[arm] = run_arm(cfg, dirs.add(out / arm), arm)
    if set(runs) != set(ARMS):
        print(f"[specrl] ran {sorted(runs)}; the comparison is written once every arm of {sorted(ARMS)} is in "
              f"{out} (run again with the missing --arms and --keep-runs)", flush=True)
        return out
    png, jpath, mpath = write_acceptance_compare(out, runs)
    jpath.write_text(json.dumps({"hardware": hw, **json.loads(jpath.read_text())}, indent=2) + "\n")
    title, _, rest = mpath.read_text().partition("\n")
    mpath.write_text(f"{title}\n\nhardware: {hardware_line(hw)}\n{rest}")
    print(mpath.read_text(), flush=True)
    print(f"[specrl] wrote {png}, {jpath}, {mpath}", flush=True)
    return out


if __name__ == "__main__":
    main()
