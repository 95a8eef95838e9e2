"""Predicting a real specrl run (`specrl simulate --from-run runs/NAME/metrics.jsonl`).

Reads the trainer's `metrics.jsonl` (one JSON per step: `stage_seconds`, `response_length_mean`,
`acceptance_length`, `num_draft_tokens_mean`, ...) and the run's `config.yaml` (`grpo.num_prompts_per_step`,
`grpo.num_generations`, `generation.max_new_tokens`, `generation.max_batch_size`, `model.name`,
`speculative.drafter`), builds the matching simulator config on the measured `cpu` profile and the CPU
efficiency factors, and returns predicted vs measured seconds per stage (medians over the steps after the
first, which carries warm-up) with the relative error.
"""

from __future__ import annotations

import json
import statistics
from pathlib import Path

from specrl.errors import SpecRLError
from specrl.sim.calibrated import CALIBRATION
from specrl.sim.models import CATALOG_CONFIGS
from specrl.sim.pipeline import STAGES, SimConfig, config_dict, simulate
from specrl.sim.roofline import Efficiency
from specrl.sim.workload import Workload

DRAFTER_KINDS = {"none": "none", "ngram": "ngram", "suffix": "ngram", "eagle": "eagle3", "mtp": "mtp",
                 "draft-model": "draft-model"}


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


def read_metrics(path: str | Path) -> list[dict]:
    p = metrics_file(path)
    if not p.exists():
        raise SpecRLError(f"{p} does not exist; pass runs/NAME/metrics.jsonl of a specrl training run")
    rows = []
    for i, line in enumerate(_read_text(p).splitlines(), 1):
        if not line.strip():
            continue
        try:
            r = json.loads(line)
        except json.JSONDecodeError as exc:
            raise SpecRLError(f"{p}:{i}: not a JSON line ({exc})") from exc
        missing = [k for k in ("stage_seconds", "response_length_mean") if k not in r]
        if missing:
            raise SpecRLError(f"{p}:{i}: step record lacks {missing}; expected specrl trainer metrics")
        rows.append(r)
    if not rows:
        raise SpecRLError(f"{p} has no step records")
    return rows


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


def config_for_run(run_cfg: dict, records: list[dict], cpu_profile: str | None = None,
                   efficiency: Efficiency | None = None, length_sigma: float = 0.5,
                   prompt_tokens: int = 120) -> SimConfig:
    model = _get(run_cfg, "model.name", "smollm2-135m") if isinstance(run_cfg.get("model"), dict) \
        else run_cfg.get("model", "smollm2-135m")
    if model not in CATALOG_CONFIGS and not Path(str(model)).exists():
        raise SpecRLError(f"run model {model!r} is neither a catalog model nor a checkpoint path")
    drafter_raw = str(_get(run_cfg, "speculative.drafter", "none"))
    kind, _, arg = drafter_raw.partition(":")
    if kind == "hybrid":  # priced as its learned part (the suffix lookups cost no forward)
        kind, _, arg = arg.partition(":")
    drafter = DRAFTER_KINDS.get(kind)
    if drafter is None:
        raise SpecRLError(f"run drafter {drafter_raw!r} has no simulator equivalent; known: {sorted(DRAFTER_KINDS)}")
    steady = records[1:] or records
    al = statistics.median(float(r.get("acceptance_length") or 1.0) for r in steady)
    k_mean = statistics.median(float(r.get("num_draft_tokens_mean") or 0.0) for r in steady)
    mean_len = statistics.median(float(r["response_length_mean"]) for r in steady)
    k = max(1, round(k_mean)) if drafter != "none" else 3
    if drafter != "none":
        al = min(max(al, 1.0), k + 1.0)
    rollout_dtype = str(_get(run_cfg, "model.rollout_dtype", "bfloat16"))
    train_dtype = str(_get(run_cfg, "model.dtype", "float32"))
    if str(_get(run_cfg, "policy.precision", "fp32")).startswith("bf16"):
        train_dtype = "bfloat16"  # bf16 autocast over fp32 master weights
    prec = {"bfloat16": "bf16", "float32": "fp32"}
    wl = Workload(prompts_per_step=int(_get(run_cfg, "grpo.num_prompts_per_step")),
                  generations_per_prompt=int(_get(run_cfg, "grpo.num_generations")),
                  max_response_tokens=int(_get(run_cfg, "generation.max_new_tokens")),
                  prompt_tokens=prompt_tokens,
                  response_mean=max(mean_len, 1.0), response_sigma=length_sigma)
    # a run with adaptive k is simulated with the simulator's own adaptive policy, acceptance measured at ~k_mean
    auto = str(_get(run_cfg, "speculative.num_draft_tokens", 3)) == "auto"
    return SimConfig(model=str(model), hardware="cpu", gpus=1, drafter=drafter, k="auto" if auto else k,
                     acceptance_ref_k=k,
                     acceptance_length=al if drafter != "none" else None,
                     drafter_model=arg if drafter == "draft-model" else "qwen3-0.6b",
                     mode="sync", precision=prec.get(rollout_dtype, "bf16"),
                     train_precision=prec.get(train_dtype, "fp32"),
                     max_num_seqs=int(_get(run_cfg, "generation.max_batch_size", 64)),
                     workload=wl, efficiency=efficiency or cpu_efficiency(), cpu_profile=cpu_profile)


