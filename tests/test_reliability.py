"""Every bad input a clear error, every fault survived (tiny models, no GPU).

One test (or a parametrised group) per case: the run-directory lock, inputs plain YAML or pydantic would accept
silently, inputs that would otherwise end in a traceback, `run.overwrite` on a killed run, interrupted
writes (checkpoint on a full disk, stale build directories) and SIGINT/SIGTERM during a step.
"""

import errno
import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
import yaml
from safetensors.torch import load_file, save_file
from typer.testing import CliRunner

from specrl.checkpoint import store as ckpt_mod
from specrl.checkpoint.sharded_state import DCP_PART, read_model_tensors
from specrl.drafters.storage import default as default_drafter
from specrl.errors import SpecRLError
from specrl.observability.metrics import read_jsonl
from specrl.run.loop import LOCK_FILE, RunInterrupted, RunLock, _StopSignals, release_run, setup_run, train_main
from specrl.trainer.config_check import load_config
from specrl.trainer.learner import Learner
from tests.test_rl_trainer import cfg_dict as trainer_cfg
from tests.test_rl_trainer import write_cfg
from tests.tiny import make_tiny_checkpoint

ROOT = Path(__file__).resolve().parents[1]
runner = CliRunner()


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> Path:
    return make_tiny_checkpoint(tmp_path_factory.mktemp("tiny") / "ckpt", seed=0)


def cfg_dict(tiny: Path, **over) -> dict:
    """tests/test_rl_trainer.py's tiny config, without periodic validation."""
    return trainer_cfg(tiny, **{"grpo__val_every": 0, **over})


def dead_pid() -> int:
    p = subprocess.Popen([sys.executable, "-c", "pass"])
    p.wait()
    return p.pid


def steps(run_dir: Path) -> list[int]:
    return [r["step"] for r in read_jsonl(run_dir / "metrics.jsonl")]


# ----------------------------------------------------------------------------- (1) two runs, one directory


def test_second_run_into_a_locked_directory_refuses_naming_the_pid(tiny, tmp_path):
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    (run_dir / "metrics.jsonl").write_text('{"step": 1}\n')
    (run_dir / "final").mkdir()  # a finished run that overwrite=true would clear
    code = (f"import sys, time; sys.path.insert(0, {str(ROOT)!r}); from specrl.run.loop import RunLock; "
            f"RunLock.acquire({str(run_dir)!r}); print('locked', flush=True); time.sleep(60)")
    holder = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "locked"
        cfg = write_cfg(tmp_path / "c.yaml", cfg_dict(tiny, run__overwrite=True))
        with pytest.raises(SpecRLError, match=rf"specrl train.*PID {holder.pid}\b.*--out"):
            train_main(str(cfg), [], None, str(run_dir), False)
        # nothing of the first run was touched
        assert (run_dir / "metrics.jsonl").read_text() == '{"step": 1}\n' and (run_dir / "final").is_dir()
        assert not (run_dir / "config.yaml").exists()
        (run_dir / "config.yaml").write_text(load_config(cfg).to_yaml())
        with pytest.raises(SpecRLError, match=rf"PID {holder.pid}"):  # --resume refuses too
            train_main(None, ["run.steps=5"], str(run_dir), None, False)
        assert yaml.safe_load((run_dir / "config.yaml").read_text())["run"]["steps"] == 3
    finally:
        holder.kill()
        holder.wait()
    # the holder died (kill -9 drops its flock): the lock is stale and the next run takes it over
    lock = RunLock.acquire(run_dir)
    assert (run_dir / LOCK_FILE).read_text().split()[0] == str(os.getpid())
    release_run(run_dir)
    assert lock.depth == 0 and not (run_dir / LOCK_FILE).exists()


