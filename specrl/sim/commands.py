"""`specrl simulate`: the command-line face of the simulator (registered by specrl/cli.py).

`specrl simulate [flags]` runs one simulation (a readable table, or `--json` for the JSON contract) or, with
`--from-run runs/NAME/metrics.jsonl`, predicts a real run's stages; subcommands `sweep`, `advise`,
`profile-hardware` and `fit`. Explicit flags override the preset; without `--preset` they override
`paper-8b-rl-think`. Bad input raises `SpecRLError`, printed as `error: ...` with exit code 2.
"""

from __future__ import annotations

import sys
import time
from dataclasses import replace
from typing import Annotated

import typer

from specrl.errors import SpecRLError
from specrl.sim import report
from specrl.sim.pipeline import SimConfig, simulate

app = typer.Typer(help="Performance simulator: does speculation (and async RL) pay on your model and cluster?",
                  no_args_is_help=False, add_completion=False)

Preset = Annotated[str | None, typer.Option("--preset", help="paper-8b-rl-think | paper-8b-rl-zero | paper-235b")]
Model = Annotated[str | None, typer.Option("--model", help="catalog name or path to a HF config.json")]
Hw = Annotated[str | None, typer.Option("--hardware", help="h100 | h200 | b200 | gb200 | cpu | profile.json")]
Gpus = Annotated[int | None, typer.Option("--gpus")]
Drafter = Annotated[str | None, typer.Option("--drafter", help="none | eagle3 | mtp | draft-model | ngram")]
K = Annotated[str | None, typer.Option("--k", help="draft length, an integer >= 1 or 'auto'")]
AL = Annotated[float | None, typer.Option("--acceptance-length", help="mean tokens per verify step, in [1, k+1]")]
Rates = Annotated[str | None, typer.Option("--acceptance-rates", help="per-position rates a1,a2,... in [0, 1]")]
Mode = Annotated[str | None, typer.Option("--mode", help="sync | async")]
Lag = Annotated[int | None, typer.Option("--policy-lag")]
Frac = Annotated[float | None, typer.Option("--gen-gpu-fraction")]
Prec = Annotated[str | None, typer.Option("--precision", help="bf16 | fp8")]
Prompts = Annotated[int | None, typer.Option("--prompts-per-step")]
Gens = Annotated[int | None, typer.Option("--generations-per-prompt")]
MaxTok = Annotated[int | None, typer.Option("--max-response-tokens")]
RespMean = Annotated[float | None, typer.Option("--response-mean", help="mean of the uncapped log-normal")]
RespSigma = Annotated[float | None, typer.Option("--response-sigma", help="log-normal shape")]
Hist = Annotated[str | None, typer.Option("--length-histogram", help="CSV of length,count rows")]
PerEngine = Annotated[int | None, typer.Option("--gpus-per-engine")]
DraftModel = Annotated[str | None, typer.Option("--drafter-model", help="for --drafter draft-model")]
CpuProfile = Annotated[str | None, typer.Option("--cpu-profile", help="profile JSON for --hardware cpu")]
CudaGraphs = Annotated[int | None, typer.Option(
    "--cudagraph-max-tokens", help="largest forward (tokens) replaying a CUDA graph; 0: none (enforce_eager); "
    "default: vLLM's min(max_num_seqs*(1+k)*2, 512 | 1024 on Blackwell)")]
Json = Annotated[bool, typer.Option("--json", help="print the JSON contract")]


def _fail(exc: Exception) -> None:
    typer.echo(f"error: {exc}", err=True)
    raise typer.Exit(2)


def parse_k(k: str | None) -> int | str | None:
    if k is None or k == "auto":
        return k
    try:
        return int(k)
    except ValueError:
        raise SpecRLError(f"--k must be an integer >= 1 or 'auto', got {k!r}") from None


