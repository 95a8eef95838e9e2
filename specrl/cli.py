"""The `specrl` command line: prepare, run, generate, train, draft, simulate.

Each verb is a thin shell over the library: it parses and validates flags, calls the API, and prints a
readable summary. Errors of user input (`SpecRLError`) are printed as one line and exit with status 2.
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

import typer

from specrl.errors import SpecRLError

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

app = typer.Typer(add_completion=False, no_args_is_help=True, help="specrl: RL post-training with lossless "
                  "speculative rollouts.")
draft_app = typer.Typer(no_args_is_help=True, help="Drafter lifecycle: offline initialisation.")
app.add_typer(draft_app, name="draft")

from specrl.sim.cli import app as _sim_app  # noqa: E402  (the simulator registers `specrl simulate ...`)

app.add_typer(_sim_app, name="simulate")


def _fail(e: Exception) -> None:
    typer.secho(f"error: {e}", fg=typer.colors.RED, err=True)
    raise typer.Exit(2)


def _parse_k(k: str) -> int | str:
    if k == "auto":
        return "auto"
    try:
        return int(k)
    except ValueError:
        raise SpecRLError(f"--k must be an integer or 'auto', got {k!r}") from None


@app.command()
def prepare(model: str = typer.Option("smollm2-135m", help="Preset to import into the cache."),
            drafter: str = typer.Option("none", help="Also build the default drafter of the embedded model: "
                                        "none | eagle | mtp (first use trains it in a few minutes).")):
    """Import the embedded default model (one time; later calls are instant); optionally its default drafter."""
    from specrl.model import presets

    try:
        if drafter not in ("none", "eagle", "mtp"):
            raise SpecRLError(f"--drafter {drafter!r}: default drafters exist for eagle and mtp (or none)")
        if drafter != "none" and model != "smollm2-135m":
            raise SpecRLError(f"--drafter builds the default drafter of smollm2-135m, not of {model!r}; "
                              "use `specrl draft init --model ... --out DIR` for other models")
        path = presets.prepare(model)
        typer.echo(f"[specrl] model {model} ready at {path}")
        if drafter != "none":
            from specrl.rl.default_drafter import ensure_default_drafter

            typer.echo(f"[specrl] default {drafter} drafter ready at {ensure_default_drafter(drafter)}")
    except SpecRLError as e:
        _fail(e)


DEMO_PROMPTS = [
    "What is 17 + 25? Answer with the number only.",
    "Compute 9 * 8 - 13.",
    "Write one sentence about the sea.",
    "List three prime numbers greater than 10.",
    "What is 144 divided by 12?",
    "Name the capital of France and one famous landmark there.",
    "Count from 1 to 10.",
    "Explain in two sentences what a rollout is in reinforcement learning.",
]


def _make_trainer():
    """The trainer factory for `specrl train` / `run`: sync in-process, async on Ray (specrl.distributed)."""
    from specrl.distributed import make_trainer

    return make_trainer


@app.command()
def run(config: str = typer.Option("examples/default.yaml", help="Training config (the main job)."),
        demo: bool = typer.Option(False, help="Only run the generation demo on built-in prompts.")):
    """The main job: GRPO training with speculative rollouts on the embedded model (or --demo)."""
    if not demo and Path(config).exists():
        from specrl.rl.run import train_main

        try:
            run_dir = train_main(config, [], None, None, False, make_trainer=_make_trainer())
        except SpecRLError as e:
            _fail(e)
        typer.echo(f"[specrl] report: {Path(run_dir) / 'report.md'}")
        return
    _demo()


def _demo() -> None:
    from specrl.model.loader import load_model
    from specrl.model.tokenizer import encode_chat, stop_token_ids
    from specrl.rollout.engine import RolloutEngine
    from specrl.rollout.sampling import SamplingParams

    model, tok = load_model("smollm2-135m")
    prompts = [encode_chat(tok, p) for p in DEMO_PROMPTS]
    sp = SamplingParams(temperature=0.7, max_new_tokens=64, stop_token_ids=stop_token_ids(tok, model.args), seed=0)
    engine = RolloutEngine(model, max_batch_size=8, max_seq_len=512)
    outs = engine.generate(prompts, sp)
    for p, o in zip(DEMO_PROMPTS, outs, strict=True):
        typer.echo(f"\n>>> {p}\n{tok.decode(o.token_ids, skip_special_tokens=True).strip()}")
    m = outs.metrics
    typer.echo(f"\n[specrl] {m['generated_tokens']} tokens in {m['total_seconds']:.2f} s = "
               f"{m['tokens_per_second']:.1f} tokens/s (batch {len(prompts)}, bf16, autoregressive)")


def _read_prompts(path: Path, tok, raw: bool) -> list[list[int]]:
    from specrl.model.tokenizer import encode_chat, encode_raw

    if not path.exists():
        raise SpecRLError(f"--prompts file {path} does not exist")
    prompts = []
    for lineno, line in enumerate(path.read_text().splitlines(), 1):
        if not line.strip():
            continue
        try:
            obj = json.loads(line)
        except json.JSONDecodeError as e:
            raise SpecRLError(f"{path}:{lineno}: not valid JSON ({e})") from None
        if isinstance(obj, dict) and "prompt_token_ids" in obj:
            prompts.append([int(t) for t in obj["prompt_token_ids"]])
        elif isinstance(obj, dict) and isinstance(obj.get("prompt"), str):
            if tok is None:
                raise SpecRLError(f"{path}:{lineno}: text prompts need a tokenizer, the model has none; "
                                  "give prompt_token_ids instead")
            prompts.append(encode_raw(tok, obj["prompt"]) if raw else encode_chat(tok, obj["prompt"]))
        else:
            raise SpecRLError(f"{path}:{lineno}: expected {{\"prompt\": \"...\"}} or "
                              f"{{\"prompt_token_ids\": [...]}}, got {line[:80]!r}")
    if not prompts:
        raise SpecRLError(f"{path} holds no prompts")
    return prompts


@app.command()
def generate(
    model: str = typer.Option("smollm2-135m", help="Preset name or HF checkpoint directory."),
    prompts: Path = typer.Option(..., help="JSONL: {\"prompt\": ...} or {\"prompt_token_ids\": [...]} per line."),
    out: Path = typer.Option(..., help="Output JSONL."),
    temperature: float = 1.0, top_p: float = 1.0, top_k: int = 0, max_new_tokens: int = 128, seed: int = 0,
    num_samples: int = typer.Option(1, help="Samples per prompt."),
    raw: bool = typer.Option(False, help="Do not apply the chat template."),
    drafter: str = typer.Option("none", help="none | ngram | suffix | draft-model:PATH | eagle:PATH | mtp:PATH"),
    k: str = typer.Option("3", help="Draft tokens per step, or 'auto'."),
    verify: str = typer.Option("rejection", help="rejection | seed_exact"),
    max_batch_size: int = 32, max_seq_len: int = 2048,
    dtype: str = typer.Option("bf16", help="bf16 | fp32"),
):
    """Generate continuations for a JSONL of prompts (autoregressive or speculative)."""
    from tqdm import tqdm

    from specrl.model.checkpoint import parse_dtype
    from specrl.model.loader import load_model
    from specrl.model.tokenizer import stop_token_ids
    from specrl.rl.default_drafter import resolve_drafter
    from specrl.rollout.engine import RolloutEngine
    from specrl.rollout.sampling import SamplingParams

    try:
        if num_samples < 1:
            raise SpecRLError(f"--num-samples must be >= 1, got {num_samples}")
        target, tok = load_model(model, dtype=parse_dtype(dtype))
        ids = _read_prompts(prompts, tok, raw)
        sp = SamplingParams(temperature=temperature, top_p=top_p, top_k=top_k, max_new_tokens=max_new_tokens,
                            seed=seed, stop_token_ids=stop_token_ids(tok, target.args))
        engine = RolloutEngine(target, max_batch_size=max_batch_size, max_seq_len=max_seq_len,
                               drafter=resolve_drafter(drafter, target), num_draft_tokens=_parse_k(k), verify=verify)
        flat = [p for p in ids for _ in range(num_samples)]
        with tqdm(total=len(flat), desc="generate", unit="seq", file=sys.stderr) as bar:
            outs = engine.generate(flat, sp, progress=bar)
    except SpecRLError as e:
        _fail(e)
    out.parent.mkdir(parents=True, exist_ok=True)
    with out.open("w") as f:
        for i, o in enumerate(outs):
            text = tok.decode(o.token_ids, skip_special_tokens=True) if tok is not None else None
            f.write(json.dumps({"prompt_index": i // num_samples, "sample_index": i % num_samples,
                                "token_ids": o.token_ids, "logprobs": o.logprobs, "text": text,
                                "finish_reason": o.finish_reason}) + "\n")
    m = outs.metrics
    line = (f"[specrl] {len(outs)} sequences, {m['generated_tokens']} tokens in {m['total_seconds']:.2f} s = "
            f"{m['tokens_per_second']:.1f} tokens/s")
    if drafter != "none":
        line += f"; acceptance length {m['acceptance_length']:.2f}, acceptance rate {m['acceptance_rate']:.2f}"
    typer.echo(line + f" -> {out}")


@app.command()
def train(config: str = typer.Option("examples/default.yaml", help="YAML config."),
          set_: list[str] = typer.Option([], "--set", help="Override: key=value (repeatable)."),
          resume: str | None = typer.Option(None, help="Run directory to resume."),
          out: str | None = typer.Option(None, help="Run directory (default runs/NAME)."),
          compare: bool = typer.Option(False, help="Run autoregressive and speculative side by side.")):
    """GRPO training with speculative rollouts (see examples/*.yaml)."""
    from specrl.rl.run import train_main

    t0 = time.time()
    try:
        run_dir = train_main(config, list(set_), resume, out, compare, make_trainer=_make_trainer())
    except SpecRLError as e:
        _fail(e)
    typer.echo(f"[specrl] done in {time.time() - t0:.0f} s; report: {Path(run_dir) / 'report.md'}")


@draft_app.command("init")
def draft_init(model: str = typer.Option("smollm2-135m"), drafter: str = typer.Option("eagle"),
               task: str = typer.Option("chain_sum"), samples: int = 256, epochs: int = 2,
               out: Path | None = typer.Option(None), data: Path | None = typer.Option(None),
               draft_layers: int = typer.Option(4, help="--drafter draft-model: how many of the target's first "
                                                "layers the draft model keeps before distillation"),
               max_new_tokens: int = typer.Option(160, help="rollout length cap for the training data"),
               draft_vocab_size: int = typer.Option(8192, help="eagle / draft-model: draft over this many of the "
                                                    "most frequent response tokens (the full vocabulary if larger)")):
    """Train a drafter (eagle | mtp | draft-model) offline on in-domain rollouts (or on --data JSONL texts)."""
    from specrl.drafters.build import build_drafter
    from specrl.rl.default_drafter import task_prompts

    try:
        path = build_drafter(model, drafter, prompts=task_prompts(task, samples), samples=samples, epochs=epochs,
                             out=out or Path("drafters") / f"{drafter}-{task}", data_jsonl=str(data) if data else None,
                             max_new_tokens=max_new_tokens, draft_layers=draft_layers,
                             draft_vocab_size=draft_vocab_size, source=task)
    except SpecRLError as e:
        _fail(e)
    typer.echo(f"[specrl] drafter saved to {path}")


def main() -> None:
    app()


if __name__ == "__main__":
    main()
