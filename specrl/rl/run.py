"""The run loop around `GRPOTrainer.step`: run directory, validation, checkpoints, resume, compare mode.

`train_main` is the entry point the `specrl train` CLI calls.

`setup_run` resolves the config (YAML + `--set`, or the saved config of a run being resumed) and the run
directory, and writes the resolved `config.yaml`. `run_training` drives the steps, evaluates held-out accuracy
(at step 0, every `grpo.val_every` steps and at the end), appends `metrics.jsonl` / `validation.jsonl` /
TensorBoard, writes atomic checkpoints, exports the final policy as a loadable checkpoint directory and writes
`report.md`. `run_compare` runs the same config autoregressively and speculatively with the same seeds,
interleaving their steps so machine noise hits both, checks seed-exact identity after every step, and writes
`compare.json` / `compare.md`.
"""

from __future__ import annotations

import json
import shutil
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from specrl.errors import SpecRLError
from specrl.rl.checkpoint import CheckpointError, load_latest, save_checkpoint
from specrl.rl.config import TrainConfig, load_config, validate_config
from specrl.rl.learner import NonFiniteError
from specrl.rl.metrics import MetricsWriter, ProgressDisplay, read_metrics
from specrl.rl.report import write_compare, write_report
from specrl.rl.trainer import GRPOTrainer, seed_everything

_ARTEFACTS = ("checkpoints", "tensorboard", "final", "metrics.jsonl", "validation.jsonl", "report.md",
              "reward.png", "stages.png", "acceptance.png", "config.yaml", "autoregressive", "speculative",
              "compare.json", "compare.md", "compare_reward.png", "timeline.jsonl", "timeline.png", "wandb", "mlruns")


def setup_run(config_path: str | None, sets: list[str], resume: str | None,
              out: str | None) -> tuple[TrainConfig, Path]:
    """Resolve config and run directory; write the resolved config.yaml."""
    if resume is not None:
        run_dir = Path(resume)
        saved = run_dir / "config.yaml"
        if not saved.is_file():
            raise SpecRLError(f"--resume {resume}: no config.yaml there; pass the directory of an earlier "
                              "`specrl train` run (it holds config.yaml, metrics.jsonl, checkpoints/)")
        if config_path is not None:
            print(f"[specrl] resuming: using {saved} (the run's resolved config); --config {config_path} is "
                  "not used", flush=True)
        cfg = load_config(saved, sets)
        if sets:
            saved.write_text(cfg.to_yaml())
        return cfg, run_dir
    cfg = load_config(config_path, sets)
    run_dir = Path(out) if out else Path(cfg.run.out_dir) / cfg.run.name
    existing = [a for a in _ARTEFACTS if (run_dir / a).exists() and a != "config.yaml"]
    if existing:
        if not cfg.run.overwrite:
            raise SpecRLError(
                f"run directory {run_dir} already holds a run ({', '.join(existing)}); use --resume {run_dir} "
                "to continue it, --out DIR (or run.name) for a new one, or --set run.overwrite=true to start over"
            )
        print(f"[specrl] run.overwrite=true: clearing {run_dir}", flush=True)
        for a in _ARTEFACTS:
            p = run_dir / a
            if p.is_dir():
                shutil.rmtree(p)
            elif p.exists():
                p.unlink()
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / "config.yaml").write_text(cfg.to_yaml())
    return cfg, run_dir


TrainerFactory = Callable[[TrainConfig, Path], Any]


def sync_trainer(cfg: TrainConfig, run_dir: Path) -> GRPOTrainer:
    if cfg.pipeline.mode != "sync":
        raise SpecRLError(f"pipeline.mode={cfg.pipeline.mode!r} runs on Ray (specrl.distributed); start it with "
                          "`specrl train`, or pass make_trainer=specrl.distributed.make_trainer")
    return GRPOTrainer.from_config(cfg)


def _due(step: int, every: int, last: int) -> bool:
    return step == last or (every > 0 and step % every == 0)


def _append_jsonl(path: Path, record: dict) -> None:
    with path.open("a") as f:
        f.write(json.dumps(record) + "\n")


def _keep_until(path: Path, step: int) -> None:
    recs = [r for r in read_metrics(path) if int(r.get("step", 0)) <= step]
    path.write_text("".join(json.dumps(r) + "\n" for r in recs))