def parse_rates(text: str | None) -> tuple[float, ...] | None:
    if text is None:
        return None
    try:
        return tuple(float(x) for x in text.split(",") if x.strip())
    except ValueError:
        raise SpecRLError(f"--acceptance-rates must be comma-separated numbers in [0, 1], got {text!r}") from None


def parse_list(flag: str, text: str, kind: type) -> list:
    """A comma-separated flag value as a list of `kind`; a SpecRLError naming the flag otherwise."""
    try:
        out = [kind(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise SpecRLError(f"{flag} must be comma-separated {'integers' if kind is int else 'numbers'}, e.g. "
                          f"{'1,2,3' if kind is int else '1.5,2,2.5'}; got {text!r}") from None
    if not out:
        raise SpecRLError(f"{flag} is empty; give comma-separated values, e.g. {'1,2,3' if kind is int else '1.5,2'}")
    return out


def build_config(preset=None, model=None, hardware=None, gpus=None, drafter=None, k=None,
                 acceptance_length=None, acceptance_rates=None, mode=None, policy_lag=None,
                 gen_gpu_fraction=None, precision=None, prompts_per_step=None, generations_per_prompt=None,
                 max_response_tokens=None, response_mean=None, response_sigma=None, length_histogram=None,
                 gpus_per_engine=None, drafter_model=None, cpu_profile=None,
                 cudagraph_max_tokens=None) -> SimConfig:
    from specrl.sim.calibration.fromrun import cpu_efficiency
    from specrl.sim.scenarios import get_preset

    if cudagraph_max_tokens is not None and cudagraph_max_tokens < 0:
        raise SpecRLError(f"--cudagraph-max-tokens must be >= 0 (the largest forward, in tokens, that replays a CUDA "
                          f"graph; 0: no graphs, like vLLM's enforce_eager), got {cudagraph_max_tokens}")
    if gen_gpu_fraction is not None and not 0.0 < gen_gpu_fraction < 1.0:
        raise SpecRLError(f"--gen-gpu-fraction must be in (0, 1) (the share of GPUs that generate in async mode), "
                          f"got {gen_gpu_fraction}")
    cfg = get_preset(preset or "paper-8b-rl-think")
    kv = dict(model=model, hardware=hardware, gpus=gpus, drafter=drafter, k=parse_k(k), mode=mode,
              policy_lag=policy_lag, gen_gpu_fraction=gen_gpu_fraction, precision=precision,
              prompts_per_step=prompts_per_step, generations_per_prompt=generations_per_prompt,
              max_response_tokens=max_response_tokens, response_mean=response_mean, response_sigma=response_sigma,
              length_histogram=length_histogram, gpus_per_engine=gpus_per_engine, drafter_model=drafter_model,
              cpu_profile=cpu_profile, cudagraph_max_tokens=cudagraph_max_tokens)
    kv = {a: b for a, b in kv.items() if b is not None}
    rates = parse_rates(acceptance_rates)
    if rates is not None:
        kv["acceptance_rates"] = rates
        kv["acceptance_length"] = None
        if k is None:
            kv["k"] = len(rates)
    elif acceptance_length is not None:
        kv["acceptance_length"] = acceptance_length
        kv["acceptance_rates"] = None
    if "k" in kv and acceptance_length is None and rates is None and cfg.acceptance_rates is None \
            and cfg.acceptance_length is not None and isinstance(cfg.k, int):
        # the preset's acceptance length was measured at its own k: keep its per-position rate
        from specrl.sim.costs.speculation import Acceptance

        acc = Acceptance.from_length(cfg.acceptance_length, cfg.k)
        if kv["k"] == "auto":
            kv["acceptance_ref_k"] = cfg.k
        elif isinstance(kv["k"], int) and kv["k"] >= 1:
            kv["acceptance_length"] = acc.length(kv["k"])
    cfg = cfg.with_(**kv)
    if hardware == "cpu" and cfg.efficiency == get_preset("paper-8b-rl-think").efficiency:
        cfg = replace(cfg, efficiency=cpu_efficiency())
    return cfg


@app.callback(invoke_without_command=True)
def main(ctx: typer.Context, preset: Preset = None, model: Model = None, hardware: Hw = None, gpus: Gpus = None,
         drafter: Drafter = None, k: K = None, acceptance_length: AL = None, acceptance_rates: Rates = None,
         mode: Mode = None, policy_lag: Lag = None, gen_gpu_fraction: Frac = None, precision: Prec = None,
         prompts_per_step: Prompts = None, generations_per_prompt: Gens = None, max_response_tokens: MaxTok = None,
         response_mean: RespMean = None, response_sigma: RespSigma = None, length_histogram: Hist = None,
         gpus_per_engine: PerEngine = None, drafter_model: DraftModel = None, cpu_profile: CpuProfile = None,
         cudagraph_max_tokens: CudaGraphs = None,
         from_run: Annotated[str | None, typer.Option("--from-run", help="runs/NAME/metrics.jsonl")] = None,
         prompt_tokens: Annotated[int, typer.Option("--prompt-tokens", help="--from-run prompt length")] = 120,
         threads: Annotated[int | None, typer.Option(
             "--threads", help="--from-run of a sync run: the cores it ran on (default: the cpu profile's)")] = None,
         json_out: Json = False) -> None:
    """Simulate one RL step with and without speculative decoding."""
    if ctx.invoked_subcommand is not None:
        return
    try:
        if from_run:
            from specrl.sim.calibration.fromrun import predict_run

            out = predict_run(from_run, cpu_profile=cpu_profile, prompt_tokens=prompt_tokens, threads=threads)
            if json_out:
                typer.echo(report.to_json({k2: v for k2, v in out.items() if k2 != "simulation"}))
            else:
                th = out["threads"]
                cores = (f"threads {th['generation']}" if out["config"]["mode"] == "sync" else
                         f"threads: workers {th['generation']}, learner {th['learner']}")
                typer.echo(f"{from_run}: medians over {out['steps_used']} steps ({out['lengths']} lengths), cpu "
                           f"profile, {cores}")
                typer.echo(report.format_from_run(out["rows"]))
                for note in out["notes"]:
                    typer.echo(f"note: {note}")
            return
        cfg = build_config(preset, model, hardware, gpus, drafter, k, acceptance_length, acceptance_rates, mode,
                           policy_lag, gen_gpu_fraction, precision, prompts_per_step, generations_per_prompt,
                           max_response_tokens, response_mean, response_sigma, length_histogram,
                           gpus_per_engine, drafter_model, cpu_profile, cudagraph_max_tokens)
        if gen_gpu_fraction is not None and cfg.mode == "sync":
            raise SpecRLError("--gen-gpu-fraction splits GPUs between generation and training in async mode; "
                              "in sync mode both use all GPUs, so it would be ignored: add --mode async or drop it")
        result = simulate(cfg)
    except SpecRLError as exc:
        _fail(exc)
    typer.echo(report.to_json(result) if json_out else report.format_result(result))


@app.command()
def sweep(preset: Preset = None, model: Model = None, hardware: Hw = None, gpus: Gpus = None,
          drafter: Drafter = None, k: K = None, acceptance_length: AL = None, acceptance_rates: Rates = None,
          mode: Mode = None, policy_lag: Lag = None, gen_gpu_fraction: Frac = None, precision: Prec = None,
          prompts_per_step: Prompts = None, generations_per_prompt: Gens = None, max_response_tokens: MaxTok = None,
          response_mean: RespMean = None, response_sigma: RespSigma = None, length_histogram: Hist = None,
          gpus_per_engine: PerEngine = None, drafter_model: DraftModel = None, cpu_profile: CpuProfile = None,
          cudagraph_max_tokens: CudaGraphs = None,
          out: Annotated[str, typer.Option("--out", help="directory for PNG + CSV")] = "sim_sweep",
          ks: Annotated[str, typer.Option("--ks", help="draft lengths")] = "1,2,3,4,5,6,7,8",
          als: Annotated[str, typer.Option("--als", help="acceptance lengths")] = "1,1.5,2,2.5,3,3.5,4,5,6,7,9",
          gpu_counts: Annotated[str | None, typer.Option("--gpu-counts", help="default: N/4..4N")] = None,
          lags: Annotated[str, typer.Option("--lags")] = "0,1,2,4",
          no_plots: Annotated[bool, typer.Option("--no-plots")] = False) -> None:
    """Heatmaps (k x acceptance length -> speedups) and curves (GPUs x policy lag) as PNG + CSV."""
    from specrl.sim.sweep import run_sweep

    try:
        cfg = build_config(preset, model, hardware, gpus, drafter, k, acceptance_length, acceptance_rates, mode,
                           policy_lag, gen_gpu_fraction, precision, prompts_per_step, generations_per_prompt,
                           max_response_tokens, response_mean, response_sigma, length_histogram,
                           gpus_per_engine, drafter_model, cpu_profile, cudagraph_max_tokens)
        if cfg.drafter == "none":
            raise SpecRLError("sweep varies k and acceptance length; pick a --drafter other than none")
        t0 = time.perf_counter()
        res = run_sweep(cfg, out, ks=parse_list("--ks", ks, int), als=parse_list("--als", als, float),
                        gpus=parse_list("--gpu-counts", gpu_counts, int) if gpu_counts else None,
                        lags=parse_list("--lags", lags, int), plots=not no_plots)
    except ValueError as exc:
        _fail(exc)
    typer.echo(f"{res['configs']} configurations in {time.perf_counter() - t0:.1f} s")
    for f in res["files"]:
        typer.echo(f"wrote {f}")


@app.command()
def advise(preset: Preset = None, model: Model = None, hardware: Hw = None, gpus: Gpus = None,
           drafter: Drafter = None, k: K = None, acceptance_length: AL = None, acceptance_rates: Rates = None,
           mode: Mode = None, policy_lag: Lag = None, gen_gpu_fraction: Frac = None, precision: Prec = None,
           prompts_per_step: Prompts = None, generations_per_prompt: Gens = None,
           max_response_tokens: MaxTok = None, response_mean: RespMean = None, response_sigma: RespSigma = None,
           length_histogram: Hist = None, gpus_per_engine: PerEngine = None, drafter_model: DraftModel = None,
           cpu_profile: CpuProfile = None, cudagraph_max_tokens: CudaGraphs = None,
           candidates: Annotated[str | None, typer.Option(
               "--candidates", help="DRAFTER:AL list, AL at k=3 (or the config's k), e.g. eagle3:2.77,ngram:1.9")]
           = None,
           sync_only: Annotated[bool, typer.Option("--sync-only", help="do not consider async")] = False,
           json_out: Json = False) -> None:
    """Best drafter / k / policy lag / GPU split for a model, cluster and workload, and the runner-up."""
    from specrl.sim.sweep import advise as run_advise
    from specrl.sim.sweep import format_advice

    try:
        cfg = build_config(preset, model, hardware, gpus, drafter, k, acceptance_length, acceptance_rates, mode,
                           policy_lag, gen_gpu_fraction, precision, prompts_per_step, generations_per_prompt,
                           max_response_tokens, response_mean, response_sigma, length_histogram,
                           gpus_per_engine, drafter_model, cpu_profile, cudagraph_max_tokens)
        res = run_advise(cfg, candidates, lags=() if sync_only else (0, 1, 2))
    except ValueError as exc:
        _fail(exc)
    typer.echo(report.to_json(res) if json_out else format_advice(res))


@app.command("profile-hardware")
def profile_hardware(
    out: Annotated[str | None, typer.Option("--out", help="default ~/.cache/specrl/hardware/cpu.json")] = None,
    quick: Annotated[bool, typer.Option("--quick", help="small sizes (seconds, noisier)")] = False,
) -> None:
    """Measure this machine's matmul FLOP/s and memory bandwidth into the `cpu` hardware profile."""
    from specrl.sim.costs.accelerators import default_cpu_profile_path, profile_cpu, save_profile

    prof = profile_cpu(matmul_size=256, bandwidth_mb=16, repeats=2) if quick else profile_cpu()
    path = save_profile(prof, out or default_cpu_profile_path())
    typer.echo(f"bf16 {prof['peak_flops']['bf16'] / 1e9:.1f} GFLOP/s, fp32 {prof['peak_flops']['fp32'] / 1e9:.1f} "
               f"GFLOP/s, GEMV bandwidth {prof['hbm_bandwidth'] / 1e9:.1f} GB/s, copy "
               f"{prof['copy_bandwidth'] / 1e9:.1f} GB/s")
    typer.echo(f"wrote {path}")


@app.command()
def fit(
    data: Annotated[str | None, typer.Option("--data", help="paper_8b.json-shaped stage tables")] = None,
    holdout: Annotated[str | None, typer.Option(
        "--holdout", help="WORKLOAD:ARM:STAGE,... left out of the fit, e.g. RL-Zero:spec:gen")] = None,
    write: Annotated[bool, typer.Option("--write", help="update specrl/sim/calibration/calibrated.py")] = False,
    max_nfev: Annotated[int, typer.Option("--max-evals")] = 60,
    from_run: Annotated[list[str] | None, typer.Option(
        "--from-run", help="fit CPU factors to a sync run (runs/NAME); twice: a short- then a long-sequence run")]
    = None,
    cpu_profile: CpuProfile = None,
    prompt_tokens: Annotated[int, typer.Option("--prompt-tokens", help="--from-run prompt length")] = 120,
    long_prompt_tokens: Annotated[int | None, typer.Option(
        "--long-prompt-tokens", help="prompt length of the second --from-run (default: --prompt-tokens)")] = None,
    json_out: Json = False,
) -> None:
    """Fit the efficiency factors to measured stage tables and print measured vs predicted per stage.

    With --from-run, fit the CPU efficiency factors to a real specrl run instead (used by --from-run).
    """
    from specrl.sim.calibration.calibrate import DEFAULT_DATA, write_calibration
    from specrl.sim.calibration.calibrate import fit as run_fit

    if from_run:
        from specrl.sim.calibration.calibrate import fit_cpu_efficiency

        try:
            out = fit_cpu_efficiency(list(from_run), cpu_profile=cpu_profile, prompt_tokens=prompt_tokens,
                                     long_prompt_tokens=long_prompt_tokens)
        except SpecRLError as exc:
            _fail(exc)
        eff = out["efficiency"].to_dict()
        if json_out:
            typer.echo(report.to_json({"efficiency": eff, "rows": out["rows"], "rows_long": out.get("rows_long"),
                                       "steps_used": out["steps_used"]}))
        else:
            typer.echo(f"CPU fit on {from_run[0]} (medians over {out['steps_used']} steps)")
            typer.echo(report.format_from_run(out["rows"]))
            if "rows_long" in out:
                typer.echo(f"and on {from_run[1]}")
                typer.echo(report.format_from_run(out["rows_long"]))
            typer.echo("efficiency: " + ", ".join(f"{k}={v:.4g}" for k, v in eff.items()))
        if write:
            src = " + ".join(str(p) for p in from_run)
            typer.echo(f"wrote {write_calibration(cpu=out['efficiency'], cpu_source=src)}", err=json_out)
        return
    try:
        res = run_fit(data or DEFAULT_DATA, tuple(h for h in (holdout or "").split(",") if h), max_nfev=max_nfev)
    except SpecRLError as exc:
        _fail(exc)
    typer.echo(report.to_json(res.to_dict()) if json_out else report.format_fit(res.to_dict()))
    if write:
        typer.echo(f"wrote {write_calibration(res)}", err=json_out)


if __name__ == "__main__":  # pragma: no cover
    app(sys.argv[1:])
