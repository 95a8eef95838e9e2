"""Step-0 reward signal of a task: how often the untrained policy is right, and how many GRPO groups can learn.

For each candidate (a config plus `--set` overrides, e.g. another task difficulty or answer format) it samples
`--group` completions for each of `--prompts` held-out prompts (the validation split, which training never sees)
with the run's own sampling settings (temperature, top-p, max_new_tokens, seed) on the native engine with plain
decoding by default (speculation leaves the distribution unchanged), scores them with the task's reward, and
reports: the success rate (share of completions the scorer gives full marks) with its binomial standard error, the
share of groups whose rewards are not all equal (the groups with a non-zero GRPO advantage: the others give no
gradient), mean response length and the share cut at max_new_tokens (each completion's length in the JSON). A
candidate that sets `speculative.drafter` samples with that drafter instead, so the same prompts and seed measured
under plain and speculative decoding test, at the level of rewards, that speculation leaves the distribution
unchanged. Nothing here is timed, so the figures hold on a busy machine; `--threads 1` keeps them reproducible.
Output: one table row per candidate, and JSON with `--json`.

    .venv/bin/python benchmarks/task_difficulty.py --config examples/default.yaml --prompts 16 --group 8 \
        --candidate easy: --candidate single:task.difficulty=single_digit --threads 1
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))
from common import config_dtypes, hardware_line, parse_candidate, run_header  # noqa: E402


def group_stats(correct: list[bool], rewards: list[float], group: int) -> dict[str, Any]:
    """Success rate (with its binomial standard error over completions) and the share of groups of `group`
    consecutive completions whose rewards are not all equal."""
    if group < 2 or not correct or len(correct) % group or len(rewards) != len(correct):
        raise ValueError(f"need a whole number of groups of >= 2 completions, got {len(correct)} correct, "
                         f"{len(rewards)} rewards and group {group}")
    n = len(correct)
    p = sum(correct) / n
    groups = [rewards[i:i + group] for i in range(0, n, group)]
    mixed = sum(len(set(g)) > 1 for g in groups)
    return {"completions": n, "success_rate": p, "success_rate_se": (p * (1 - p) / n) ** 0.5,
            "groups": len(groups), "groups_nonzero_advantage": mixed,
            "nonzero_advantage_share": mixed / len(groups),
            "group_success": [sum(correct[i:i + group]) for i in range(0, n, group)]}


def measure(config: str, sets: list[str], prompts: int, group: int, batch_size: int | None = None) -> dict[str, Any]:
    from specrl.backends.registry import build_backend
    from specrl.config.hardware import resolve_hardware
    from specrl.model.hf_checkpoint import parse_dtype
    from specrl.model.loader import load_model
    from specrl.model.tokenizer import stop_token_ids
    from specrl.rollout.protocol import RolloutRequest
    from specrl.trainer.config_check import load_config
    from specrl.trainer.producer import VAL_REQUEST_BASE, RolloutProducer

    # plain decoding unless the candidate names a drafter (its sets come after these defaults)
    cfg = load_config(config, ["speculative.drafter=none", *sets, f"task.val_size={prompts}",
                               "drafter.online=false", f"grpo.num_generations={group}",
                               *([f"generation.max_batch_size={batch_size}"] if batch_size else [])])
    cfg = resolve_hardware(cfg)
    policy, tok = load_model(cfg.model.name, dtype=parse_dtype(cfg.model.dtype), device=cfg.run.device)
    producer = RolloutProducer(cfg, tok, build_backend(cfg, policy), stop_token_ids(tok, policy.args))
    problems = [i for i in range(len(producer.val_data)) for _ in range(group)]
    requests = [RolloutRequest(producer.prompt("val", i), VAL_REQUEST_BASE + j) for j, i in enumerate(problems)]
    outs = producer.backend.generate(requests, producer.sampling())
    rewards, correct, _, _ = producer._score("val", problems, outs)
    lengths = [len(o.token_ids) for o in outs]
    t = cfg.task
    return {**group_stats(list(correct), list(rewards), group),
            "task": t.name, "difficulty": t.difficulty, "options": dict(t.options), "answer_format": t.answer_format,
            "temperature": cfg.generation.temperature, "max_new_tokens": cfg.generation.max_new_tokens,
            "rollout_dtype": cfg.model.rollout_dtype, "response_length_mean": sum(lengths) / len(lengths),
            "truncated_share": sum(o.finish_reason == "length" for o in outs) / len(outs),
            "response_lengths": lengths}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--config", default=str(ROOT / "examples" / "default.yaml"))
    ap.add_argument("--candidate", action="append", required=True,
                    help="NAME:KEY=VALUE[,KEY=VALUE...] config overrides of one candidate (repeatable)")
    ap.add_argument("--prompts", type=int, default=16, help="held-out prompts per candidate")
    ap.add_argument("--group", type=int, default=8, help="completions per prompt (the GRPO group size)")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--batch-size", type=int, default=None,
                    help="engine batch (default: the config's; it changes speed, not the samples' distribution)")
    ap.add_argument("--json", default=None, help="also write the results here")
    a = ap.parse_args(argv)
    if a.prompts < 1 or a.group < 2 or a.threads < 1:
        raise SystemExit("--prompts >= 1, --group >= 2 and --threads >= 1 are required")
    import torch

    torch.set_num_threads(a.threads)
    cands = [parse_candidate(c) for c in a.candidate]
    hw = run_header(config_dtypes(a.config, cands[0][1]), a.threads)  # the first candidate's (each row has its own)
    rows = {}
    print("| candidate | overrides | success rate (± SE) | groups with non-zero advantage | mean length | "
          "cut at max |\n|---|---|---|---|---|---|", flush=True)
    for name, sets in cands:
        r = measure(a.config, sets, a.prompts, a.group, a.batch_size)
        rows[name] = {"sets": sets, **r}
        print(f"| {name} | {' '.join(sets) or '(config)'} | {r['success_rate']:.3f} ± {r['success_rate_se']:.3f} | "
              f"{r['groups_nonzero_advantage']} of {r['groups']} ({r['nonzero_advantage_share']:.2f}) | "
              f"{r['response_length_mean']:.0f} | {r['truncated_share']:.2f} |", flush=True)
    dtypes = sorted({r['rollout_dtype'] for r in rows.values()})
    print(f"[bench] {hardware_line(hw)}; rollout dtype of the candidates: {', '.join(dtypes)}", flush=True)
    if a.json:
        Path(a.json).write_text(json.dumps({"hardware": hw, "prompts": a.prompts, "group": a.group,
                                            "candidates": rows}, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
