"""The whole commands `make gpu-check` runs under the placement guard (`tools/device_guard_run.py --device cuda`).

`commands(work, device)` writes tiny checkpoints, configs and a drafter recipe under `work` and returns the
commands, each (name, argv): `specrl run` (both arms and the certificate), `specrl train` sync, async on Ray (when
Ray is installed), `specrl generate` with a draft model, `specrl check-backend` (native), `specrl draft build` and
`draft eval` on a tiny recipe, and one sharded (FSDP2) learner step on a one-rank process group (NCCL on CUDA, gloo
on the CPU: `python tools/gpu_commands.py fsdp-step CKPT DEVICE`). `run_all` runs them under the guard and returns
one row per command (status, seconds, guarded processes, violations, first site). Every config names `run.device`,
so nothing is placed by default; sizes are the CPU tests' (a few seconds of compute each: start-up dominates).
"""

from __future__ import annotations

import importlib.util
import json
import re
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tools"))


def commands(work: Path, device: str, names: tuple[str, ...] | None = None) -> list[tuple[str, list[str]]]:
    import yaml

    from tests.test_rl_trainer import cfg_dict
    from tests.tiny import make_tiny_checkpoint

    work.mkdir(parents=True, exist_ok=True)
    tiny = make_tiny_checkpoint(work / "ckpt", seed=0)
    draft = make_tiny_checkpoint(work / "draft", seed=1)
    base = dict(speculative__drafter=f"draft-model:{draft}", speculative__num_draft_tokens=2,
                speculative__verify="rejection", grpo__val_every=0, run__steps=1, run__checkpoint_every=0,
                run__device=device)

    def config(name: str, **over) -> str:
        path = work / f"{name}.yaml"
        path.write_text(yaml.safe_dump(cfg_dict(tiny, **{**base, "run__name": name, **over})))
        return str(path)

    prompts = work / "prompts.jsonl"
    prompts.write_text('{"prompt_token_ids": [1, 2, 3]}\n{"prompt_token_ids": [4, 5]}\n')
    recipe = work / "recipe.json"
    recipe.write_text(json.dumps({"name": "tiny", "model": str(tiny), "prompts": 6, "shard_size": 3,
                                  "heldout_prompts": 2, "max_new_tokens": 12, "draft_vocab_size": 24,
                                  "target_topk": 8, "epochs": 2, "batch_size": 2, "rollout_batch": 4,
                                  "rollout_dtype": "float32"}))
    build = work / "builds" / "tiny"
    out = [
        ("specrl run", ["specrl", "run", "--config", config("main")]),
        ("specrl train (sync)", ["specrl", "train", "--config", config("sync")]),
        ("specrl generate", ["specrl", "generate", "--model", str(tiny), "--prompts", str(prompts), "--out",
                             str(work / "generated.jsonl"), "--temperature", "1.0", "--max-new-tokens", "8",
                             "--num-samples", "2", "--drafter", f"draft-model:{draft}", "--k", "auto", "--dtype",
                             "fp32", "--max-seq-len", "64", "--device", device]),
        ("specrl check-backend", ["specrl", "check-backend", "--backend", "native", "--model", str(tiny),
                                  "--drafter", f"draft-model:{draft}", "--k", "2", "--samples", "16", "--tokens",
                                  "2", "--dtype", "float32"]),
        ("FSDP2 learner step, one rank", ["python", str(Path(__file__).resolve()), "fsdp-step", str(tiny), device]),
        ("specrl draft build", ["specrl", "draft", "build", "--recipe", str(recipe), "--work", str(build),
                                "--threads", "1"]),
        ("specrl draft eval", ["specrl", "draft", "eval", "--drafter", f"eagle:{build / 'package'}", "--recipe",
                               str(recipe), "--k", "1,2", "--cost", "1", "--threads", "1"]),
    ]
    if importlib.util.find_spec("ray") is not None:
        out.insert(2, ("specrl train (async, Ray)", ["specrl", "train", "--config", config(
            "async", speculative__drafter="ngram", pipeline__mode="async", pipeline__max_trajectory_age_steps=1,
            grpo__importance_sampling_correction=True, run__steps=2)]))
    return [c for c in out if names is None or c[0] in names]


def run_all(work: Path, device: str, names: tuple[str, ...] | None = None, timeout: float = 240) -> list[dict]:
    import device_guard_run as runner

    rows = []
    for name, argv in commands(work, device, names):
        t = time.perf_counter()
        log = work / "guard" / re.sub(r"[^a-z0-9]+", "-", name.lower()).strip("-")
        try:
            s = runner.run(argv, log, device=device if device.startswith("cuda") else "", cwd=str(work),
                           timeout=timeout)
            status = "ok" if s["returncode"] == 0 and s["violations"] == 0 and s["processes"] else (
                "violations" if s["violations"] else f"exit {s['returncode']}")
        except Exception as e:  # a timeout or a missing tool is a row, not the end of the check
            s, status = {"processes": 0, "violations": 0, "sites": []}, f"{type(e).__name__}"
        rows.append({"command": name, "status": status, "seconds": time.perf_counter() - t,
                     "processes": s["processes"], "violations": s["violations"],
                     "first_site": s["sites"][0]["site"] if s["sites"] else "", "log": str(log)})
    return rows


def fsdp_step(ckpt: str, device: str) -> None:
    """One sharded learner step and weight probe on a one-rank process group (NCCL on CUDA, gloo on the CPU)."""
    import socket

    import torch
    import torch.distributed as dist

    from specrl.model.loader import load_model
    from specrl.parallel.data_parallel import ShardedLearner
    from tests.test_device_placement import group_rollouts
    from tests.test_learner_group import SECONDS, dp_cfg

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    cuda = device.startswith("cuda")
    dist.init_process_group("nccl" if cuda else "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0,
                            world_size=1)
    try:
        policy, _ = load_model(ckpt, dtype=torch.float32, device=device)
        learner = ShardedLearner(dp_cfg(Path(ckpt), world_size=1, run__device=device), policy)
        rec = learner.learn(group_rollouts(), dict(SECONDS))
        learner.check_weights(1)
        print(f"fsdp-step: loss {rec['loss'] if isinstance(rec, dict) else rec.loss}")
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    if len(sys.argv) == 4 and sys.argv[1] == "fsdp-step":
        fsdp_step(sys.argv[2], sys.argv[3])
    else:
        sys.exit("usage: tools/gpu_commands.py fsdp-step CKPT DEVICE")