class _Run:
    """One trainer plus its run directory, writers and checkpoint bookkeeping."""

    def __init__(self, cfg: TrainConfig, run_dir: Path, resume: bool, display: ProgressDisplay,
                 make_trainer: TrainerFactory | None = None):
        self.cfg, self.run_dir, self.display = cfg, run_dir, display
        seed_everything(cfg.run.seed)
        self.trainer = (make_trainer or sync_trainer)(cfg, run_dir)
        try:
            self._setup(resume)
        except BaseException:
            self.trainer.close()
            raise

    def _setup(self, resume: bool) -> None:
        cfg, run_dir, display = self.cfg, self.run_dir, self.display
        self.trainer.log = display.message
        self.ckpt_root = run_dir / "checkpoints"
        self.last_ckpt: Path | None = None
        start = None
        if resume:
            try:
                ck = load_latest(self.ckpt_root)
            except CheckpointError as e:
                raise SpecRLError(f"cannot resume {run_dir}: {e}") from None
            if ck is None:
                display.message(f"[specrl] {run_dir}: no checkpoint yet; starting from step 0")
            else:
                for s in ck.skipped:
                    display.message(f"[specrl] warning: skipping bad checkpoint: {s}")
                self.trainer.load_parts(ck.parts)
                self.last_ckpt, start = ck.path, ck.step
                display.message(f"[specrl] resumed {run_dir} from {ck.path.name} (step {ck.step})")
        self.val_path = run_dir / "validation.jsonl"
        if start is None and self.val_path.exists():
            self.val_path.unlink()
        elif start is not None:
            _keep_until(self.val_path, start)
        self.writer = MetricsWriter(run_dir, cfg.run.tensorboard, resume_step=start if resume else None,
                                    loggers=cfg.run.loggers, name=cfg.run.name, config=cfg.model_dump(mode="json"))

    def validate(self, step: int) -> dict[str, Any]:
        t = time.perf_counter()
        v = self.trainer.validate()
        v["val_seconds"] = time.perf_counter() - t
        _append_jsonl(self.val_path, {"step": step, **v})
        return v

    def after_step(self, rec: dict[str, Any], label: str = "") -> None:
        s, c = rec["step"], self.cfg
        if _due(s, c.grpo.val_every, c.run.steps):
            rec.update(self.validate(s))
        self.writer.write(rec)
        self.display.update(rec, label)
        if _due(s, c.run.checkpoint_every, c.run.steps):
            self.last_ckpt = save_checkpoint(self.ckpt_root, s, self.trainer.state_parts(),
                                             meta={"run": c.run.name, "model": c.model.name},
                                             keep=c.run.keep_checkpoints)

    def failed(self, e: NonFiniteError) -> SpecRLError:
        where = str(self.last_ckpt) if self.last_ckpt else "none (no checkpoint was written yet)"
        return SpecRLError(f"{e}. Training stopped; the last good checkpoint is {where} (resume with "
                           f"--resume {self.run_dir} after fixing the cause, e.g. a lower policy.learning_rate)")

    def finish(self) -> Path:
        self.writer.close()
        from specrl.model.checkpoint import save_checkpoint as save_model

        final = self.run_dir / "final"
        tmp = self.run_dir / ".final.tmp"
        shutil.rmtree(tmp, ignore_errors=True)
        self.trainer.save_final(tmp, save_model)
        shutil.rmtree(final, ignore_errors=True)
        tmp.rename(final)
        return write_report(self.run_dir, read_metrics(self.writer.path), self.cfg.to_yaml(),
                            extra={"final policy (load_model path)": f"`{final}`"},
                            validation=read_metrics(self.val_path))


def run_training(cfg: TrainConfig, run_dir: Path, resume: bool = False,
                 make_trainer: TrainerFactory | None = None) -> Path:
    """Train for cfg.run.steps (continuing from the newest good checkpoint when resuming). `make_trainer(cfg,
    run_dir)` builds the trainer (default: the sync `GRPOTrainer`; the CLI passes one that also knows async)."""
    display = ProgressDisplay(cfg.run.steps, cfg.run.progress, title=f"specrl train {cfg.run.name}")
    run = _Run(cfg, run_dir, resume, display, make_trainer)
    try:
        try:
            if run.trainer.step_count == 0:
                v = run.validate(0)
                display.message(f"[specrl] step 0 validation accuracy {v['accuracy']}")
            while run.trainer.step_count < cfg.run.steps:
                run.after_step(run.trainer.step())
        except NonFiniteError as e:
            run.writer.close()
            raise run.failed(e) from None
        finally:
            display.close()
        report = run.finish()
    finally:
        run.trainer.close()
    print(f"[specrl] done: {cfg.run.steps} steps; report: {report}", flush=True)
    return run_dir


