"""`specrl draft ...`: a drafter's life outside RL: `init` trains one offline, `build` reproduces one from its recipe
(resumable stages), `eval` measures it on held-out prompts, `curve` draws its scaling curve, `export` writes it in
vLLM's EAGLE-3 layout.
"""

from __future__ import annotations

from pathlib import Path

import typer

from specrl.cli.common import DTYPE_HELP, THREADS_HELP, draft_app, dtype_option, fail, parse_int_list, set_threads
from specrl.errors import SpecRLError


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
    from specrl.drafters.storage.default import task_prompts
    from specrl.drafters.training.build.from_rollouts import train_drafter_offline

    try:
        set_threads(threads)
        path = train_drafter_offline(model, drafter, prompts=task_prompts(task, samples), samples=samples,
                                     epochs=epochs, out=out or Path("drafters") / f"{drafter}-{task}",
                                     data_jsonl=str(data) if data else None, max_new_tokens=max_new_tokens,
                                     draft_layers=draft_layers, draft_vocab_size=draft_vocab_size, source=task,
                                     dtype=dtype_option(dtype))
    except SpecRLError as e:
        fail(e)
    typer.echo(f"[specrl] drafter saved to {path}")


@draft_app.command("build")
def draft_build(recipe: str = typer.Option("think", help="a recipe JSON file, or a shipped recipe's name (think)"),
                work: Path = typer.Option(None, help="build directory (resumable); default builds/<recipe name>"),
                stage: str = typer.Option("all", help="all | rollouts | features | train | eval | package: run one "
                                          "stage (each resumes; later ones need the earlier ones' output)"),
                partial: bool = typer.Option(False, help="--stage features: extract the rollout shards present so "
                                             "far (while the rollouts stage still runs elsewhere)"),
                data_from: Path = typer.Option(None, help="read the rollouts and features of this other build "
                                               "directory instead of making them (its recipe's data fields must "
                                               "equal this recipe's; recorded, so later stages read it too)"),
                k: str = typer.Option(None, help="--stage eval: measure only these draft lengths (comma-separated) "
                                      "into WORK/eval/per_k and stop; a later --stage eval reuses them"),
                threads: str = typer.Option("auto", help=THREADS_HELP)):
    """Reproduce a drafter from its recipe: rollouts in checked shards, target features, the trained head, its
    held-out evaluation and the packaged files (every stage resumable after a kill)."""
    from specrl.drafters.storage.default import task_prompts
    from specrl.drafters.training.build import release
    from specrl.drafters.training.build import stages as pipeline
    from specrl.drafters.training.build.heldout import summary
    from specrl.drafters.training.build.recipe import Recipe

    set_threads(threads)
    try:
        if stage not in ("all", *pipeline.STAGES):
            raise SpecRLError(f"--stage must be all or one of {', '.join(pipeline.STAGES)}, got {stage!r}")
        if k is not None and stage != "eval":
            raise SpecRLError(f"--k measures draft lengths of the eval stage only; give --stage eval, not {stage!r}")
        ks = parse_int_list(k, "--k") if k is not None else None
        r = Recipe.load(recipe)
        w = work or Path("builds") / r.name
        if data_from is not None:
            src = pipeline.link_data(r, w, data_from)
            typer.echo(f"[specrl] {r.name}: reads the rollouts and features of {src}")
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
        if ks is not None:
            ev = release.run_eval(r, w, prompts, ks=ks, measure_only=True)
            typer.echo(f"[specrl] {r.name}: held-out AL " + ", ".join(
                f"k={x}: {v['acceptance_length']:.2f}" for x, v in ev["per_k"].items()) + f" in {w / 'eval' / 'per_k'}")
        elif stage in ("all", "eval"):
            ev = release.run_eval(r, w, prompts)
            typer.echo(f"[specrl] {r.name}: {summary(ev)}")
    except SpecRLError as e:
        fail(e)


def _recipe_prompts(recipe: str):
    from specrl.drafters.storage.default import task_prompts
    from specrl.drafters.training.build.recipe import Recipe

    r = Recipe.load(recipe)
    return r, task_prompts(r.task, r.prompts + r.prompts // 4, heldout=r.heldout_prompts, difficulty=r.difficulty,
                           seed=r.task_seed, answer_format=r.answer_format)


