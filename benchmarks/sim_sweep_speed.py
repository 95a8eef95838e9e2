"""Time a 100-configuration sweep of the paper-235b preset (it must finish in under a minute).

Run: .venv/bin/python benchmarks/sim_sweep_speed.py
80 cells of k (3..10) x acceptance length (1.25..4) plus 20 cells of GPU count (5 values) x policy lag (4 values).
Prints the wall time (with this machine's processor class and cores, which it depends on); no plots are drawn
(plotting is not part of the simulation cost).
"""

import argparse
import sys
import time
from pathlib import Path

from specrl.sim.scenarios import get_preset
from specrl.sim.sweep import grid_gpus_lag, grid_k_al

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import run_header  # noqa: E402


def main() -> None:
    argparse.ArgumentParser(description=__doc__.splitlines()[0]).parse_args()
    cfg = get_preset("paper-235b")
    run_header({"simulated": cfg.precision, "simulated_train": cfg.train_precision})
    ks = (3, 4, 5, 6, 7, 8, 9, 10)
    als = (1.25, 1.5, 1.75, 2.0, 2.25, 2.5, 2.75, 3.0, 3.5, 4.0)
    t0 = time.perf_counter()
    cache: dict = {}
    heat = grid_k_al(cfg, ks, als, cache)
    curves = grid_gpus_lag(cfg, (256, 512, 1024, 2048, 4096), (0, 1, 2, 4), cache)
    dt = time.perf_counter() - t0
    n = len(heat) + len(curves)
    simulated = sum(1 for r in heat if r["rollout_speedup"] == r["rollout_speedup"]) + len(curves)
    print(f"paper-235b sweep: {n} configurations ({simulated} simulated, "
          f"{n - simulated} cells with AL > k+1 skipped) in {dt:.1f} s ({dt / max(simulated, 1):.2f} s each)")
    best = max((r for r in heat if r["rollout_speedup"] == r["rollout_speedup"]), key=lambda r: r["step_speedup"])
    print(f"best cell: k={best['k']} AL={best['acceptance_length']} rollout {best['rollout_speedup']:.2f}x "
          f"step {best['step_speedup']:.2f}x")


if __name__ == "__main__":
    main()
