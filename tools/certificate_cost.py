"""The end-of-run losslessness certificate (`specrl.run.certificate`) on a config's fresh trainer: its verdict,
tokens tested, detectable bias and wall time (what it adds to a run).

    .venv/bin/python tools/certificate_cost.py --set speculative.drafter=ngram --set drafter.online=false
"""

from __future__ import annotations

import argparse
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
    ap.add_argument("--threads", type=int, default=2)
    a = ap.parse_args(argv)
    torch.set_num_threads(a.threads)
    trainer = GRPOTrainer.from_config(load_config(a.config, a.overrides))
    t0 = time.perf_counter()
    cert = certify(trainer)
    print(f"{line(cert)}; wall {time.perf_counter() - t0:.1f} s, processor class {processor_class()}, "
          f"{a.threads} threads")


if __name__ == "__main__":
    main()