def _weights_equal(a: torch.nn.Module, b: torch.nn.Module) -> bool:
    pb = dict(b.named_parameters())
    return all(torch.equal(p, pb[n]) for n, p in a.named_parameters())


def run_compare(cfg: TrainConfig, run_dir: Path) -> Path:
    """Same config twice — autoregressive and speculative — steps interleaved; write compare.json/.md."""
    if cfg.pipeline.mode != "sync":
        raise SpecRLError("--compare runs the sync pipeline twice; set pipeline.mode=sync (benchmarks/pipelines.py "
                          "compares sync and async)")
    if not cfg.speculative.enabled:
        raise SpecRLError("--compare needs speculative rollouts to compare against: set speculative.drafter "
                          "(e.g. ngram or eagle:default) and speculative.num_draft_tokens > 0 or 'auto'")
    data = cfg.model_dump(mode="json")
    data["speculative"]["drafter"] = "none"
    data["drafter"]["online"] = False
    ar_cfg = validate_config(data, "compare (autoregressive copy)")
    display = ProgressDisplay(cfg.run.steps, cfg.run.progress, live=False)
    runs = {"autoregressive": _Run(ar_cfg, run_dir / "autoregressive", False, display),
            "speculative": _Run(cfg, run_dir / "speculative", False, display)}
    for r in runs.values():
        (r.run_dir / "config.yaml").write_text(r.cfg.to_yaml())
        r.validate(0)
    exact = cfg.speculative.verify == "seed_exact"
    same_rollouts: list[bool] = []
    same_weights: list[bool] = []
    ar, sd = runs["autoregressive"], runs["speculative"]
    try:
        for _ in range(cfg.run.steps):
            for name, r in runs.items():
                r.after_step(r.trainer.step(), label="[ar]   " if name == "autoregressive" else "[spec] ")
            if exact:
                same_rollouts.append(ar.trainer.last_rollouts.responses == sd.trainer.last_rollouts.responses)
                same_weights.append(_weights_equal(ar.trainer.policy, sd.trainer.policy))
    except NonFiniteError as e:
        raise SpecRLError(f"compare run: {e}") from None
    for r in runs.values():
        r.finish()
    if exact:
        checks: dict[str, Any] = {
            "verify": "seed_exact", "rollouts_identical": all(same_rollouts), "weights_identical": all(same_weights),
            "rollouts_identical_per_step": same_rollouts, "weights_identical_per_step": same_weights,
        }
    else:
        checks = {"verify": cfg.speculative.verify, "rollouts_identical": None, "weights_identical": None,
                  "identity_note": "not checked: rejection sampling gives the same distribution, not the same "
                                   "tokens; use speculative.verify=seed_exact for token-identical rollouts"}
    jpath, mpath = write_compare(run_dir, read_metrics(ar.writer.path), read_metrics(sd.writer.path), checks)
    summary = json.loads(jpath.read_text())

    def f(v: Any) -> str:
        return "n/a" if v is None else f"{v:.2f}"

    print(f"[specrl] compare: gen speedup {f(summary['gen_speedup'])}x, step speedup "
          f"{f(summary['step_speedup'])}x, bound {f(summary['bound'])}x, gen share {f(summary['gen_share'])}; "
          f"report: {mpath}", flush=True)
    if exact and not (checks["rollouts_identical"] and checks["weights_identical"]):
        bad = next(i + 1 for i, (a, b) in enumerate(zip(same_rollouts, same_weights, strict=True)) if not (a and b))
        raise SpecRLError(f"seed_exact compare: the autoregressive and speculative runs diverged at step {bad} "
                          f"(rollouts identical: {same_rollouts[bad - 1]}, weights identical: "
                          f"{same_weights[bad - 1]}); see {mpath}")
    return run_dir


def train_main(config_path: str | None, sets: list[str] | None = None, resume: str | None = None,
               out: str | None = None, compare: bool = False, make_trainer: TrainerFactory | None = None) -> Path:
    """Entry point of `specrl train`: returns the run directory (which holds report.md or compare.md)."""
    if compare:
        if resume:
            raise SpecRLError("--compare and --resume cannot be combined; compare runs start from scratch")
        cfg, run_dir = setup_run(config_path, sets or [], None, out)
        return run_compare(cfg, run_dir)
    cfg, run_dir = setup_run(config_path, sets or [], resume, out)
    return run_training(cfg, run_dir, resume=resume is not None, make_trainer=make_trainer)