def predict_run(metrics_path: str | Path, cpu_profile: str | None = None,
                efficiency: Efficiency | None = None, prompt_tokens: int = 120) -> dict:
    metrics_path = metrics_file(metrics_path)
    records = read_metrics(metrics_path)
    run_cfg = read_run_config(metrics_path.parent)
    cfg = config_for_run(run_cfg, records, cpu_profile, efficiency, prompt_tokens=prompt_tokens)
    result = simulate(cfg)
    arm = result["spec"] if cfg.drafter != "none" else result["ar"]
    steady = records[1:] or records
    rows = []
    for s in STAGES:
        measured = statistics.median(float(r["stage_seconds"].get(s, 0.0)) for r in steady)
        pred = float(arm["stages"][s])
        rows.append({"stage": s, "measured": measured, "predicted": pred,
                     "error": (pred - measured) / measured if measured > 0 else float("nan")})
    measured_step = statistics.median(float(r.get("step_seconds") or sum(r["stage_seconds"].values()))
                                      for r in steady)
    rows.append({"stage": "step", "measured": measured_step, "predicted": float(arm["step_seconds"]),
                 "error": (arm["step_seconds"] - measured_step) / measured_step})
    return {"rows": rows, "config": config_dict(cfg), "steps_used": len(steady), "simulation": result}


def fit_cpu_efficiency(metrics_path: str | Path, cpu_profile: str | None = None, prompt_tokens: int = 120) -> dict:
    """Fit the CPU efficiency factors to one run's median stage times (all closed form or 1-D linear).

    data and prepare fixed costs are the measured medians (minus the weight-copy bytes term), logprob/train
    MFU are predicted-at-MFU-1 / measured, and the per-forward overhead solves the generation time, which is
    linear in it. Returns {"efficiency": Efficiency, "rows": predicted vs measured after the fit}.
    """
    from dataclasses import replace

    metrics_path = metrics_file(metrics_path)
    records = read_metrics(metrics_path)
    run_cfg = read_run_config(metrics_path.parent)
    # keep the decode factors the engine-fidelity benchmark fitted (matmul efficiency, per-sequence host cost)
    prior = cpu_efficiency()
    unit = Efficiency(bw_eff=1.0, flops_eff=prior.flops_eff, step_overhead_s=0.0, draft_overhead_s=0.0,
                      ngram_overhead_s=0.0, spec_seq_overhead_s=prior.spec_seq_overhead_s,
                      mfu_logprob=1.0, mfu_train=1.0, prepare_fixed_s=0.0, data_s=0.0)
    cfg = config_for_run(run_cfg, records, cpu_profile, unit, prompt_tokens=prompt_tokens)
    steady = records[1:] or records
    meas = {s: statistics.median(float(r["stage_seconds"].get(s, 0.0)) for r in steady) for s in STAGES}
    arm = "spec" if cfg.drafter != "none" else "ar"
    r0 = simulate(cfg)[arm]["stages"]
    r1 = simulate(replace(cfg, efficiency=replace(unit, step_overhead_s=1e-3, draft_overhead_s=1e-3)))[arm]["stages"]
    slope = (r1["gen"] - r0["gen"]) / 1e-3
    overhead = max(0.0, (meas["gen"] - r0["gen"]) / slope) if slope > 0 else 0.0
    eff = replace(unit, data_s=meas["data"], prepare_fixed_s=max(0.0, meas["prepare"] - r0["prepare"]),
                  mfu_logprob=min(1.0, r0["logprob"] / meas["logprob"]) if meas["logprob"] > 0 else 1.0,
                  mfu_train=min(1.0, r0["train"] / meas["train"]) if meas["train"] > 0 else 1.0,
                  step_overhead_s=overhead, draft_overhead_s=overhead)
    return {"efficiency": eff, "steps_used": len(steady),
            "rows": predict_run(metrics_path, cpu_profile, eff, prompt_tokens)["rows"]}
