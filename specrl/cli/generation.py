"""`specrl generate`: continuations of a JSONL of prompts, autoregressive or speculative, written as JSONL."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import typer

from specrl.cli.common import DTYPE_HELP, app, dtype_option, fail, parse_k
from specrl.errors import SpecRLError
from specrl.fileio import atomic_write


def _read_prompts(path: Path, tok, raw: bool) -> list[list[int]]:
    from specrl.config.schema import read_text_file
    from specrl.model.tokenizer import encode_chat, encode_raw
    from specrl.rollout.protocol import token_id_list

    if not path.exists():
        raise SpecRLError(f"--prompts file {path} does not exist")
    prompts = []
    for lineno, line in enumerate(read_text_file(path, "--prompts file").splitlines(), 1):
        if not line.strip():
            continue
        try:
            obj = json.loads(line)
        except json.JSONDecodeError as e:
            raise SpecRLError(f"{path}:{lineno}: not valid JSON ({e})") from None
        if isinstance(obj, dict) and "prompt_token_ids" in obj:
            prompts.append(token_id_list(obj["prompt_token_ids"], f"{path}:{lineno}: prompt_token_ids"))
            if not prompts[-1]:
                raise SpecRLError(f"{path}:{lineno}: prompt {len(prompts) - 1} has no token ids; give at least one "
                                  "(or delete the line)")
        elif isinstance(obj, dict) and isinstance(obj.get("prompt"), str):
            if not obj["prompt"].strip():
                raise SpecRLError(f"{path}:{lineno}: prompt {len(prompts)} is empty; give each line a non-empty "
                                  "\"prompt\" (or delete the line)")
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


def _check_out_file(out: Path) -> None:
    """--out must name a file in a directory we can write to (created if missing)."""
    if out.is_dir():
        raise SpecRLError(f"--out {out} is a directory; pass a file path such as {out / 'out.jsonl'}")
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise SpecRLError(f"--out {out}: cannot create its directory {out.parent}: {e.strerror or e}") from None
    if not os.access(out.parent, os.W_OK) or (out.exists() and not os.access(out, os.W_OK)):
        raise SpecRLError(f"--out {out}: {out.parent if not out.exists() else out} is not writable; pass a path "
                          "in a writable directory")


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
    dtype: str = typer.Option("auto", help=DTYPE_HELP),
    device: str = typer.Option("auto", help="auto | cpu | cuda | cuda:N"),
):
    """Generate continuations for a JSONL of prompts (autoregressive or speculative)."""
    from tqdm import tqdm

    from specrl.drafters.storage.default import resolve_drafter
    from specrl.model.loader import load_model
    from specrl.model.tokenizer import stop_token_ids
    from specrl.rollout.drafter_spec import drafts
    from specrl.rollout.engine import RolloutEngine
    from specrl.rollout.sampling import SamplingParams

    try:
        if num_samples < 1:
            raise SpecRLError(f"--num-samples must be >= 1, got {num_samples}")
        for flag, v in (("--temperature", temperature), ("--top-p", top_p)):
            if v != v or v in (float("inf"), float("-inf")):
                raise SpecRLError(f"{flag} must be a finite number, got {v}")
        _check_out_file(out)  # before any generation: a bad --out must not cost the whole run
        target, tok = load_model(model, dtype=dtype_option(dtype, device), device=device)
        ids = _read_prompts(prompts, tok, raw)
        sp = SamplingParams(temperature=temperature, top_p=top_p, top_k=top_k, max_new_tokens=max_new_tokens,
                            seed=seed, stop_token_ids=stop_token_ids(tok, target.args))
        engine = RolloutEngine(target, max_batch_size=max_batch_size, max_seq_len=max_seq_len,
                               drafter=resolve_drafter(drafter, target), num_draft_tokens=parse_k(k), verify=verify)
        flat = [p for p in ids for _ in range(num_samples)]
        with tqdm(total=len(flat), desc="generate", unit="seq", file=sys.stderr) as bar:
            outs = engine.generate(flat, sp, progress=bar)
    except SpecRLError as e:
        fail(e)
    try:
        with atomic_write(out) as f:
            for i, o in enumerate(outs):
                text = tok.decode(o.token_ids, skip_special_tokens=True) if tok is not None else None
                f.write(json.dumps({"prompt_index": i // num_samples, "sample_index": i % num_samples,
                                    "token_ids": o.token_ids, "logprobs": o.logprobs, "text": text,
                                    "finish_reason": o.finish_reason}, allow_nan=False) + "\n")
    except (OSError, ValueError) as e:
        why = (getattr(e, "strerror", None) or str(e)) if isinstance(e, OSError) else \
            "an output holds non-finite log-probabilities (NaN/inf), which is a model or sampling fault"
        fail(SpecRLError(f"cannot write --out {out}: {why}; nothing was written"))
    m = outs.metrics
    line = (f"[specrl] {len(outs)} sequences, {m['generated_tokens']} tokens in {m['total_seconds']:.2f} s = "
            f"{m['tokens_per_second']:.1f} tokens/s")
    if drafts(drafter):
        line += f"; acceptance length {m['acceptance_length']:.2f}, acceptance rate {m['acceptance_rate']:.2f}"
    typer.echo(line + f" -> {out}")
