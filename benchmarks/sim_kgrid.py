"""The simulator's speculative step cost against the engine's measured k = 1..7 grid on this CPU (no engine run).

Run: .venv/bin/python benchmarks/sim_kgrid.py [--doc docs/speculative_benchmarks.md] [--threads 1] [--context 80]

Reads the first `spec_vs_ar.py` table of docs/speculative_benchmarks.md (EAGLE head on SmolLM2-135M, B = 1, 4,
16, 32, k = 1..7, one torch thread) and, for every (B, k), prices with the calibrated CPU factors (`cpu_efficiency`
in specrl/sim/calibration/calibrated.py) on the measured `cpu` profile re-expressed for --threads cores:
  v  = verify forward over B·(k+1) tokens ÷ a plain decode step over B tokens (measured column `v`),
  c  = one drafter forward ÷ a plain decode step (measured column `c`),
  hw = AL / (v + k·c), the decode speedup these costs allow at the measured AL (measured column `hw_ideal`).
The context per sequence (prompt + half the response) is --context tokens. The first line names this machine's
processor class and cores, --threads and the simulated precision (bf16, as the grid was measured).
"""

from __future__ import annotations

import argparse
import re
import statistics
import sys
from pathlib import Path

from specrl.sim.calibration.fromrun import cpu_efficiency
from specrl.sim.costs.accelerators import get_hardware, with_threads
from specrl.sim.costs.models import eagle3_head, get_model
from specrl.sim.costs.roofline import ForwardCost

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import run_header  # noqa: E402

ROW = re.compile(r"^\s*eagle\s+(\d+)\s+(\d+)\s+([\d.]+)x\s+([\d.]+)\s+([\d.]+)\s+[\d.]+\s+[\d.]+\s+[\d.]+\s+"
                 r"([\d.]+)\s+([\d.]+)\s+([\d.]+)x")


def read_grid(doc: Path) -> list[dict]:
    """Rows of the first table (the full k = 1..7 grid) of docs/speculative_benchmarks.md."""
    text = doc.read_text()
    start = text.index("## Full grid")
    block = text[start:text.index("```", text.index("```", start) + 3)]
    rows = []
    for line in block.splitlines():
        m = ROW.match(line)
        if m:
            b, k, sp, al, c, v, hw, dec = m.groups()
            rows.append({"B": int(b), "k": int(k), "speedup": float(sp), "AL": float(al), "c": float(c),
                         "v": float(v), "hw_ideal": float(hw), "dec": float(dec)})
    if not rows:
        raise SystemExit(f"no eagle k-grid rows found in {doc}")
    return rows


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--doc", default=str(Path(__file__).resolve().parents[1] / "docs" / "speculative_benchmarks.md"))
    ap.add_argument("--threads", type=int, default=1, help="torch threads the grid was measured with")
    ap.add_argument("--context", type=float, default=80.0)
    ap.add_argument("--draft-vocab", type=int, default=None, help="the EAGLE head's draft vocabulary (default: full)")
    ap.add_argument("--cpu-profile", default=None)
    a = ap.parse_args()
    run_header({"simulated": "bf16"}, a.threads)
    eff = cpu_efficiency()
    hw = with_threads(get_hardware("cpu", a.cpu_profile), a.threads)
    target = get_model("smollm2-135m")
    head = eagle3_head(target, a.draft_vocab or target.vocab)
    t = ForwardCost(target, hw, eff, "bf16", 1, eff.step_overhead_s)
    d = ForwardCost(head, hw, eff, "bf16", 1, eff.draft_overhead_s)
    print(f"cpu {hw.threads} thread(s): bf16 {hw.flops('bf16') / 1e9:.0f} GFLOP/s x flops_eff {eff.flops_eff:.3f}, "
          f"step overhead {eff.step_overhead_s * 1e3:.1f} ms, draft overhead {eff.draft_overhead_s * 1e3:.2f} ms, "
          f"{eff.decode_seq_overhead_s * 1e3:.2f} ms per sequence per decode step")
    print(f"{'B':>3}{'k':>3}{'AL':>6}{'v meas':>8}{'pred':>6}{'c meas':>8}{'pred':>6}{'hw meas':>9}{'pred':>6}"
          f"{'dec meas':>10}")
    errs = {"v": [], "c": [], "hw": []}
    for r in read_grid(Path(a.doc)):
        b, k = r["B"], r["k"]
        kv = b * a.context
        host = b * eff.decode_seq_overhead_s  # per-sequence host work of every decode step
        ar = t(b, kv) + host
        v = (t(b * (k + 1), kv, attn_pairs=(k + 1) * kv) + host) / ar
        c = d(b, kv) / ar
        hw_pred = r["AL"] / (v + k * c)
        for key, p in (("v", v), ("c", c), ("hw", hw_pred)):
            errs[key].append(abs(p - r["hw_ideal" if key == "hw" else key]) / r["hw_ideal" if key == "hw" else key])
        print(f"{b:>3}{k:>3}{r['AL']:>6.2f}{r['v']:>8.2f}{v:>6.2f}{r['c']:>8.3f}{c:>6.3f}{r['hw_ideal']:>9.2f}"
              f"{hw_pred:>6.2f}{r['dec']:>9.2f}x")
    print("median |error|: " + ", ".join(f"{k} {100 * statistics.median(v):.0f}%" for k, v in errs.items()))


if __name__ == "__main__":
    main()
