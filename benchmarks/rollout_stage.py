"""The main job's rollout stage alone: speculative vs autoregressive generation per token, in the run's own setting.

A compare run's "gen ×/token" mixes the engine's speed-up with what training does between rollouts (the arms' policies
part after step 1, so their replies differ in length) and with the controller's state over a run. This script keeps
the run's setting and removes the training: it loads the config's policy once, builds the two rollout backends the
trainer builds (`specrl.backends.registry.build_backend`: the configured drafter, and the same config with
`speculative.drafter=none`), and generates the run's groups (`grpo.num_generations` samples of one train prompt, the
run's sampling, stop tokens and `generation.max_new_tokens`) with both, prompt after prompt, the arms' order
alternating, each backend's engine (and its auto-k controller) living across the prompts as in a run. It prints each
group's seconds, tokens and mean k, and the ratio of generated tokens per second over all groups (speculative ÷
autoregressive): the same tokens-per-generation-second figure a compare reports as "gen ×/token".

    .venv/bin/python benchmarks/rollout_stage.py --groups 8 --threads 2 --set generation.max_new_tokens=192

`--drafter-dtype bfloat16` adds a third arm: the speculative backend with its drafter cast to that dtype (a learned
drafter otherwise runs in the rollout model's dtype), so the drafter's precision is timed against the same two arms.

Both backends sample from the same frozen weights with the same seeds per group, but rejection sampling emits other
tokens than plain decoding, so the two arms' groups differ in length; the ratio is taken over all tokens. Machine
noise moves both arms alike only within a group's pair; a host whose speed drifts over minutes (the AVX512 machine
of docs/results.md) moves the whole-run ratio by several percent between runs, so compare settings within one run or
over several runs.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))
from common import config_dtypes, hardware_line, run_header  # noqa: E402


def ratio(groups: list[dict[str, Any]]) -> dict[str, float]:
    """Tokens per second of each arm over all its groups, speculative ÷ autoregressive, and each further arm (a
    cast drafter) ÷ autoregressive."""
    extra = sorted({g["arm"] for g in groups} - {"autoregressive", "speculative"})
    tps = {}
    for arm in ("autoregressive", "speculative", *extra):
        rows = [g for g in groups if g["arm"] == arm]
        secs = sum(g["seconds"] for g in rows)
        if not rows or secs <= 0:
            raise ValueError(f"no timed groups of the {arm} arm")
        tps[arm] = sum(g["tokens"] for g in rows) / secs
    return {**{f"{a}_tokens_per_second": v for a, v in tps.items()},
            "speedup_per_token": tps["speculative"] / tps["autoregressive"],
            **{f"{a}_speedup_per_token": tps[a] / tps["autoregressive"] for a in extra}}


DRAFTER_DTYPES = ("float32", "bfloat16")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--config", default=str(ROOT / "examples" / "default.yaml"))
    ap.add_argument("--set", action="append", default=[], dest="sets", help="KEY=VALUE config override")
    ap.add_argument("--groups", type=int, default=8, help="train prompts, one group each per arm")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--json", default=None, help="also write the results here")
    ap.add_argument("--drafter-dtype", default=None, choices=DRAFTER_DTYPES,
                    help="add an arm whose drafter is cast to this dtype")
    a = ap.parse_args(argv)
    if a.groups < 1 or a.threads < 1:
        raise SystemExit(f"--groups >= 1 and --threads >= 1 are required, got {a.groups} and {a.threads}")
    import torch

    from specrl.backends.registry import build_backend
    from specrl.config.hardware import resolve_hardware
    from specrl.model.hf_checkpoint import parse_dtype
    from specrl.model.loader import load_model
    from specrl.model.tokenizer import stop_token_ids
    from specrl.rollout.protocol import RolloutRequest
    from specrl.rollout.sampling import SamplingParams
    from specrl.trainer.config_check import load_config
    from specrl.trainer.producer import RolloutProducer

    torch.set_num_threads(a.threads)
    sets = [*a.sets, "drafter.online=false"]
    cfg = resolve_hardware(load_config(a.config, sets))
    if not cfg.speculative.enabled:
        raise SystemExit(f"{a.config}: speculative.drafter is none; the script compares it against plain decoding, "
                         "so the config needs a drafter (e.g. --set speculative.drafter=eagle:think)")
    if a.drafter_dtype and cfg.rollout.backend != "native":
        raise SystemExit(f"--drafter-dtype builds specrl's own engine; {a.config} has rollout.backend="
                         f"{cfg.rollout.backend} (set rollout.backend=native)")
    plain = resolve_hardware(load_config(a.config, [*sets, "speculative.drafter=none"]))
    hw = run_header(config_dtypes(a.config, sets), a.threads)
    policy, tok = load_model(cfg.model.name, dtype=parse_dtype(cfg.model.dtype), device=cfg.run.device)
    backends = {"autoregressive": build_backend(plain, policy), "speculative": build_backend(cfg, policy)}
    if a.drafter_dtype:  # the same backend, its drafter built in that dtype
        from specrl.backends.registry import check_backend, native_backend

        backend = native_backend(cfg, policy, drafter_dtype=getattr(torch, a.drafter_dtype))
        check_backend(backend, cfg)
        backends[f"speculative_drafter_{a.drafter_dtype}"] = backend
    arms = list(backends)
    stops = tuple(stop_token_ids(tok, policy.args))
    producer = RolloutProducer(cfg, tok, backends["autoregressive"], list(stops))
    if a.groups > len(producer.train_data):
        raise SystemExit(f"--groups {a.groups}: the train split has {len(producer.train_data)} prompts")
    g, n = cfg.generation, cfg.grpo.num_generations
    print(f"[bench] {cfg.speculative.drafter}, k={cfg.speculative.num_draft_tokens}, verify={cfg.speculative.verify}; "
          f"{a.groups} groups of {n}, T={g.temperature}, up to {g.max_new_tokens} new tokens, batch "
          f"{g.max_batch_size}", flush=True)
    print("| group | arm | seconds | tokens | tokens/s | mean k |\n|---|---|---|---|---|---|", flush=True)
    groups: list[dict[str, Any]] = []
    for i in range(a.groups):
        ids = producer.prompt("train", i)
        for arm in arms[i % len(arms):] + arms[:i % len(arms)]:  # the arms' order rotates
            reqs = [RolloutRequest(ids, request_id=i * n + j) for j in range(n)]
            params = SamplingParams(temperature=g.temperature, top_p=g.top_p, top_k=g.top_k,
                                    max_new_tokens=g.max_new_tokens, stop_token_ids=stops, seed=cfg.run.seed + i)
            t0 = time.perf_counter()
            res = backends[arm].generate(reqs, params)
            secs = time.perf_counter() - t0
            tokens = sum(len(o.token_ids) for o in res.outputs)
            k = res.metrics.get("num_draft_tokens_mean") if arm != "autoregressive" else 0.0
            groups.append({"group": i, "arm": arm, "seconds": secs, "tokens": tokens, "mean_k": k})
            print(f"| {i} | {arm} | {secs:.2f} | {tokens} | {tokens / secs:.1f} | "
                  f"{'-' if k is None else f'{k:.2f}'} |", flush=True)
    r = ratio(groups)
    print(f"[bench] generated tokens per second: autoregressive {r['autoregressive_tokens_per_second']:.1f}, "
          f"speculative {r['speculative_tokens_per_second']:.1f}: {r['speedup_per_token']:.2f}x per token" +
          "".join(f"; {a} {r[f'{a}_tokens_per_second']:.1f}: {r[f'{a}_speedup_per_token']:.2f}x"
                  for a in arms[2:]) + f"; {hardware_line(hw)}", flush=True)
    if a.json:
        Path(a.json).write_text(json.dumps({"hardware": hw, "config": a.config, "sets": a.sets, "groups": groups,
                                            **r}, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
