"""Predicting a real specrl run (`specrl simulate --from-run runs/NAME/metrics.jsonl`).

Reads the trainer's `metrics.jsonl` (one JSON per step: `stage_seconds`, `response_length_mean`,
`acceptance_length`, `num_draft_tokens_mean`, ...) and the run's `config.yaml` (`grpo.num_prompts_per_step`,
`grpo.num_generations`, `generation.max_new_tokens`, `generation.max_batch_size`, `model.name`,
`speculative.drafter`), builds the matching simulator config on the measured `cpu` profile and the CPU
efficiency factors, and returns predicted vs measured seconds per stage (medians over the steps after the
first, which carries warm-up) with the relative error. Fitting the CPU efficiency factors to such runs is
`specrl.sim.calibration.calibrate.fit_cpu_efficiency`.
"""

from __future__ import annotations

import json
import statistics
from dataclasses import replace
from pathlib import Path

import numpy as np

from specrl.errors import SpecRLError
from specrl.observability.step_record import StepRecord, read_records
from specrl.rollout.drafter_spec import DRAFTER_KINDS, parse_drafter_spec
from specrl.sim.calibration.calibrated import CALIBRATION
from specrl.sim.costs.models import CATALOG_CONFIGS
from specrl.sim.costs.roofline import Efficiency
from specrl.sim.pipeline import STAGES, SimConfig, config_dict, simulate
from specrl.sim.workload import Workload

EAGLE_TTT_STEPS = 3  # specrl.drafters.training.offline.TTT_STEPS: unrolled steps per drafter update


def cpu_efficiency() -> Efficiency:
    return Efficiency.from_dict(CALIBRATION.get("cpu_efficiency", {"bw_eff": 1.0, "flops_eff": 1.0}))


def metrics_file(path: str | Path) -> Path:
    """--from-run accepts runs/NAME/metrics.jsonl or the run directory runs/NAME itself."""
    p = Path(path)
    if p.is_dir():
        if not (p / "metrics.jsonl").is_file():
            raise SpecRLError(f"{p} is a directory without metrics.jsonl; pass the directory of a specrl training "
                              "run (runs/NAME) or its metrics.jsonl")
        return p / "metrics.jsonl"
    return p


def _read_text(p: Path) -> str:
    try:
        return p.read_text(encoding="utf-8")
    except UnicodeDecodeError as e:
        raise SpecRLError(f"{p} is not UTF-8 text (byte {e.object[e.start]:#04x} at offset {e.start}); pass the "
                          "files a specrl training run wrote") from None


# what the simulator reads of each step record
RUN_FIELDS = ("stage_seconds", "response_length_mean")


def run_records(path: str | Path) -> list[StepRecord]:
    """A finished run's step records (runs/NAME or its metrics.jsonl), strictly: errors name the file and line."""
    return read_records(metrics_file(path), strict=True, require=RUN_FIELDS)


def read_run_config(run_dir: Path) -> dict:
    import yaml

    p = run_dir / "config.yaml"
    if not p.exists():
        raise SpecRLError(f"{p} does not exist; --from-run needs the run directory's config.yaml beside "
                          "metrics.jsonl")
    try:
        cfg = yaml.safe_load(_read_text(p)) or {}
    except yaml.YAMLError as exc:
        raise SpecRLError(f"{p}: malformed YAML ({exc})") from exc
    return cfg


def _get(cfg: dict, dotted: str, default=None):
    cur = cfg
    for part in dotted.split("."):
        if not isinstance(cur, dict) or part not in cur:
            if default is None:
                raise SpecRLError(f"run config lacks {dotted!r}")
            return default
        cur = cur[part]
    return cur


def _int(cfg: dict, dotted: str, default: int | None = None, minimum: int = 1) -> int:
    v = _get(cfg, dotted, default)
    if isinstance(v, bool) or not isinstance(v, int) or v < minimum:
        raise SpecRLError(f"run config {dotted}={v!r} must be an integer >= {minimum}")
    return v


def recorded_threads(records: list[StepRecord], where: str = "metrics.jsonl") -> list[int] | None:
    """Each step's `torch_threads` (the cores a sync run's torch used, re-read by its governor before every step),
    or None when the run did not record it (runs before the field existed)."""
    vals = [r.torch_threads for r in records]
    if all(v is None for v in vals):
        return None
    bad = [(i, v) for i, v in enumerate(vals) if isinstance(v, bool) or not isinstance(v, int) or v < 1]
    if bad:
        i, v = bad[0]
        raise SpecRLError(f"{where}: step {records[i].step} has torch_threads={v!r}; expected an "
                          "integer >= 1 in every step (a specrl run records it in all steps or in none)")
    return vals


