"""Golden check for refactors: a fixed seed_exact config, run step by step; prints per-step hashes.

For each step it prints a SHA-256 of the rollouts' token ids (prompts + responses, in order) and of the
policy's weights (every parameter's bytes, in name order), plus the step's reward mean. Run it before and
after a refactor that must not change behaviour and diff the outputs:

    .venv/bin/python tools/golden_check.py --config examples/compare.yaml --steps 3 > before.txt
    ... refactor ...
    .venv/bin/python tools/golden_check.py --config examples/compare.yaml --steps 3 > after.txt
    diff before.txt after.txt

Settings chosen from timing would make the hashes differ run to run on unchanged code (auto k picks k from measured
step costs; `run.threads: auto` follows the load), so the check pins them before the config's and the user's
settings are applied: `PINNED` (k = 3, one thread, fp32 rollouts); a `--set` given here overrides a pin.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import sys
import tempfile

# settings pinned so the hashes depend on the code alone (overridable with --set)
PINNED = ("speculative.num_draft_tokens=3", "run.threads=1", "model.rollout_dtype=float32")


def weights_hash(model) -> str:
    h = hashlib.sha256()
    for name, p in sorted(model.state_dict().items()):
        h.update(name.encode())
        h.update(p.detach().float().contiguous().numpy().tobytes())
    return h.hexdigest()[:16]


def drafter_part(trainer) -> str:
    d = getattr(trainer, "drafter", None)
    return f" drafter {weights_hash(d)}" if d is not None else ""


def tokens_hash(prompts, responses) -> str:
    return hashlib.sha256(json.dumps([prompts, responses]).encode()).hexdigest()[:16]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--config", default="examples/compare.yaml")
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--set", action="append", default=[], dest="sets")
    a = ap.parse_args()
    import torch

    torch.set_num_threads(a.threads)
    from specrl.trainer.config_check import load_config

    cfg = load_config(a.config, [*PINNED, *a.sets, f"run.steps={a.steps}"])
    with tempfile.TemporaryDirectory() as tmp:
        os.chdir(tmp)
        from specrl.trainer.sync_trainer import GRPOTrainer, seed_everything

        seed_everything(cfg.run.seed)
        trainer = GRPOTrainer.from_config(cfg)
        print(f"step 0 weights {weights_hash(trainer.policy)}")
        for _ in range(a.steps):
            rec = trainer.step()
            r = trainer.last_rollouts
            print(f"step {rec['step']} tokens {tokens_hash(r.prompts, r.responses)} "
                  f"weights {weights_hash(trainer.policy)}{drafter_part(trainer)} reward {rec['reward_mean']:.6f} "
                  f"generated {sum(len(x) for x in r.responses)}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
