"""Which float32 weight layout is fastest at decode, and is it exact? Side by side with `F.linear`, one run.

At the embedded model's decode shapes, three products of the same [rows, in] x [out, in]^T: `F.linear` on the
weight as `nn.Linear` stores it (row by row), oneDNN's prepacked product (what the engine runs in bf16), and
`F.linear` on the same matrix stored column-major (what `specrl.model.packed` runs in float32). Each row gives the
milliseconds, the speed-up over plain `F.linear`, and whether the product is bitwise `F.linear`'s (else its largest
relative difference). The output names the processor class, cores, threads and dtype (`"hardware"`; the
`[bench] hardware:` line goes to stderr, stdout is the JSON).

    .venv/bin/python benchmarks/packed_fp32.py --threads 1 [--repeats 20]
"""

from __future__ import annotations

import argparse
import functools
import json
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import run_header  # noqa: E402

SHAPES = [(1, 576, 1536), (3, 576, 1536), (4, 576, 1536), (8, 576, 1536), (32, 576, 1536), (8, 1536, 576),
          (32, 1536, 576), (8, 576, 576), (32, 576, 576), (1, 576, 49152), (3, 576, 49152), (4, 576, 49152),
          (8, 576, 49152), (32, 576, 49152)]  # [rows, in] x [in, out]


def _time(f, repeats: int) -> float:
    for _ in range(3):
        f()
    t0 = time.perf_counter()
    for _ in range(repeats):
        f()
    return (time.perf_counter() - t0) / repeats * 1e3


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--repeats", type=int, default=20)
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    hw = run_header({"linear": "float32"}, a.threads, file=sys.stderr)
    g = torch.Generator().manual_seed(0)
    rows = []
    for m, k, n in SHAPES:
        w, x = torch.randn(n, k, generator=g), torch.randn(m, k, generator=g)
        pw = torch.ops.mkldnn._reorder_linear_weight(w, 1)
        plain = functools.partial(F.linear, x, w)
        packed = functools.partial(torch.ops.mkldnn._linear_pointwise, x, pw, None, "none", [], "")
        column = functools.partial(F.linear, x, w.t().contiguous().t())
        reps = a.repeats if n < 10_000 else max(2, a.repeats // 6)
        tp, tk, tc = _time(plain, reps), _time(packed, reps), _time(column, reps)
        want = plain()
        rel = float(((column() - want).abs().max() / want.abs().max()).item())
        rows.append({"shape": [m, k, n], "f_linear_ms": round(tp, 4), "packed_ms": round(tk, 4),
                     "speedup": round(tp / tk, 3), "bitwise_equal": bool(torch.equal(want, packed())),
                     "column_major_ms": round(tc, 4), "column_major_speedup": round(tp / tc, 3),
                     "column_major_bitwise_equal": bool(torch.equal(want, column())),
                     "column_major_max_rel_diff": rel})
    print(json.dumps({"hardware": hw, "threads": a.threads, "dtype": "float32", "rows": rows},
                     indent=1))


if __name__ == "__main__":
    main()