def config_for_run(run_cfg: dict, records: list[StepRecord], cpu_profile: str | None = None,
                   efficiency: Efficiency | None = None, length_sigma: float = 0.5,
                   prompt_tokens: int = 120, threads: int | None = None) -> SimConfig:
    model = _get(run_cfg, "model.name", "smollm2-135m") if isinstance(run_cfg.get("model"), dict) \
        else run_cfg.get("model", "smollm2-135m")
    if model not in CATALOG_CONFIGS and not Path(str(model)).exists():
        raise SpecRLError(f"run model {model!r} is neither a catalog model nor a checkpoint path")
    drafter_raw = str(_get(run_cfg, "speculative.drafter", "none"))
    known = sorted(k.name for k in DRAFTER_KINDS.values() if k.sim is not None)
    try:  # a hybrid is priced as its learned part (the suffix lookups cost no forward)
        spec = parse_drafter_spec(drafter_raw).learned_part
    except SpecRLError as e:
        raise SpecRLError(f"run drafter {drafter_raw!r} has no simulator equivalent ({e}); known: {known}") from None
    arg, drafter = spec.arg, spec.info.sim
    if drafter is None:
        raise SpecRLError(f"run drafter {drafter_raw!r} has no simulator equivalent; known: {known}")
    steady = records[1:] or records
    al = statistics.median(float(r.acceptance_length or 1.0) for r in steady)
    k_mean = statistics.median(float(r.num_draft_tokens_mean or 0.0) for r in steady)
    mean_len = statistics.median(float(r.response_length_mean) for r in steady)
    k = max(1, round(k_mean)) if drafter != "none" else 3
    if drafter != "none":
        al = min(max(al, 1.0), k + 1.0)
    rollout_dtype = str(_get(run_cfg, "model.rollout_dtype", "bfloat16"))
    train_dtype = str(_get(run_cfg, "model.dtype", "float32"))
    if str(_get(run_cfg, "policy.precision", "fp32")).startswith("bf16"):
        train_dtype = "bfloat16"  # bf16 autocast over fp32 master weights
    prec = {"bfloat16": "bf16", "float32": "fp32"}
    # the run's own response lengths when it recorded them (pooled over the steady steps), else a log-normal
    sample = [float(x) for r in steady for x in (r.response_lengths or [])]
    have_all = sample and all(r.response_lengths for r in steady)
    wl = Workload(prompts_per_step=_int(run_cfg, "grpo.num_prompts_per_step"),
                  generations_per_prompt=_int(run_cfg, "grpo.num_generations"),
                  max_response_tokens=_int(run_cfg, "generation.max_new_tokens"),
                  prompt_tokens=prompt_tokens,
                  response_mean=max(mean_len, 1.0), response_sigma=length_sigma,
                  length_sample=tuple(max(1.0, x) for x in sample) if have_all else None)
    mode, pipe = pipeline_layout(run_cfg)
    rec_threads = recorded_threads(steady) if mode == "sync" else None
    if threads is not None:  # a sync run that did not record torch_threads: the caller states its cores
        if mode != "sync":
            raise SpecRLError("--threads applies to a sync run; an async run's cores are its pipeline.worker_threads "
                              "and learner_threads (read from its config.yaml)")
        if isinstance(threads, bool) or not isinstance(threads, int) or threads < 1:
            raise SpecRLError(f"--threads {threads!r} must be an integer >= 1 (the cores the sync run had)")
        pipe["cpu_threads"] = threads  # overrides a recorded torch_threads (predict_run notes it)
    elif rec_threads is not None:
        pipe["cpu_threads"] = int(round(statistics.median(rec_threads)))
    online = bool(_get(run_cfg, "drafter.online", False)) and drafter != "none"
    updates = statistics.median(float(r.draft_updates or 0) for r in steady) if online else 0.0
    # a run with adaptive k is simulated with the simulator's own adaptive policy, acceptance measured at ~k_mean
    auto = str(_get(run_cfg, "speculative.num_draft_tokens", 3)) == "auto"
    draft_vocab = eagle_draft_vocab(arg) if drafter == "eagle3" else None
    return SimConfig(draft_vocab=draft_vocab,model=str(model), hardware="cpu", drafter=drafter, k="auto" if auto else k,
                     acceptance_ref_k=k,
                     acceptance_length=al if drafter != "none" else None,
                     drafter_model=arg if drafter == "draft-model" else "qwen3-0.6b",
                     drafter_trained_online=online, drafter_train_passes=EAGLE_TTT_STEPS * max(updates, 1.0),
                     precision=prec.get(rollout_dtype, "bf16"),
                     train_precision=prec.get(train_dtype, "fp32"),
                     max_num_seqs=int(_get(run_cfg, "generation.max_batch_size", 64)),
                     train_micro_batch=int(_get(run_cfg, "policy.train_micro_batch_size", 16)),
                     logprob_forward=not all(r.logprob_skipped for r in steady),
                     workload=wl, efficiency=efficiency or cpu_efficiency(), cpu_profile=cpu_profile, **pipe)


