"""Generic vs in-domain drafter initialisation, measured on the RL task's held-out prompts.

The published system found a drafter initialised on in-domain rollouts (the task's prompts + the policy's own
responses) beats one trained on generic chat data. Offline here there is no chat corpus, so "generic" is the
same policy's answers to generic chat prompts (templated instructions about everyday topics; nothing about
arithmetic), and "in-domain" its answers to chain_sum prompts. Both drafters get the same recipe (`specrl draft
init`: samples, epochs, draft vocabulary, seed); then both are measured on the same held-out chain_sum prompts:
acceptance length at k=3, T=1 (the real engine), and generation speed vs AR at batch 1 and 4, side by side.

    .venv/bin/python benchmarks/drafter_generic_vs_indomain.py [--samples 320 --epochs 3] [--indomain DIR]
        [--threads 1] [--out /tmp/generic_vs_indomain]

`--indomain DIR` reuses an existing in-domain drafter (e.g. the default one, built with the same recipe). The
target runs in --dtype (auto: bf16 on CPUs with bf16 units, else float32); generic_vs_indomain.json holds
{"hardware": processor class, cores, threads, dtypes; "rows": [...]}. The drafters this script trains (OUT/generic,
OUT/indomain) are removed at the end unless --keep-runs (a --indomain DIR is never removed); the JSON stays.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import DTYPES, KEEP_RUNS_HELP, RunDirs, dtype_name, run_dirs, run_header  # noqa: E402

TEMPLATES = [
    "Write a short poem about {t}.", "Explain {t} to a ten-year-old.", "Give me three interesting facts about {t}.",
    "What are the pros and cons of {t}?", "Describe {t} in one paragraph.", "Write a product review of {t}.",
    "How would you start learning about {t}?", "Tell a short story that involves {t}.",
    "Summarize the history of {t} in a few sentences.", "Write a friendly email inviting a colleague to talk "
    "about {t}.", "What questions would a journalist ask about {t}?", "List some common myths about {t}.",
]
TOPICS = [
    "the ocean", "coffee", "city parks", "bicycles", "rainforests", "public libraries", "jazz music", "volcanoes",
    "remote work", "honeybees", "the moon", "board games", "bread baking", "mountain hiking", "recycling",
    "solar panels", "train travel", "museums", "gardening", "sleep", "photography", "chess", "the internet",
    "dinosaurs", "winter sports", "tea ceremonies", "lighthouses", "street food",
]


def generic_prompts() -> list[str]:
    return [t.format(t=topic) for topic in TOPICS for t in TEMPLATES]


def speed(model, drafter, prompts, stops, batch: int, k: int, repeats: int) -> tuple[float, float]:
    """(spec tok/s ÷ AR tok/s, acceptance length): medians over repeats, AR and spec interleaved."""
    from specrl import RolloutEngine, SamplingParams

    ar = RolloutEngine(model, max_batch_size=batch, max_seq_len=512)
    sd = RolloutEngine(model, max_batch_size=batch, max_seq_len=512, drafter=drafter, num_draft_tokens=k)
    ratios, als = [], []
    for r in range(repeats):
        sp = SamplingParams(temperature=1.0, max_new_tokens=64, stop_token_ids=stops, seed=100 + r)
        m_ar = ar.generate(prompts, sp).metrics
        m_sd = sd.generate(prompts, sp).metrics
        ratios.append(m_sd["tokens_per_second"] / m_ar["tokens_per_second"])
        als.append(m_sd["acceptance_length"])
    ratios.sort()
    als.sort()
    return ratios[len(ratios) // 2], als[len(als) // 2]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--samples", type=int, default=320)
    ap.add_argument("--epochs", type=int, default=3)
    ap.add_argument("--indomain", default=None, help="existing in-domain drafter directory to reuse")
    ap.add_argument("--heldout", type=int, default=32)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--threads", type=int, default=torch.get_num_threads())
    ap.add_argument("--out", default="/tmp/generic_vs_indomain")
    ap.add_argument("--dtype", default="auto", choices=DTYPES,
                    help="the target's dtype (auto: bf16 where the CPU has bf16 units, else float32)")
    ap.add_argument("--keep-runs", action="store_true",
                    help=KEEP_RUNS_HELP + ": here the drafters it trains, OUT/generic and OUT/indomain")
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    a.dtype = dtype_name(a.dtype)
    hw = run_header({"target": a.dtype}, a.threads)
    with run_dirs(a.keep_runs) as trained:
        measure(a, hw, trained)


def measure(a: argparse.Namespace, hw: dict, trained: RunDirs) -> None:
    """Train the drafters (collected in `trained`), measure both, write the JSON."""
    from specrl import load_model
    from specrl.drafters.storage.default import task_prompts
    from specrl.drafters.storage.io import load_drafter
    from specrl.drafters.training.build.from_rollouts import train_drafter_offline
    from specrl.drafters.training.offline import heldout_acceptance
    from specrl.model.tokenizer import stop_token_ids

    out = Path(a.out)
    dirs = {}
    t0 = time.perf_counter()
    dirs["generic"] = train_drafter_offline("smollm2-135m", "eagle", prompts=generic_prompts(), samples=a.samples,
                                    epochs=a.epochs, out=trained.add(out / "generic"), max_new_tokens=64,
                                    dtype=a.dtype)
    print(f"generic drafter trained in {time.perf_counter() - t0:.0f} s", flush=True)
    if a.indomain:
        dirs["in-domain"] = Path(a.indomain)
    else:
        t0 = time.perf_counter()
        dirs["in-domain"] = train_drafter_offline("smollm2-135m", "eagle", prompts=task_prompts("chain_sum", a.samples),
                                          samples=a.samples, epochs=a.epochs, out=trained.add(out / "indomain"),
                                          max_new_tokens=64,
                                          source="chain_sum", dtype=a.dtype)
        print(f"in-domain drafter trained in {time.perf_counter() - t0:.0f} s", flush=True)

    model, tok = load_model("smollm2-135m", dtype=getattr(torch, a.dtype))
    stops = stop_token_ids(tok, model.args)
    _, held = task_prompts("chain_sum", a.samples, heldout=a.heldout)(tok)
    rows = []
    print(f"{'drafter':>10} {'train tokens':>12} {'AL k=3':>7} {'speedup B=1':>11} {'AL':>5} {'speedup B=4':>11} "
          f"{'AL':>5}")
    for name, d in dirs.items():
        drafter = load_drafter(d, model)
        al = heldout_acceptance(model, drafter, held, k=3, temperature=1.0, max_new_tokens=64, stop_token_ids=stops)
        s1, al1 = speed(model, drafter, held[:8], stops, 1, 3, a.repeats)
        s4, al4 = speed(model, drafter, held[:16], stops, 4, 3, a.repeats)
        report = json.loads((Path(d) / "train_report.json").read_text())
        rows.append({"drafter": name, "dir": str(d), "train_tokens": report.get("tokens"), "heldout_al_k3": al,
                     "speedup_b1": s1, "al_b1": al1, "speedup_b4": s4, "al_b4": al4,
                     "train_heldout_top1": report.get("heldout_top1")})
        print(f"{name:>10} {report.get('tokens', 0):>12} {al:>7.2f} {s1:>10.2f}x {al1:>5.2f} {s4:>10.2f}x {al4:>5.2f}",
              flush=True)
    out.mkdir(parents=True, exist_ok=True)
    (out / "generic_vs_indomain.json").write_text(json.dumps({"hardware": hw, "rows": rows}, indent=2) + "\n")
    print(f"wrote {out / 'generic_vs_indomain.json'}")


if __name__ == "__main__":
    main()
