"""`specrl prepare`, `specrl run` and `specrl train`: import the embedded model (and a drafter of it), the main job
(a compare of speculative and autoregressive rollouts, or the generation demo), and GRPO training from a config.
"""

from __future__ import annotations

import time
from pathlib import Path

import typer

from specrl.cli.common import THREADS_HELP, app, fail, set_threads
from specrl.errors import SpecRLError


@app.command()
def prepare(model: str = typer.Option("smollm2-135m", help="Preset to import into the cache."),
            drafter: str = typer.Option("none", help="Also build a drafter of the embedded model: none | eagle | mtp "
                                        "(the `default` one, chain_sum answers) | eagle:think | mtp:think (long "
                                        "step-by-step replies of examples/think.yaml); first use trains it."),
            threads: str = typer.Option("auto", help=THREADS_HELP)):
    """Import the embedded default model (one time; later calls are instant); optionally one of its drafters."""
    from specrl.drafters import DEFAULT_KINDS, EMBEDDED_NAMES
    from specrl.model import presets
    from specrl.rollout.drafter_spec import drafts

    try:
        set_threads(threads)
        kind, name = _embedded_drafter(drafter)
        if drafts(drafter) and (kind not in DEFAULT_KINDS or name not in EMBEDDED_NAMES):
            allowed = [k if n == "default" else f"{k}:{n}" for k in DEFAULT_KINDS for n in EMBEDDED_NAMES]
            raise SpecRLError(f"--drafter {drafter!r}: the embedded drafters are {', '.join(allowed)} (or none)")
        if drafts(drafter) and model != "smollm2-135m":
            raise SpecRLError(f"--drafter builds a drafter of the embedded smollm2-135m, not of {model!r}; "
                              "use `specrl draft init --model ... --out DIR` for other models")
        path = presets.prepare(model)
        typer.echo(f"[specrl] model {model} ready at {path}")
        if drafts(drafter):
            from specrl.drafters.storage.default import ensure_default_drafter

            typer.echo(f"[specrl] {kind}:{name} drafter ready at {ensure_default_drafter(kind, name)}")
    except SpecRLError as e:
        fail(e)


def _embedded_drafter(drafter: str) -> tuple[str, str]:
    """`prepare --drafter KIND[:NAME]` -> (kind, name), NAME defaulting to `default`; ("", "") when it does not
    parse."""
    from specrl.rollout.drafter_spec import parse_drafter_spec

    try:
        spec = parse_drafter_spec(drafter if ":" in drafter else f"{drafter}:default")
    except SpecRLError:
        return "", ""
    return spec.kind, spec.arg


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
    """The trainer factory for `specrl train`: sync in-process, async on Ray (specrl.cluster)."""
    from specrl.cluster import make_trainer

    return make_trainer


DEFAULT_CONFIG = "examples/default.yaml"


@app.command()
def run(config: str | None = typer.Option(None, help=f"Training config [default: {DEFAULT_CONFIG}]."),
        set_: list[str] = typer.Option([], "--set", help="Override: key=value (repeatable), e.g. run.seed=1."),
        demo: bool = typer.Option(False, help="Only run the generation demo on built-in prompts.")):
    """The main job: the config's GRPO run with speculative rollouts, side by side with the same run decoded
    autoregressively (same seeds, steps interleaved); report.md leads with the speed-ups and the losslessness
    certificate (the speculative run's own probe at its end), then the identity evidence.

    The speculative arm (RUN_DIR/speculative) is the training run to keep. Arms that part numerically (seed_exact
    on a CPU) are reported, not an error. `--set` overrides the config as in `specrl train` (a killed compare of the
    overridden config is continued by the same command). Without --config and outside a checkout (no
    examples/default.yaml): the generation demo."""
    if not demo and config is None and not Path(DEFAULT_CONFIG).exists():
        typer.echo(f"[specrl] {DEFAULT_CONFIG} is not here (run from the checkout for the main job); running the "
                   "generation demo")
        demo = True
    if demo:
        if set_:
            fail(SpecRLError(f"--set {' '.join(set_)} with the generation demo: --set overrides a training config; "
                             "drop --demo (and pass --config) to run the main job with it"))
        _demo()
        return
    from specrl.run.loop import train_main
    from specrl.run.run_dir import unfinished_compare

    try:
        if config is not None and not Path(config).is_file():
            raise SpecRLError(f"--config {config} is not a file; pass a training config YAML (e.g. {DEFAULT_CONFIG})"
                              ", or --demo for the generation demo")
        resume = unfinished_compare(config or DEFAULT_CONFIG, list(set_))  # a killed run of a config that keeps it
        run_dir = train_main(None if resume else config or DEFAULT_CONFIG, list(set_), resume, None, compare=True,
                             stop_on_divergence=False)
    except SpecRLError as e:
        fail(e)
    typer.echo(f"[specrl] report: {Path(run_dir) / 'report.md'}")


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
               f"{m['tokens_per_second']:.1f} tokens/s (batch {len(prompts)}, "
               f"{str(model.dtype).removeprefix('torch.')}, autoregressive)")


@app.command()
def train(config: str | None = typer.Option(None, help="YAML config [default: examples/default.yaml; with "
                                                       "--resume: the run's own config.yaml]."),
          set_: list[str] = typer.Option([], "--set", help="Override: key=value (repeatable)."),
          resume: str | None = typer.Option(None, help="Run directory to resume."),
          out: str | None = typer.Option(None, help="Run directory (default runs/NAME)."),
          compare: bool = typer.Option(False, help="Run autoregressive and speculative side by side.")):
    """GRPO training with speculative rollouts (see examples/*.yaml)."""
    from specrl.run.loop import train_main

    t0 = time.time()
    if config is None and resume is None:
        config = "examples/default.yaml"
    try:
        run_dir = train_main(config, list(set_), resume, out, compare, make_trainer=_make_trainer())
    except SpecRLError as e:
        fail(e)
    typer.echo(f"[specrl] done in {time.time() - t0:.0f} s; report: {Path(run_dir) / 'report.md'}")