def eagle_draft_vocab(arg: str) -> int | None:
    """The draft vocabulary of the run's EAGLE head (`eagle:default`, `eagle:think` or `eagle:DIR`), read from the
    drafter's config.json when it is on this machine; None (the simulator's 32k default) when it is not."""
    from specrl.drafters import EMBEDDED_NAMES, default_drafter_dir

    try:
        d = default_drafter_dir("eagle", arg or "default") if (arg or "default") in EMBEDDED_NAMES else Path(arg)
        cfg = json.loads((d / "config.json").read_text())
        return int(cfg["draft_vocab_size"]) if cfg.get("draft_vocab_size") else int(cfg["vocab_size"])
    except (OSError, ValueError, KeyError, TypeError, SpecRLError):
        return None


def pipeline_layout(run_cfg: dict) -> tuple[str, dict]:
    """(mode, SimConfig fields) of a run's pipeline on this CPU.

    sync: one device with the cores the run's torch had (`torch_threads` in its metrics.jsonl when recorded,
    else --threads, else the cores the profile was measured with).
    async: each rollout worker owns `worker_threads` cores and the learner `learner_threads` (config.yaml), so
    the simulator sees num_rollout_workers generation devices and one training device of those sizes (peaks and
    bandwidth scaled from the profile), overlapped within max_trajectory_age_steps.
    """
    mode = str(_get(run_cfg, "pipeline.mode", "sync"))
    if mode == "sync":
        return mode, {"mode": "sync", "gpus": 1}
    if mode != "async":
        raise SpecRLError(f"run pipeline.mode {mode!r} is neither sync nor async")
    workers = _int(run_cfg, "pipeline.num_rollout_workers", 1)
    wt = _int(run_cfg, "pipeline.worker_threads", 1)
    lt = _int(run_cfg, "pipeline.learner_threads", 1)
    lag = _int(run_cfg, "pipeline.max_trajectory_age_steps", 1, minimum=0)
    # specrl's worker generates one step's batch at a time (no run-ahead across steps)
    return mode, {"mode": "async", "gpus": workers + 1, "gen_gpu_fraction": workers / (workers + 1),
                  "policy_lag": lag, "cpu_threads": wt, "learner_cpu_threads": lt if lt != wt else None,
                  "async_run_ahead": False}


def prepare_hw(cfg: SimConfig):
    from specrl.sim.costs.accelerators import get_hardware

    return get_hardware(cfg.hardware, cfg.cpu_profile)


def step_configs(cfg: SimConfig, records: list[StepRecord], threads_given: bool = False) -> list[SimConfig] | None:
    """One config per recorded step — its own response lengths in rollout order and, for a sync run that
    recorded them, its own torch_threads — when every step recorded all of its rollouts' lengths; else None.

    A step's logprob/train cost is not linear in its lengths (micro-batches pad to their longest sequence,
    attention grows as L²) and its generation is set by its longest response, so the median of measured steps
    is compared with the median of per-step predictions, not with one step made of the pooled lengths' quantiles.
    """
    n = cfg.workload.rollouts
    if not records or not all(len(r.response_lengths or []) == n for r in records):
        return None
    threads = recorded_threads(records) if cfg.mode == "sync" and not threads_given else None
    out = []
    for i, r in enumerate(records):
        lens = [float(x) for x in r.response_lengths]
        wl = replace(cfg.workload, length_sample=tuple(max(1.0, x) for x in lens), length_in_order=True,
                     response_mean=max(float(np.mean(lens)), 1.0))
        c = replace(cfg, workload=wl)
        if threads is not None:  # the governor's count for this step
            c = replace(c, cpu_threads=threads[i])
        out.append(c)
    return out