@draft_app.command("eval")
def draft_eval(drafter: str = typer.Option("eagle:think", help="eagle:DIR / parallel:DIR (a drafter directory) or "
                                           "a shipped name (eagle:think)"),
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

    from specrl.drafters.storage.default import resolve_drafter
    from specrl.drafters.training.build.heldout import evaluate_drafter, summary
    from specrl.drafters.training.build.stages import _load_target

    set_threads(threads)
    try:
        r, source = _recipe_prompts(recipe)
        target, tokenizer, stops = _load_target(r, None)
        d = resolve_drafter(drafter, target)
        if d is None:
            raise SpecRLError("--drafter none has nothing to evaluate; give eagle:DIR or eagle:think")
        _, held = source(tokenizer)
        held = list(held)[: prompts or r.heldout_prompts]
        ev = evaluate_drafter(target, d, held, r.temperature, max_new_tokens or r.max_new_tokens, stops,
                              ks=parse_int_list(k, "--k"), seed=r.seed, ttt_steps=r.ttt_steps,
                              cost_batches=parse_int_list(cost, "--cost") if cost else ())
        ev["drafter"] = drafter
    except SpecRLError as e:
        fail(e)
    typer.echo(f"[specrl] {drafter}: {summary(ev)}")
    if json_out is not None:
        json_out.write_text(json.dumps(ev, indent=1) + "\n")
        typer.echo(f"[specrl] wrote {json_out}")


def curve_plot_path(work: Path, separate: bool) -> Path:
    """Where `draft curve` draws without --plot: beside its JSON in the build directory, never the current one."""
    return work / "eval" / ("curve_separate.png" if separate else "curve.png")


@draft_app.command("curve")
def draft_curve(recipe: str = typer.Option("think"), work: Path = typer.Option(None, help="the build directory"),
                k: int = typer.Option(None, help="draft length (default: the recipe's k)"),
                prompts: int = typer.Option(None, help="held-out prompts (default: the recipe's heldout_prompts)"),
                plot: Path = typer.Option(None, help="where to draw the curve (default WORK/eval/curve.png, with "
                                          "--separate WORK/eval/curve_separate.png)"),
                separate: bool = typer.Option(False, "--separate", help="train a fresh head on the first N shards "
                                              "for each N in the recipe's curve (resumable, WORK/curve/) and "
                                              "evaluate each, instead of the one training's snapshots"),
                partial: bool = typer.Option(False, "--partial", help="with --separate, while the data is still "
                                             "being made: only the counts whose shards have rollouts and features, "
                                             "without the build's own head"),
                data_from: Path = typer.Option(None, help="read the rollouts and features of this other build of "
                                               "the same data fields (as `draft build --data-from`)"),
                threads: str = typer.Option("auto", help=THREADS_HELP)):
    """The scaling curve: held-out AL at k of the head's snapshots along its training (WORK/eval/curve.json), or
    with --separate of separate trainings on the first N shards (WORK/eval/curve_separate.json)."""
    import json

    from specrl.drafters.training.build.curve import plot_separate_curve, run_separate_curve
    from specrl.drafters.training.build.release import plot_curve, run_curve

    set_threads(threads)
    try:
        r, source = _recipe_prompts(recipe)
        w = work or Path("builds") / r.name
        if partial and not separate:
            raise SpecRLError("--partial applies to --separate (separate trainings on the first N shards)")
        if data_from is not None:
            from specrl.drafters.training.build.stages import link_data

            link_data(r, w, data_from)
        if separate:
            rows = run_separate_curve(r, w, source, k=k, n_prompts=prompts, log=typer.echo, partial=partial)
            if not rows:
                fail(SpecRLError("no point of the curve was finished; run the same command again"))
            if not partial and len(rows) < len({n for n in r.curve if n < r.n_shards}) + 1:
                fail(SpecRLError(f"the curve is not complete ({len(rows)} points); run the same command again"))
            snap = w / "eval" / "curve.json"
            plot = plot or curve_plot_path(w, separate=True)
            plot_separate_curve(rows, plot, f"{r.kind}:{r.name} ({r.model}, {r.task} {r.answer_format}, "
                                f"T={r.temperature}): {rows[0]['setting']['prompts']} held-out prompts",
                                snapshots=json.loads(snap.read_text()) if snap.exists() else None)
        else:
            rows = run_curve(r, w, source, k=k, n_prompts=prompts, log=typer.echo)
            plot = plot or curve_plot_path(w, separate=False)
            plot_curve(rows, plot, f"{r.kind}:{r.name} ({r.model}, {r.task} {r.answer_format}, T={r.temperature}): "
                                   f"{rows[0]['prompts']} held-out prompts")
    except SpecRLError as e:
        fail(e)
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
    from specrl.drafters.storage.default import default_head_spec
    from specrl.drafters.storage.export import FORMATS, export_vllm_eagle3, exports
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
        fail(e)
    typer.echo(f"[specrl] exported {drafter} to {path} ({fmt}); serve it with vLLM: speculative_config="
               f"{{\"method\": \"eagle3\", \"model\": \"{path}\", \"num_speculative_tokens\": 3}}")
