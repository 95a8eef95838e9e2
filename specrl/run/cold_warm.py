"""Cold and warm steps of a compare run whose prompts repeat (several epochs over a small train split).

A step is *cold* when one of its prompts appears for the first time in the run, and *warm* when every prompt of it
came back from an earlier step (read off each step record's `prompt_indices`). A drafter that keeps the history of
each prompt (the suffix and hybrid drafters) can only draft from earlier epochs in warm steps, so `cold_warm_split`
gives the speed-up and acceptance of each kind of step apart: generated tokens per generation second (speculative
÷ autoregressive, over the same steps), AL, the share of speculating rows that drafted from history and how many of
those drafts were accepted, and the history index's size at the end (`history_index_tokens`). It is None where the
run has no repeated prompts or no step of one kind.
"""

from __future__ import annotations

from typing import Any

from specrl.observability.run_report import Records, _f, _records, summarize


def step_kinds(records: Records) -> list[str] | None:
    """'cold' or 'warm' per step, in order; None where a record carries no prompt indices."""
    seen: set[int] = set()
    kinds = []
    for r in _records(records):
        if not r.prompt_indices:
            return None
        kinds.append("warm" if set(r.prompt_indices) <= seen else "cold")
        seen |= set(r.prompt_indices)
    return kinds


def _sum(records: list, key: str) -> int:
    return int(sum(getattr(r, key) or 0 for r in records))


def _part(ar: list, sd: list) -> dict[str, Any]:
    tps = [x["generated_tokens"] / x["gen_seconds"] if x["gen_seconds"] > 0 else None
           for x in (summarize(ar), summarize(sd))]
    verify, drafted = _sum(sd, "verify_steps"), _sum(sd, "history_drafted")
    return {
        "steps": [r.step for r in sd],
        "gen_throughput_speedup": tps[1] / tps[0] if None not in tps and tps[0] > 0 else None,
        "acceptance_length": 1.0 + _sum(sd, "accepted_tokens") / verify if verify else None,
        "history_row_share": _sum(sd, "history_rows") / verify if verify else None,
        "history_acceptance": _sum(sd, "history_accepted") / drafted if drafted else None,
    }


def cold_warm_split(ar: Records, sd: Records) -> dict[str, Any] | None:
    """{"cold": part, "warm": part, "history_index_tokens": the index's size after the last step} (see above)."""
    ar, sd = _records(ar), _records(sd)
    n = min(len(ar), len(sd))
    kinds = step_kinds(sd[:n])
    if kinds is None or "cold" not in kinds or "warm" not in kinds:
        return None
    out: dict[str, Any] = {kind: _part([a for a, k in zip(ar, kinds, strict=False) if k == kind],
                                       [s for s, k in zip(sd, kinds, strict=False) if k == kind])
                           for kind in ("cold", "warm")}
    sizes = [r.history_index_tokens for r in sd[:n] if r.history_index_tokens is not None]
    out["history_index_tokens"] = sizes[-1] if sizes else None
    out["history_index_tokens_max"] = max(sizes) if sizes else None
    return out


def line(split: dict[str, Any]) -> str:
    """The headline's line: `cold steps (new prompts: 1, 2): generation 1.31× per generated token, AL 2.41; ...`."""
    parts = []
    for kind, what in (("cold", "a prompt new to the run"), ("warm", "every prompt seen in an earlier step")):
        p = split[kind]
        hist = ""
        if p["history_row_share"]:
            hist = (f", history drafts in {p['history_row_share']:.0%} of speculating rows "
                    f"({_f(p['history_acceptance'], '.2f')} of their drafts accepted)")
        parts.append(f"{kind} steps ({what}: {', '.join(map(str, p['steps']))}): generation "
                     f"{_f(p['gen_throughput_speedup'], '.2f')}× per generated token, AL "
                     f"{_f(p['acceptance_length'], '.2f')}{hist}")
    size = split.get("history_index_tokens")
    tail = f"; history index {size:,} tokens after the last step" if size else ""
    return "; ".join(parts) + tail
