"""`make gpu-check`: one short run on one CUDA GPU that writes gpu_check.json and gpu_check.md under --out.

Made for a machine lent for minutes (one H200, its own python with torch and transformers, no vLLM, no network, no
model weights): models are built from configs with random weights (a Qwen3-shaped ~0.6B target, a 2-layer draft
model with its vocabulary). Sections, each timed and recorded even when it fails: (1) the device-placement tests
(tests/test_device_placement.py) with SPECRL_TEST_DEVICE set: the policy on the GPU, no default device; (2) decode
tokens/s of the native engine vs transformers `generate`, bf16, greedy, B = 1..256; (3) the verify-step cost v(B, k)
(one target forward of k + 1 tokens per row over a 512-token cache) and the draft-model cost c(B) (one draft forward
of 1 token per row); (4) one speculative point (the n-gram drafter, k = 3) measured, next to the time per token
those costs predict, (v(B, k) + k c) / AL, the simulator's speculation model; (5) one GRPO learner step on the
device; (6) the whole commands under the placement guard (`tools/gpu_commands.py`: `specrl run` with its
certificate, `train` sync and async, `generate`, `check-backend`, `draft build` / `draft eval`, a one-rank NCCL
FSDP2 learner step), each a row of the table printed at the end. Without a CUDA device it refuses ("no CUDA
device: ...", exit 2); `--dry-run-cpu` runs every section on CPU at toy sizes (what CI checks; of the commands,
`generate` and the FSDP2 step on gloo).

    python tools/gpu_check.py --out $OUT
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
import traceback
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tools"))
QWEN3_06B = dict(vocab_size=151936, hidden_size=1024, intermediate_size=3072, num_hidden_layers=28,
                 num_attention_heads=16, num_key_value_heads=8, head_dim=128, max_position_embeddings=4096,
                 tie_word_embeddings=True, rope_theta=1000000.0)
TOY = dict(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
           num_key_value_heads=2, head_dim=16, max_position_embeddings=512, tie_word_embeddings=True)
TESTS = ["tests/test_device_placement.py"]  # the learner on the device, no default device set (as users run it)


def _sync(device) -> None:
    import torch

    if device.type == "cuda":
        torch.cuda.synchronize()


def _timed(fn, device, repeats: int = 3) -> float:
    """Median seconds of `fn()` after one warm-up."""
    fn()
    _sync(device)
    ts = []
    for _ in range(repeats):
        t = time.perf_counter()
        fn()
        _sync(device)
        ts.append(time.perf_counter() - t)
    return sorted(ts)[len(ts) // 2]


def build_models(shape: dict, device, dtype):
    """(transformers Qwen3, specrl twin, specrl 2-layer draft model) with random weights on `device`."""
    import torch
    import transformers as tf

    from specrl.model.hf_checkpoint import args_from_hf_config, load_state_into
    from specrl.model.transformer import Transformer

    torch.manual_seed(0)
    hf = tf.Qwen3ForCausalLM(tf.Qwen3Config(**shape)).to(device=device, dtype=dtype).eval()
    d = hf.config.to_dict()
    d["architectures"] = ["Qwen3ForCausalLM"]
    twin = Transformer(args_from_hf_config(d)).to(dtype)
    load_state_into(twin, {k: v.float().cpu() for k, v in hf.state_dict().items()}, "gpu-check")
    twin = twin.to(device=device, dtype=dtype).eval()
    draft_cfg = tf.Qwen3Config(**{**shape, "num_hidden_layers": 2})
    dd = draft_cfg.to_dict()
    dd["architectures"] = ["Qwen3ForCausalLM"]
    draft = Transformer(args_from_hf_config(dd)).to(device=device, dtype=dtype).eval()
    return hf, twin, draft


def section_tests(device_type: str, dry: bool) -> dict:
    if dry:
        return {"skipped": "dry run (CI runs these tests itself)"}
    env = {**os.environ, "SPECRL_TEST_DEVICE": device_type, "PYTHONPATH": str(ROOT)}
    t = time.perf_counter()
    p = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *TESTS], cwd=ROOT, env=env,
                       capture_output=True, text=True, timeout=240)
    tail = (p.stdout + p.stderr).strip().splitlines()[-1:] or [""]
    return {"returncode": p.returncode, "summary": tail[0], "seconds": time.perf_counter() - t, "tests": TESTS}


def section_decode(hf, twin, device, batches: list[int], prompt_len: int, new: int) -> list[dict]:
    import torch

    from specrl.rollout.engine import RolloutEngine
    from specrl.rollout.sampling import SamplingParams

    rows = []
    vocab = twin.args.vocab_size
    for b in batches:
        g = torch.Generator().manual_seed(b)
        prompts = torch.randint(3, vocab, (b, prompt_len), generator=g)
        engine = RolloutEngine(twin, max_batch_size=b, max_seq_len=prompt_len + new + 8, drafter=None,
                               num_draft_tokens=0)
        params = SamplingParams(temperature=0.0, max_new_tokens=new)
        rows_in, ids = prompts.tolist(), prompts.to(device)
        ours = _timed(lambda e=engine, x=rows_in, p=params: e.generate(x, p), device, repeats=1)
        theirs = _timed(lambda x=ids: hf.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=new,
                                                  min_new_tokens=new, do_sample=False, pad_token_id=0),
                        device, repeats=1)
        rows.append({"B": b, "engine_tok_s": b * new / ours, "transformers_tok_s": b * new / theirs,
                     "engine_over_transformers": theirs / ours})
    return rows


@__import__("torch").no_grad()
def forward_cost(model, device, b: int, tokens: int, context: int) -> float:
    """Seconds of one cached forward of `tokens` tokens per row for `b` rows over a `context`-token cache."""
    import torch

    cache = model.new_cache(b, context + tokens + 1)
    prefix = torch.randint(3, model.args.vocab_size, (b, context), device=device)
    model.forward_hidden(prefix, torch.arange(context, device=device).expand(b, context), cache)
    toks = torch.randint(3, model.args.vocab_size, (b, tokens), device=device)
    pos = torch.arange(context, context + tokens, device=device).expand(b, tokens)

    def step():
        h, _ = model.forward_hidden(toks, pos, cache, kv_len=context + tokens)
        model.logits(h)

    return _timed(step, device)


def section_costs(twin, draft, device, batches: list[int], ks: list[int], context: int) -> dict:
    v = {f"{b},{k}": forward_cost(twin, device, b, k + 1, context) for b in batches for k in ks}
    c = {str(b): forward_cost(draft, device, b, 1, context) for b in batches}
    return {"v_seconds": v, "c_draft_model_seconds": c, "context": context}


def section_spec_point(twin, device, b: int, k: int, prompt_len: int, new: int, v: float, v0: float) -> dict:
    import torch

    from specrl.drafters import make_drafter
    from specrl.rollout.engine import RolloutEngine
    from specrl.rollout.sampling import SamplingParams

    g = torch.Generator().manual_seed(1)
    base = torch.randint(3, twin.args.vocab_size, (b, 8), generator=g)
    prompts = base.repeat(1, prompt_len // 8).tolist()  # repetitive prompts: something for n-gram to copy
    params = SamplingParams(temperature=0.0, max_new_tokens=new)
    out = {}
    for name, drafter, kk in (("ar", None, 0), ("ngram", make_drafter("ngram", twin), k)):
        engine = RolloutEngine(twin, max_batch_size=b, max_seq_len=prompt_len + new + 16, drafter=drafter,
                               num_draft_tokens=kk)
        res = {}

        def run(engine=engine, res=res):
            res["r"] = engine.generate(prompts, params)

        s = _timed(run, device, repeats=1)
        out[name] = {"seconds": s, "tok_s": b * new / s, "acceptance_length": res["r"].metrics.get(
            "acceptance_length")}
    al = out["ngram"]["acceptance_length"] or 1.0
    predicted = al * v0 / v  # AR: one token per v(B, 0); speculation: AL tokens per v(B, k) (+ n-gram's ~0 draft)
    return {"B": b, "k": k, "measured": out, "acceptance_length": al, "predicted_speedup": predicted,
            "measured_speedup": out["ngram"]["tok_s"] / out["ar"]["tok_s"]}


def section_learner(device, dry: bool) -> dict:
    """One GRPO learner step (logprob + train, fp32) of a tiny checkpoint whose policy is moved to `device`; no
    default device is set, so a host allocation beside device tensors raises here as it would for a user."""
    import tempfile

    import torch

    from specrl.model.loader import load_model
    from specrl.trainer.config_check import validate_config
    from specrl.trainer.learner import Learner
    from tests.test_learner_group import seeded_rollouts
    from tests.tiny import make_tiny_checkpoint

    with tempfile.TemporaryDirectory() as d:
        ck = make_tiny_checkpoint(Path(d) / "tiny")
        cfg = validate_config({"model": {"name": str(ck)}, "speculative": {"drafter": "none"},
                               "grpo": {"num_prompts_per_step": 2, "num_generations": 4},
                               "policy": {"train_micro_batch_size": 4, "learning_rate": 1e-3}}, "gpu-check")
        policy, _ = load_model(str(ck), dtype=torch.float32)
        policy = policy.to(device).train()
        learner = Learner(cfg, policy)
        before = policy.embed_tokens.weight.detach().clone()
        t = time.perf_counter()
        rec = learner.learn(seeded_rollouts(), {"data": 0.0, "prepare": 0.0, "gen": 0.0})
        learner.check_weights(1)
        _sync(device)
        moved = float((policy.embed_tokens.weight - before).abs().max())
    return {"seconds": time.perf_counter() - t, "loss": rec["loss"], "grad_norm": rec["grad_norm"],
            "weights_moved": moved, "param_device": str(policy.embed_tokens.weight.device)}


def section_commands(out: Path, device_type: str, dry: bool) -> list[dict]:
    """The whole commands under the placement guard, one row each (on the dry run: generate and the FSDP2 step)."""
    from gpu_commands import run_all

    names = ("specrl generate", "FSDP2 learner step, one rank") if dry else None
    return run_all(out / "commands", device_type, names)


def markdown(rec: dict) -> str:
    lines = [f"# gpu check — {rec['device_name']} — {rec['date']}", "",
             f"torch {rec['torch']}, transformers {rec['transformers']}, model {rec['model_shape']}", ""]
    decode = rec["sections"].get("decode", {}).get("result")
    if decode:
        lines += ["| B | engine tok/s | transformers tok/s | engine ÷ transformers |", "|---|---|---|---|"]
        lines += [f"| {r['B']} | {r['engine_tok_s']:.0f} | {r['transformers_tok_s']:.0f} | "
                  f"{r['engine_over_transformers']:.2f}× |" for r in decode]
        lines.append("")
    costs = rec["sections"].get("costs", {}).get("result")
    if costs:
        lines += ["| B,k | v(B,k) ms |", "|---|---|"]
        lines += [f"| {bk} | {s * 1e3:.2f} |" for bk, s in costs["v_seconds"].items()]
        lines += ["", "| B | c(B) draft model ms |", "|---|---|"]
        lines += [f"| {b} | {s * 1e3:.2f} |" for b, s in costs["c_draft_model_seconds"].items()]
        lines.append("")
    spec = rec["sections"].get("spec_point", {}).get("result")
    if spec:
        lines += [f"n-gram k={spec['k']} at B={spec['B']}: AL {spec['acceptance_length']:.2f}, predicted speedup "
                  f"{spec['predicted_speedup']:.2f}×, measured {spec['measured_speedup']:.2f}×", ""]
    return "\n".join(lines + [table(rec)]) + "\n"


def table(rec: dict) -> str:
    """The check's one table: every section, and every whole command under the guard as its own row."""
    lines = ["| section / command | status | seconds | guarded processes | violations | first site |",
             "|---|---|---|---|---|---|"]
    for name, s in rec["sections"].items():
        rows = s["result"] if name == "commands" and s["status"] == "ok" else None
        if rows is None:
            lines.append(f"| {name} | {s['status']} | {s['seconds']:.1f} | | | |")
            continue
        lines += [f"| {r['command']} | {r['status']} | {r['seconds']:.1f} | {r['processes']} | {r['violations']} | "
                  f"{r['first_site']} |" for r in rows]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=os.environ.get("OUT", "gpu-check"))
    ap.add_argument("--dry-run-cpu", action="store_true", help="every section on CPU at toy sizes (CI)")
    a = ap.parse_args(argv)
    import torch

    if not a.dry_run_cpu and not torch.cuda.is_available():
        print(f"no CUDA device: torch {torch.__version__} (CUDA build: {torch.version.cuda or 'none'}) sees no GPU; "
              "make gpu-check runs on a machine with one NVIDIA GPU (or pass --dry-run-cpu to try the script)",
              file=sys.stderr)
        return 2
    import transformers

    dry = a.dry_run_cpu
    device = torch.device("cpu" if dry else "cuda")
    dtype = torch.float32 if dry else torch.bfloat16
    shape = TOY if dry else QWEN3_06B
    batches = [1, 2] if dry else [1, 4, 16, 64, 256]
    ks = [0, 1, 3] if dry else [0, 1, 3, 7]
    prompt_len, new, context = (16, 4, 32) if dry else (64, 64, 512)
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    rec = {"date": time.strftime("%Y-%m-%d %H:%M:%S %Z"), "torch": torch.__version__,
           "transformers": transformers.__version__, "dry_run_cpu": dry, "model_shape": shape,
           "device_name": torch.cuda.get_device_name(0) if not dry else "cpu (dry run)", "sections": {}}
    state: dict = {}

    def section(name, fn):
        t = time.perf_counter()
        try:
            result, status = fn(), "ok"
        except Exception as e:  # a failed section is recorded; the others still run
            result, status = {"error": f"{type(e).__name__}: {e}", "traceback": traceback.format_exc()[-2000:]}, \
                "failed"
        rec["sections"][name] = {"status": status, "seconds": time.perf_counter() - t, "result": result}
        print(f"[gpu-check] {name}: {status} ({time.perf_counter() - t:.1f} s)", flush=True)
        return result if status == "ok" else None

    section("tests", lambda: section_tests(device.type, dry))
    models = section("models", lambda: state.setdefault("m", build_models(shape, device, dtype)) and
                     {"params": sum(p.numel() for p in state["m"][1].parameters())})
    if models:
        hf, twin, draft = state["m"]
        section("decode", lambda: section_decode(hf, twin, device, batches, prompt_len, new))
        costs = section("costs", lambda: section_costs(twin, draft, device, batches, ks, context))
        if costs:
            b, k = batches[-1] if dry else 16, 3
            section("spec_point", lambda: section_spec_point(twin, device, b, k, prompt_len, new,
                                                             costs["v_seconds"][f"{b},{k}"],
                                                             costs["v_seconds"][f"{b},0"]))
    section("learner", lambda: section_learner(device, dry))
    section("commands", lambda: section_commands(out, device.type, dry))
    (out / "gpu_check.json").write_text(json.dumps(rec, indent=2, default=str) + "\n")
    (out / "gpu_check.md").write_text(markdown(rec))
    print(table(rec), flush=True)
    print(f"[gpu-check] wrote {out / 'gpu_check.json'} and {out / 'gpu_check.md'}", flush=True)
    commands_ok = all(r["status"] == "ok" for r in rec["sections"].get("commands", {}).get("result") or [])
    return 0 if all(s["status"] == "ok" for s in rec["sections"].values()) and commands_ok else 1


if __name__ == "__main__":
    sys.exit(main())