def predict_run(metrics_path: str | Path, cpu_profile: str | None = None,
                efficiency: Efficiency | None = None, prompt_tokens: int = 120, threads: int | None = None) -> dict:
    """Predicted vs measured stage medians of a run (steps after the first). With every step's response lengths
    recorded, each step is simulated on its own rollouts and the prediction is the median over steps
    (`lengths: "per step"`); otherwise one step of the pooled lengths (or a log-normal) is (`"pooled"`)."""
    metrics_path = metrics_file(metrics_path)
    records = run_records(metrics_path)
    run_cfg = read_run_config(metrics_path.parent)
    cfg = config_for_run(run_cfg, records, cpu_profile, efficiency, prompt_tokens=prompt_tokens, threads=threads)
    steady = records[1:] or records
    arm_name = "spec" if cfg.drafter != "none" else "ar"
    per_step = step_configs(cfg, steady, threads_given=threads is not None)
    result = simulate(cfg)
    notes = []
    rec_threads = recorded_threads(steady) if cfg.mode == "sync" else None
    if threads is not None and rec_threads is not None and set(rec_threads) != {threads}:
        notes.append(f"--threads {threads} overrides the run's recorded torch_threads {sorted(set(rec_threads))} "
                     "(on a shared machine torch can get fewer cores than it has threads)")
    if cfg.mode == "sync" and threads is None and rec_threads is None:
        notes.append("the run did not record torch_threads: simulated on the profile's thread count "
                     "(pass --threads N if it had fewer cores)")
    hw = prepare_hw(cfg)
    sizes = [t for t in (cfg.cpu_threads, cfg.learner_cpu_threads) if t]
    if cfg.efficiency.mfu_attention and hw.bandwidth_1thread <= 0 and sizes and min(sizes) < hw.threads:
        notes.append(f"cpu profile has no one-thread bandwidth (hbm_bandwidth_1thread): a device of fewer cores "
                     f"than its {hw.threads} streams its linear share, so the trainer's bandwidth-bound attention "
                     "is priced as slowing by the core ratio; re-measure with `specrl simulate profile-hardware`")
    sims = [simulate(c) for c in per_step] if per_step else [result]
    arms = [x[arm_name] for x in sims]
    asynchronous = cfg.mode == "async"

    def med(get) -> float:
        return statistics.median(float(get(r) or 0.0) for r in steady)

    def pmed(get) -> float:
        return statistics.median(float(get(a)) for a in arms)

    rows = []

    def row(stage: str, measured: float, pred: float) -> None:
        rows.append({"stage": stage, "measured": measured, "predicted": float(pred),
                     "error": (pred - measured) / measured if measured > 0 else float("nan")})

    for s in STAGES:
        if asynchronous and s == "gen":  # the workers' generation time; the learner's "gen" is its wait
            measured = med(lambda r: r.async_fields.gen_seconds_workers if r.async_fields else None)
        elif asynchronous and s == "prepare":  # the worker's weight refit (the learner's publish is in its step)
            measured = med(lambda r: r.async_fields.refit_seconds if r.async_fields else None)
        else:
            measured = med(lambda r, s=s: r.stage_seconds.get(s, 0.0))
        row(s, measured, pmed(lambda a, s=s: a["stages"][s]))
    row("exposed gen", med(lambda r: r.async_fields.exposed_gen_seconds if r.async_fields
                           else r.stage_seconds.get("gen")),
        pmed(lambda a: a["exposed_gen_seconds"]))
    row("step", med(lambda r: r.step_seconds or sum(r.stage_seconds.values())),
        pmed(lambda a: a["step_seconds"]))
    threads_used = sorted({c.cpu_threads or hw.threads for c in (per_step or [cfg])})
    return {"rows": rows, "config": config_dict(cfg), "steps_used": len(steady), "simulation": result,
            "notes": notes,
            "lengths": "per step" if per_step else "pooled",
            "threads": {"generation": threads_used if len(threads_used) > 1 else threads_used[0],
                        "learner": cfg.learner_cpu_threads or cfg.cpu_threads or hw.threads},
            "per_step": [{"step": r.step, "stages": a["stages"], "step_seconds": a["step_seconds"]}
                         for r, a in zip(steady, arms, strict=False)] if per_step else None}
