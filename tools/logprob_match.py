"""Does the trainer score rollout tokens under the distribution the sampler drew them from?

One step's rollouts of a config (its own sampling settings), then the trainer's log-probabilities of those tokens
with the sampler's top-p / top-k filter (what the learner computes) and without it (temperature only), each
compared with the rollout engine's behaviour log-probs by `token_mult_prob_error` (1.0 = a match).
Use fp32 on both sides to see the filter alone:

    .venv/bin/python tools/logprob_match.py --config examples/short.yaml --set generation.top_p=0.9 \\
        --set generation.top_k=50 --set model.rollout_dtype=float32 --set policy.precision=fp32
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
os.environ.setdefault("HF_HUB_OFFLINE", "1")


def main(argv: list[str] | None = None) -> dict:
    import torch

    from specrl.algorithms.grpo import token_mult_prob_error
    from specrl.device import processor_class
    from specrl.trainer.config_check import load_config
    from specrl.trainer.scoring import response_logprobs
    from specrl.trainer.sync_trainer import GRPOTrainer

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--config", default="examples/short.yaml")
    ap.add_argument("--set", action="append", default=[], dest="overrides")
    ap.add_argument("--threads", type=int, default=1)
    a = ap.parse_args(argv)
    torch.set_num_threads(a.threads)
    cfg = load_config(a.config, ["run.steps=1", "grpo.val_every=0", "speculative.drafter=none",
                                 "drafter.online=false", *a.overrides])
    t = GRPOTrainer.from_config(cfg)
    idx = t.stage_data()
    t.stage_prepare()
    from specrl.algorithms.batch import collate

    b = collate(t.stage_gen(idx), t.learner.collate_spec)
    g = cfg.generation
    with torch.no_grad():
        filt, _ = response_logprobs(t.learner.policy, b.tokens, b.mask, g.temperature, top_p=g.top_p, top_k=g.top_k)
        plain, _ = response_logprobs(t.learner.policy, b.tokens, b.mask, g.temperature)
    out = {"top_p": g.top_p, "top_k": g.top_k, "rollout_dtype": cfg.model.rollout_dtype,
           "tokens": int(b.mask.sum()), "with_filter": token_mult_prob_error(b.gen_logp, filt, b.mask),
           "temperature_only": token_mult_prob_error(b.gen_logp, plain, b.mask), "processor": processor_class()}
    print(out)
    return out


if __name__ == "__main__":
    main()
