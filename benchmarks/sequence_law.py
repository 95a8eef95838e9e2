"""Do plain and speculative decoding draw whole replies from one law? The losslessness probe at reply length, on the
task's own prompts, for each engine, and a test that the engines' samples do not differ.

For each candidate (a config plus `--set` overrides; by default `plain`, the config with no drafter, and
`speculative`, the config as it is) the run's rollout engine draws `--group` continuations of each of the first
`--prompts` train prompts, `--tokens` tokens long (default: generation.max_new_tokens) with no stop tokens, at the
run's sampling settings, and `specrl.backends.probe.probe_backend` tests them against the policy the engine holds:
the law of every token's randomised PIT value (pooled chi-square, and per draft position on a speculative engine),
and their independence across the positions of a continuation and across a prompt's continuations
(`specrl.backends.probe_dependence`). The certificate runs the same probe on continuations of at most 64 tokens;
here they are as long as the run's replies, so the tokens deep in a reply, where a policy that is being trained
spends most of its samples, are in the test. Between candidates, a chi-square test of homogeneity on their PIT bin
counts asks whether the engines' samples differ. Nothing is timed. `model.name=RUN/ARM/final` probes a trained
policy.

    .venv/bin/python benchmarks/sequence_law.py --prompts 8 --group 16 --threads 2 --json out.json
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


def homogeneity(bin_counts: list[list[int]]) -> float:
    """p-value of the chi-square test that the candidates' PIT bin counts come from one distribution."""
    from scipy.stats import chi2_contingency

    return float(chi2_contingency(bin_counts).pvalue)


def measure(config: str, sets: list[str], prompts: int, group: int, tokens: int | None, name: str) -> dict[str, Any]:
    from specrl.backends.probe import probe_backend
    from specrl.backends.registry import build_backend
    from specrl.config.hardware import resolve_hardware
    from specrl.model.hf_checkpoint import parse_dtype
    from specrl.model.loader import load_model
    from specrl.model.tokenizer import stop_token_ids
    from specrl.rollout.sampling import SamplingParams
    from specrl.trainer.config_check import load_config
    from specrl.trainer.producer import RolloutProducer

    cfg = resolve_hardware(load_config(config, [*sets, "drafter.online=false"]))
    g = cfg.generation
    n = tokens or g.max_new_tokens
    policy, tok = load_model(cfg.model.name, dtype=parse_dtype(cfg.model.dtype), device=cfg.run.device)
    backend = build_backend(cfg, policy)
    producer = RolloutProducer(cfg, tok, backend, stop_token_ids(tok, policy.args))
    if prompts > len(producer.train_data):
        raise SystemExit(f"--prompts {prompts}: the train split has {len(producer.train_data)} prompts")
    reference = getattr(backend, "model", policy)  # the weights the engine samples from (its rollout dtype)
    r = probe_backend(backend, reference, [producer.prompt("train", i) for i in range(prompts)],
                      SamplingParams(temperature=g.temperature, top_p=g.top_p, top_k=g.top_k, seed=cfg.run.seed),
                      num_samples=prompts * group, num_tokens=n, setting=name)
    dep = {d["test"]: d["p_value"] for d in r.dependence}
    return {"passed": r.passed, "tokens": r.num_tokens, "tokens_each": n, "p_value": r.p_value,
            "serial_p": dep.get("serial"), "siblings_p": dep.get("siblings"), "bin_counts": r.bin_counts,
            "mean_logp_sampled": r.mean_logp_sampled, "mean_logp_expected": r.mean_logp_expected,
            "detectable_w": r.detectable_w, "drafter": cfg.speculative.drafter, "k": cfg.speculative.num_draft_tokens,
            "verify": cfg.speculative.verify, "rollout_dtype": cfg.model.rollout_dtype,
            "temperature": g.temperature, "reason": r.reason, "summary": r.summary()}


def _p(p: float | None) -> str:
    return "not run (too few pairs)" if p is None else f"{p:.3g}"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--config", default=str(ROOT / "examples" / "default.yaml"))
    ap.add_argument("--candidate", action="append", default=None,
                    help="NAME:KEY=VALUE[,KEY=VALUE...] (repeatable; default: plain and speculative)")
    ap.add_argument("--set", action="append", default=[], dest="sets",
                    help="KEY=VALUE for every candidate (e.g. model.name=RUN/ARM/final)")
    ap.add_argument("--prompts", type=int, default=8, help="train prompts")
    ap.add_argument("--group", type=int, default=16, help="continuations per prompt (the siblings test pairs them)")
    ap.add_argument("--tokens", type=int, default=None, help="tokens per continuation (default: max_new_tokens)")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--json", default=None, help="also write the results here")
    a = ap.parse_args(argv)
    if a.prompts < 1 or a.group < 2 or a.threads < 1 or (a.tokens is not None and a.tokens < 2):
        raise SystemExit("--prompts >= 1, --group >= 2, --threads >= 1 and --tokens >= 2 are required")
    import torch

    torch.set_num_threads(a.threads)
    cands = [parse_candidate(c) for c in a.candidate] if a.candidate else \
        [("plain", ["speculative.drafter=none"]), ("speculative", [])]
    hw = run_header(config_dtypes(a.config, a.sets + cands[-1][1]), a.threads)
    rows = {}
    print("| candidate | overrides | tokens | PIT law p | serial p | siblings p | mean log p (expected) | verdict |\n"
          "|---|---|---|---|---|---|---|---|", flush=True)
    for name, sets in cands:
        r = measure(a.config, [*a.sets, *sets], a.prompts, a.group, a.tokens, name)
        rows[name] = {"sets": sets, **r}
        print(f"| {name} | {' '.join(sets) or '(config)'} | {r['tokens']} | {r['p_value']:.3g} | {_p(r['serial_p'])} | "
              f"{_p(r['siblings_p'])} | {r['mean_logp_sampled']:.3f} ({r['mean_logp_expected']:.3f}) | "
              f"{'PASS' if r['passed'] else 'FAIL: ' + r['reason']} |", flush=True)
    same = homogeneity([r["bin_counts"] for r in rows.values()]) if len(rows) > 1 else None
    if same is not None:
        print(f"[bench] the candidates' PIT bins, homogeneity chi-square: p = {same:.3g}", flush=True)
    print(f"[bench] {hardware_line(hw)}; common overrides: {' '.join(a.sets) or 'none'}", flush=True)
    if a.json:
        Path(a.json).write_text(json.dumps({"hardware": hw, "prompts": a.prompts, "group": a.group, "sets": a.sets,
                                            "homogeneity_p": same, "candidates": rows}, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