def test_stale_lock_of_a_dead_pid_is_taken_over_with_a_message(tmp_path, capfd):
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    pid = dead_pid()
    (run_dir / LOCK_FILE).write_text(f"{pid} {os.uname().nodename}\n")
    RunLock.acquire(run_dir)
    try:
        err = capfd.readouterr().err
        assert f"locked by PID {pid}" in err and "a stopped run" in err and "taking over" in err
        RunLock.acquire(run_dir)  # re-entrant in one process
        release_run(run_dir)
        assert (run_dir / LOCK_FILE).exists()
    finally:
        release_run(run_dir)
    assert not (run_dir / LOCK_FILE).exists()


# ----------------------------------------------------------------------------- (2) inputs refused with a clear error


@pytest.mark.parametrize("text, match", [
    ("", "is empty.*every default"),
    ("# only a comment\n", "is empty"),
    ("run:\n  steps: 3\n  steps: 4\n", r"key 'steps' is given twice.*lines 2 and 3"),
    ("policy:\n  learning_rate: .inf\n", r"policy.learning_rate: Input should be a finite number, got inf"),
    ("policy:\n  learning_rate: .nan\n", r"policy.learning_rate: .*got nan"),
    ("drafter:\n  learning_rate: .inf\n", r"drafter.learning_rate: Input should be a finite number"),
    ("grpo:\n  clip_high: .nan\n", r"grpo.clip_high: Input should be a finite number"),
    ("policy:\n  adam_betas: [0.9, .inf]\n", r"policy.adam_betas.1: Input should be a finite number"),
])
def test_config_files_plain_yaml_would_accept_are_refused(tmp_path, text, match):
    p = tmp_path / "c.yaml"
    p.write_text(text)
    with pytest.raises(SpecRLError, match=match):
        load_config(p)


def test_nonfinite_override_and_unreadable_config(tmp_path):
    with pytest.raises(SpecRLError, match=r"learning_rate:.*finite number"):
        load_config(None, ["policy.learning_rate=.inf"])
    bad = tmp_path / "latin1.yaml"
    bad.write_bytes("run:\n  name: caf\xe9\n".encode("latin-1"))
    with pytest.raises(SpecRLError, match=r"UTF-8.*0xe9.*offset 16"):
        load_config(bad)
    (tmp_path / "a.yaml").write_text("run: {steps: 1}\n")
    with pytest.raises(SpecRLError, match=r"directory.*a\.yaml"):
        load_config(tmp_path)


def test_nonfinite_weights_after_an_update_are_never_checkpointed(tiny, tmp_path, monkeypatch):
    real = Learner.stage_train

    def poisoned(self, batch, capture=None):
        out = real(self, batch, capture)
        if self.step_count + 1 == 2:
            with torch.no_grad():
                self.policy.norm.weight[0] = float("nan")
        return out

    monkeypatch.setattr(Learner, "stage_train", poisoned)
    cfg = write_cfg(tmp_path / "c.yaml", cfg_dict(tiny))
    with pytest.raises(SpecRLError, match=r"'norm\.weight'.*NaN/inf.*step_000001") as e:
        train_main(str(cfg), [], None, str(tmp_path / "run"), False)
    assert "step 2:" in str(e.value)
    assert sorted(p.name for p in (tmp_path / "run" / "checkpoints").iterdir()) == ["step_000001"]


