"""A finished (or killed) compare's speed-ups over ranges of steps, as compare.json computes them for the whole run.

A long compare passes through phases: the arms' replies shorten as the task is learned, and once the arms' samples
part (rejection sampling draws the same distribution, not the same tokens) their lengths can differ for many steps.
This reads both arms' `metrics.jsonl` under RUN (RUN/autoregressive, RUN/speculative), restricts them to each range
of steps given, and prints one markdown row per range with `specrl.run.compare_report.compare_summary`'s numbers:
generation and RL-step speed-ups per step and per generated token, the speculative arm's mean AL, the
autoregressive arm's generation share R, each arm's mean reply and the groups with a non-zero advantage.

Once the arms' replies differ in length, neither per-step nor per-token ratios compare the same work (a step of
10-token replies is mostly fixed costs; one of 250-token replies mostly decoding). The last two columns do
(`compare_report.on_autoregressive_work`): the autoregressive arm's own steps with each decode phase (active batch
size n) at the speculative arm's measured decode speed there, from both arms' batch traces. It is an estimate from
measured rates, and it takes the speculative arm's acceptance on its own replies to hold on the other arm's.

    .venv/bin/python tools/compare_phases.py runs/overlay --ranges 1-60,1-10,11-30,31-60
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from specrl.errors import SpecRLError  # noqa: E402
from specrl.observability.run_report import _f  # noqa: E402
from specrl.observability.step_record import read_records  # noqa: E402
from specrl.run.compare_report import ARMS, compare_summary  # noqa: E402

HEADER = ("| steps | gen ×/step | gen ×/token | step ×/step | step ×/token | AL | R | mean reply (AR; spec) | "
          "groups with signal | gen ×, AR's work | step ×, AR's work |\n|---|---|---|---|---|---|---|---|---|---|---|")


def parse_ranges(text: str) -> list[tuple[int, int]]:
    """'1-10,31-60' -> [(1, 10), (31, 60)]; each range first-last with 1 <= first <= last."""
    out = []
    for part in text.split(","):
        a, sep, b = part.strip().partition("-")
        if not (sep and a.isdigit() and b.isdigit() and 1 <= int(a) <= int(b)):
            raise SpecRLError(f"--ranges: {part.strip()!r} is not a range of steps FIRST-LAST with 1 <= FIRST <= "
                              "LAST (e.g. --ranges 1-60,1-10,31-60)")
        out.append((int(a), int(b)))
    return out


def arm_records(run: Path) -> dict[str, list]:
    recs = {}
    for arm in ARMS:
        path = run / arm / "metrics.jsonl"
        if not path.exists():
            raise SpecRLError(f"{path} does not exist: pass the directory of a compare (`specrl run` or `specrl "
                              f"train --compare`), which holds {' and '.join(ARMS)}/metrics.jsonl")
        recs[arm] = read_records(path, strict=True)
    return recs


def row(recs: dict[str, list], first: int, last: int) -> str:
    """One table row over steps first..last, both arms."""
    ends = {arm: max((r.step for r in rs), default=0) for arm, rs in recs.items()}
    if last > min(ends.values()):
        raise SpecRLError(f"steps {first}-{last}: the arms completed steps up to {ends['autoregressive']} "
                          f"(autoregressive) and {ends['speculative']} (speculative); give a range both completed")
    part = {arm: [r for r in rs if first <= r.step <= last] for arm, rs in recs.items()}
    done = {arm: sorted(r.step for r in rs) for arm, rs in part.items()}
    if done["autoregressive"] != done["speculative"] or not done["autoregressive"]:
        raise SpecRLError(f"steps {first}-{last}: the arms hold different steps (autoregressive "
                          f"{done['autoregressive'][:3]}..., speculative {done['speculative'][:3]}...); give a range "
                          "both arms completed")
    s = compare_summary(part["autoregressive"], part["speculative"])
    reply = [sum(r.generated_tokens or 0 for r in part[a]) / max(1, sum(len(r.response_lengths) for r in part[a]))
             for a in ARMS]
    sig = s["signal"]
    steps = f"{first}–{last}" if first != last else str(first)
    figs = " | ".join(_f(s[k], ".2f") for k in ("gen_speedup", "gen_throughput_speedup", "step_speedup",
                                                 "step_per_token_speedup", "acceptance_length", "gen_share"))
    work = " | ".join(_f(s[k], ".2f") for k in ("gen_speedup_ar_work", "step_speedup_ar_work"))
    return (f"| {steps} | {figs} | {reply[0]:.0f}; {reply[1]:.0f} tokens | "
            f"{sig['groups_nonzero_advantage']} of {sig['groups']} | {work} |")


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("run", help="a compare's directory (holds autoregressive/ and speculative/)")
    ap.add_argument("--ranges", default=None, help="FIRST-LAST,... (default: every step both arms completed)")
    a = ap.parse_args(argv)
    try:
        recs = arm_records(Path(a.run))
        last = min(max((r.step for r in rs), default=0) for rs in recs.values())
        if last < 1:
            raise SpecRLError(f"{a.run}: an arm has no completed step yet")
        ranges = parse_ranges(a.ranges) if a.ranges else [(1, last)]
        print(HEADER)
        for first, end in ranges:
            print(row(recs, first, end))
    except SpecRLError as e:
        sys.exit(f"compare_phases: {e}")


if __name__ == "__main__":
    main()