def test_huge_learning_rate_leaves_only_really_good_checkpoints(tiny, tmp_path, monkeypatch):
    """A huge lr (1e10 on the 30-layer model; 1e20 overflows this small one): the weights stay
    finite but the next forward overflows. Before, that state was checkpointed and called "last good"."""
    from specrl.algorithms import batch as batch_mod

    # the random tiny model never earns a reward: give the group non-zero advantages so the update is real
    monkeypatch.setattr(batch_mod, "group_advantages", lambda r, n, norm: torch.tensor([1.0, -1.0] * (len(r) // 2)))
    cfg = write_cfg(tmp_path / "c.yaml", cfg_dict(tiny, policy__learning_rate=1e20))
    with pytest.raises(SpecRLError, match=r"step 1:.*non-finite.*none"):
        train_main(str(cfg), [], None, str(tmp_path / "run"), False)
    assert not list((tmp_path / "run" / "checkpoints").glob("step_*"))


def test_generate_rejects_nonfinite_temperature(tiny, tmp_path):
    from specrl.model.loader import load_model
    from specrl.rollout.engine import RolloutEngine
    from specrl.rollout.sampling import SamplingParams

    model, _ = load_model(tiny, dtype=torch.float32)
    engine = RolloutEngine(model, max_batch_size=2, max_seq_len=64)
    with pytest.raises(SpecRLError, match=r"temperature=nan\b.*finite"):
        engine.generate([[1, 2, 3]], SamplingParams(temperature=float("nan"), max_new_tokens=4))
    prompts = tmp_path / "p.jsonl"
    prompts.write_text(json.dumps({"prompt_token_ids": [1, 2, 3]}) + "\n")
    r = runner.invoke(_cli(), ["generate", "--model", str(tiny), "--prompts", str(prompts), "--out",
                               str(tmp_path / "o.jsonl"), "--temperature", "nan", "--max-seq-len", "64"])
    assert r.exit_code == 2 and re.search(r"--temperature.*finite.*\bnan\b", r.output)
    assert not (tmp_path / "o.jsonl").exists()


def _cli():
    from specrl.cli import app

    return app


def test_model_with_a_nan_weight_is_refused_at_load(tmp_path):
    from specrl.model.loader import load_model

    ck = make_tiny_checkpoint(tmp_path / "ck")
    state = load_file(str(ck / "model.safetensors"))
    state["model.layers.0.mlp.up_proj.weight"][0, 0] = float("nan")
    save_file(state, str(ck / "model.safetensors"))
    with pytest.raises(SpecRLError, match=r"mlp\.up_proj.*1 NaN/inf"):
        load_model(ck)


@pytest.fixture()
def eagle_dir(tiny, tmp_path):
    from specrl.drafters.kinds.eagle import EagleDrafter
    from specrl.drafters.storage.io import save_drafter
    from specrl.model.loader import load_model

    target, _ = load_model(tiny, dtype=torch.float32)
    return target, save_drafter(EagleDrafter(target), tmp_path / "eagle")


@pytest.mark.parametrize("damage, match", [
    ("nan", r"tensor fc.weight holds \d+ NaN/inf values.*rebuild it"),
    ("truncate", r"cannot read the drafter's weights \(truncated or corrupt"),
    ("float_d2t", r"tensor 'd2t' has dtype torch.float32, expected an integer dtype"),
    ("int_weight", r"tensor 'fc.weight' has dtype torch.int64, expected a floating-point dtype"),
])
def test_broken_eagle_head_is_refused(eagle_dir, damage, match):
    from specrl.drafters.storage.io import load_drafter

    target, d = eagle_dir
    f = d / "model.safetensors"
    state = load_file(str(f))
    if damage == "truncate":
        f.write_bytes(f.read_bytes()[: f.stat().st_size // 2])
    else:
        if damage == "nan":
            state["fc.weight"][0, :3] = float("nan")
        elif damage == "float_d2t":
            state["d2t"] = state["d2t"].float()
        else:
            state["fc.weight"] = state["fc.weight"].long()
        save_file(state, str(f))
    with pytest.raises(SpecRLError, match=match):
        load_drafter(d, target, expected_kind="eagle")


@pytest.mark.parametrize("ids, match", [
    ([1.0, 2.5], r"p.jsonl:2: prompt_token_ids: token id #0 is 1.0 \(float\); token ids must be integers"),
    (["1", "2"], r"p.jsonl:2: prompt_token_ids: token id #0 is '1' \(str\)"),
    ("123", r"p.jsonl:2: prompt_token_ids: token ids must be a list of integers, got str"),
    (7, r"p.jsonl:2: prompt_token_ids: token ids must be a list of integers, got int 7"),
    ([True, 2], r"p.jsonl:2: prompt_token_ids: token id #0 is True"),
])
def test_prompt_token_ids_of_the_wrong_type_name_the_line(tmp_path, ids, match):
    from specrl.cli.generation import _read_prompts

    p = tmp_path / "p.jsonl"
    p.write_text(json.dumps({"prompt_token_ids": [1, 2]}) + "\n" + json.dumps({"prompt_token_ids": ids}) + "\n")
    with pytest.raises(SpecRLError, match=match):
        _read_prompts(p, None, raw=True)


def test_engine_does_not_truncate_float_token_ids(tiny):
    from specrl.model.loader import load_model
    from specrl.rollout.engine import RolloutEngine
    from specrl.rollout.sampling import SamplingParams

    model, _ = load_model(tiny, dtype=torch.float32)
    engine = RolloutEngine(model, max_batch_size=2, max_seq_len=64)
    with pytest.raises(SpecRLError, match=r"prompt 0:.*2\.7") as e:
        engine.generate([[1, 2.7]], SamplingParams(max_new_tokens=2))
    assert "#1" in str(e.value)
    with pytest.raises(SpecRLError, match=r"prompt 1:.*integers.*\bint\b"):
        engine.generate([[1, 2], 5], SamplingParams(max_new_tokens=2))


def test_draft_model_with_another_tokenizer_of_the_same_size_is_refused(tiny, tmp_path):
    from specrl.drafters import make_drafter
    from specrl.model.loader import load_model

    target, _ = load_model(tiny, dtype=torch.float32)
    same = make_tiny_checkpoint(tmp_path / "same", seed=1)
    assert make_drafter(f"draft-model:{same}", target) is not None
    other = make_tiny_checkpoint(tmp_path / "other", seed=1)
    tj = json.loads((other / "tokenizer.json").read_text())
    vocab = tj["model"]["vocab"]
    vocab["a"], vocab["b"] = vocab["b"], vocab["a"]  # same size, two ids swapped
    (other / "tokenizer.json").write_text(json.dumps(tj))
    with pytest.raises(SpecRLError, match=r"tokenizer.*\b2 of \d+.*97"):
        make_drafter(f"draft-model:{other}", target)


def test_resume_with_a_new_learning_rate_applies_it_and_says_so_on_stderr(tiny, tmp_path, capfd):
    cfg = write_cfg(tmp_path / "c.yaml", cfg_dict(tiny, run__steps=2))
    run = train_main(str(cfg), [], None, str(tmp_path / "run"), False)
    (run / "checkpoints" / "step_000002" / DCP_PART / ".metadata").write_bytes(b"garbage")
    capfd.readouterr()
    train_main(None, ["run.steps=3", "policy.learning_rate=1e-4"], str(run), None, False)
    err = capfd.readouterr().err  # run.progress is false: these still reach stderr
    assert "warning: skipping bad checkpoint" in err and "resumed" in err and "from step_000001" in err
    assert "policy.learning_rate 0.001 -> 0.0001" in err
    recs = read_jsonl(run / "metrics.jsonl")
    assert [r["step"] for r in recs] == [1, 2, 3]
    assert [r["lr"] for r in recs] == [1e-3, 1e-4, 1e-4]
    sched = torch.load(run / "checkpoints" / "step_000003" / "trainer.pt", weights_only=True)["scheduler"]
    assert sched["base_lrs"] == [1e-4]


def test_simulate_gen_gpu_fraction_in_sync_mode_and_out_of_range():
    from specrl.sim.commands import app

    r = runner.invoke(app, ["--preset", "paper-8b-rl-think", "--mode", "sync", "--gen-gpu-fraction", "0.5"])
    assert r.exit_code == 2 and "--gen-gpu-fraction splits GPUs" in r.output and "--mode async" in r.output
    r = runner.invoke(app, ["--preset", "paper-8b-rl-think", "--mode", "async", "--gen-gpu-fraction", "1.5"])
    assert r.exit_code == 2 and re.search(r"--gen-gpu-fraction.*\(0, 1\)", r.output)


# ----------------------------------------------------------------------------- (3) tracebacks before, errors now


def test_simulate_sweep_bad_ks_names_the_flag(tmp_path):
    from specrl.sim.commands import app

    r = runner.invoke(app, ["sweep", "--preset", "paper-8b-rl-think", "--ks", "a,b", "--out", str(tmp_path)])
    assert r.exit_code == 2 and re.search(r"--ks.*integers.*'a,b'", r.output)
    r = runner.invoke(app, ["sweep", "--preset", "paper-8b-rl-think", "--als", "x", "--out", str(tmp_path)])
    assert r.exit_code == 2 and re.search(r"--als.*numbers", r.output)


def test_simulate_from_run_accepts_the_run_directory_and_refuses_non_utf8(tmp_path):
    from specrl.sim.calibration.fromrun import metrics_file
    from specrl.sim.commands import app

    run = tmp_path / "run"
    run.mkdir()
    with pytest.raises(SpecRLError, match="directory without metrics.jsonl"):
        metrics_file(run)
    (run / "metrics.jsonl").write_bytes(b'{"step": 1, "note": "\xff"}\n')
    assert metrics_file(run) == run / "metrics.jsonl"
    r = runner.invoke(app, ["--from-run", str(run)])
    assert r.exit_code == 2 and re.search(r"metrics.jsonl.*UTF-8.*0xff", r.output), r.output


def test_non_utf8_prompts_file(tmp_path):
    from specrl.cli.generation import _read_prompts

    p = tmp_path / "p.jsonl"
    p.write_bytes(b'{"prompt": "caf\xe9"}\n')
    with pytest.raises(SpecRLError, match=r"--prompts.*jsonl.*UTF-8.*0xe9"):
        _read_prompts(p, None, raw=True)


def test_generate_out_is_checked_before_generation(tiny, tmp_path, monkeypatch):
    import specrl.model.loader as loader

    def no_load(*a, **k):
        raise AssertionError("the model was loaded before --out was checked")

    monkeypatch.setattr(loader, "load_model", no_load)
    prompts = tmp_path / "p.jsonl"
    prompts.write_text(json.dumps({"prompt_token_ids": [1, 2, 3]}) + "\n")
    r = runner.invoke(_cli(), ["generate", "--model", str(tiny), "--prompts", str(prompts), "--out", str(tmp_path)])
    assert r.exit_code == 2 and re.search(r"--out.*directory.*out\.jsonl", r.output), r.output
    (tmp_path / "f").write_text("x")
    r = runner.invoke(_cli(), ["generate", "--model", str(tiny), "--prompts", str(prompts), "--out",
                               str(tmp_path / "f" / "o.jsonl")])
    assert r.exit_code == 2 and "cannot create its directory" in r.output, r.output


def test_truncated_model_cache_is_detected_and_reimported(tmp_path, monkeypatch):
    from specrl.model import presets

    ck = make_tiny_checkpoint(tmp_path / "models" / "smollm2-135m")
    assert presets.cache_problem(ck) is None
    f = ck / "model.safetensors"
    f.write_bytes(f.read_bytes()[:-100])
    assert "model.safetensors is truncated" in presets.cache_problem(ck)
    (tmp_path / "models" / f".smollm2-135m-{dead_pid()}-abc").mkdir()  # debris of an interrupted import
    monkeypatch.setenv("SPECRL_HOME", str(tmp_path))

    class Reimport(Exception):
        pass

    def gguf(name):
        raise Reimport

    monkeypatch.setattr(presets, "gguf_path", gguf)
    with pytest.raises(Reimport):  # `prepare` no longer reports the corrupt cache as ready: it imports again
        presets.prepare("smollm2-135m")
    assert not list((tmp_path / "models").glob(".smollm2-135m-*"))


def test_preset_load_error_advises_prepare(tmp_path, monkeypatch):
    from specrl.model import loader, presets

    ck = make_tiny_checkpoint(tmp_path / "models" / "smollm2-135m")
    state = load_file(str(ck / "model.safetensors"))
    state["model.norm.weight"][0] = float("inf")
    save_file(state, str(ck / "model.safetensors"))
    monkeypatch.setattr(presets, "prepare", lambda name: ck)
    with pytest.raises(SpecRLError, match=r"NaN/inf.*prepare --model smollm2-135m"):
        loader.load_model("smollm2-135m")


@pytest.mark.parametrize("exc, match", [
    (OSError(errno.ENOSPC, "No space left on device"), "the disk is full: No space left on device"),
    (RuntimeError("[enforce fail at inline_container.cc:778] . PytorchStreamWriter failed writing file data/3: "
                  "file write failed"), "the disk is full"),
    (RuntimeError("[enforce fail at inline_container.cc:672] . unexpected pos 704 vs 598"), "the disk is full"),
    (PermissionError(errno.EACCES, "Permission denied"), "the directory is not writable: Permission denied"),
])
def test_checkpoint_on_a_full_or_read_only_disk(tiny, tmp_path, monkeypatch, exc, match):
    real = torch.save
    calls = {"n": 0}

    def save(obj, path, *a, **k):
        if "step_000002" in str(path):
            calls["n"] += 1
            if calls["n"] == 1:  # fail mid-checkpoint: the DCP directory part is written, the trainer part fails
                raise exc
        return real(obj, path, *a, **k)

    monkeypatch.setattr(ckpt_mod.torch, "save", save)
    cfg = write_cfg(tmp_path / "c.yaml", cfg_dict(tiny))
    run = tmp_path / "run"
    with pytest.raises(SpecRLError, match=rf"step_000002 \({match}.*step_000001.*intact.*--resume"):
        train_main(str(cfg), [], None, str(run), False)
    assert sorted(p.name for p in (run / "checkpoints").iterdir()) == ["step_000001"]  # no partial left
    monkeypatch.setattr(ckpt_mod.torch, "save", real)
    train_main(None, [], str(run), None, False)
    assert steps(run) == [1, 2, 3]


def test_unwritable_run_directory(tiny, tmp_path):
    (tmp_path / "file").write_text("x")
    cfg = write_cfg(tmp_path / "c.yaml", cfg_dict(tiny))
    with pytest.raises(SpecRLError, match=r"run directory.*file/run.*writable"):
        train_main(str(cfg), [], None, str(tmp_path / "file" / "run"), False)


def test_online_drafter_gone_nan_is_named(tiny, tmp_path, monkeypatch):
    from specrl.drafters import EagleDrafter

    def build(spec, model):
        torch.manual_seed(1)
        return None if spec == "none" else EagleDrafter(model)

    monkeypatch.setattr(default_drafter, "resolve_drafter", build)
    real = Learner.stage_train

    def poisoned(self, batch, capture=None):
        if self.step_count + 1 == 2:
            with torch.no_grad():
                next(self.drafter.parameters()).fill_(float("nan"))
        return real(self, batch, capture)

    monkeypatch.setattr(Learner, "stage_train", poisoned)
    cfg = write_cfg(tmp_path / "c.yaml", cfg_dict(tiny, speculative__drafter="eagle:x", drafter__online=True,
                                                  speculative__num_draft_tokens=2))
    with pytest.raises(SpecRLError, match=r"step 2:.*'eagle:x'.*learning_rate"):
        train_main(str(cfg), [], None, str(tmp_path / "run"), False)


# ----------------------------------------------------------------------------- (4) overwrite of a killed run


def test_overwrite_keeps_an_unfinished_run_and_offers_resume(tiny, tmp_path):
    cfg = write_cfg(tmp_path / "c.yaml", cfg_dict(tiny, run__overwrite=True))
    run = tmp_path / "run"
    ckpt_mod.save_checkpoint(run / "checkpoints", 2, {"x": torch.zeros(1)})
    (run / "metrics.jsonl").write_text('{"step": 1}\n{"step": 2}\n')
    with pytest.raises(SpecRLError, match=rf"unfinished.*step 2\b.*--resume {run}"):
        setup_run(str(cfg), [], None, str(run))
    assert (run / "checkpoints" / "step_000002").is_dir() and not (run / LOCK_FILE).exists()
    (run / "final").mkdir()  # a finished run is still cleared
    setup_run(str(cfg), [], None, str(run))
    release_run(run)
    assert not (run / "checkpoints").exists() and not (run / "final").exists() and (run / "config.yaml").exists()


# ----------------------------------------------------------------------------- (5) faults survived


def test_stale_default_drafter_build_dirs_are_removed(tmp_path, monkeypatch, capfd):
    from specrl.drafters.storage.default import remove_stale_builds

    final = tmp_path / "drafters" / "smollm2-135m-eagle-default"
    final.parent.mkdir(parents=True)
    dead = final.with_name(f"{final.name}.building-{dead_pid()}")
    live = final.with_name(f"{final.name}.building-{os.getppid()}")  # a build still running: left alone
    for d in (dead, live):
        d.mkdir()
        (d / "model.safetensors").write_bytes(b"partial")
    assert remove_stale_builds(final) == [dead]
    assert not dead.exists() and live.exists()
    assert re.search(rf"removed {re.escape(str(dead))}.*interrupted", capfd.readouterr().err)


@pytest.fixture(scope="module")
def clean_run(tiny, tmp_path_factory) -> Path:
    d = tmp_path_factory.mktemp("clean")
    cfg = write_cfg(d / "c.yaml", cfg_dict(tiny, run__checkpoint_every=0))
    return train_main(str(cfg), [], None, str(d / "run"), False)


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_signal_mid_step_finishes_checkpoints_and_resumes_bitwise(tiny, tmp_path, monkeypatch, clean_run, sig):
    real = Learner.stage_train

    def signalled(self, batch, capture=None):
        if self.step_count + 1 == 2:
            os.kill(os.getpid(), sig)  # arrives in the middle of step 2
            time.sleep(0.05)
        return real(self, batch, capture)

    monkeypatch.setattr(Learner, "stage_train", signalled)
    before = signal.getsignal(sig)
    cfg = write_cfg(tmp_path / "c.yaml", cfg_dict(tiny, run__checkpoint_every=0))
    run = tmp_path / "run"
    with pytest.raises(RunInterrupted, match=rf"{sig.name}.*\b2 of 3\b.*step_000002"):
        train_main(str(cfg), [], None, str(run), False)
    assert signal.getsignal(sig) == before  # handlers restored
    assert steps(run) == [1, 2] and [p.name for p in (run / "checkpoints").iterdir()] == ["step_000002"]
    monkeypatch.setattr(Learner, "stage_train", real)
    train_main(None, [], str(run), None, False)
    assert steps(run) == [1, 2, 3]
    a = read_model_tensors(clean_run / "checkpoints" / "step_000003" / DCP_PART)
    b = read_model_tensors(run / "checkpoints" / "step_000003" / DCP_PART)
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    ra, rb = read_jsonl(clean_run / "metrics.jsonl"), read_jsonl(run / "metrics.jsonl")
    assert [r["reward_mean"] for r in ra] == [r["reward_mean"] for r in rb]


def test_second_signal_aborts_at_once():
    before = signal.getsignal(signal.SIGTERM)  # not necessarily SIG_DFL: an earlier ray.init installs its own
    stop = _StopSignals().install()
    try:
        os.kill(os.getpid(), signal.SIGTERM)
        assert stop.received == signal.SIGTERM
        with pytest.raises(KeyboardInterrupt):
            os.kill(os.getpid(), signal.SIGTERM)
            time.sleep(1)
    finally:
        stop.uninstall()
    assert signal.getsignal(signal.SIGTERM) == before
