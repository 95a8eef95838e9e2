"""Atomic checkpoints: round trip, pruning, detection of corrupt/partial checkpoints and fallback."""

import json

import pytest
import torch

from specrl.checkpoint.store import (
    CheckpointError,
    list_checkpoints,
    load_checkpoint,
    load_latest,
    save_checkpoint,
    verify_checkpoint,
    write_part,
)


def parts(step):
    return {"policy": {"w": torch.full((4,), float(step))}, "state": {"step": step, "cursor": 8 * step}}


def test_roundtrip_and_prune(tmp_path):
    for s in (1, 2, 3):
        save_checkpoint(tmp_path, s, parts(s), meta={"run": "x"}, keep=2)
    assert [s for s, _ in list_checkpoints(tmp_path)] == [3, 2]
    ck = load_latest(tmp_path)
    assert ck.step == 3 and ck.meta == {"run": "x"} and not ck.skipped
    assert torch.equal(ck.parts["policy"]["w"], torch.full((4,), 3.0))
    assert ck.parts["state"]["cursor"] == 24
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]


def test_resave_same_step(tmp_path):
    save_checkpoint(tmp_path, 1, parts(1))
    save_checkpoint(tmp_path, 1, parts(5))
    assert load_checkpoint(tmp_path / "step_000001").parts["state"]["step"] == 5


def test_empty_root(tmp_path):
    assert load_latest(tmp_path / "none") is None


def test_corrupt_falls_back_to_previous(tmp_path):
    save_checkpoint(tmp_path, 1, parts(1))
    p2 = save_checkpoint(tmp_path, 2, parts(2))
    f = p2 / "policy.pt"
    data = bytearray(f.read_bytes())
    data[-10] ^= 0xFF
    f.write_bytes(bytes(data))
    with pytest.raises(CheckpointError, match="SHA-256"):
        verify_checkpoint(p2)
    ck = load_latest(tmp_path)
    assert ck.step == 1
    assert len(ck.skipped) == 1 and "step_000002" in ck.skipped[0]


@pytest.mark.parametrize("damage", ["truncate", "no_manifest", "missing_part", "bad_manifest"])
def test_partial_checkpoints_detected(tmp_path, damage):
    save_checkpoint(tmp_path, 1, parts(1))
    p2 = save_checkpoint(tmp_path, 2, parts(2))
    if damage == "truncate":
        f = p2 / "state.pt"
        f.write_bytes(f.read_bytes()[:10])
        pattern = "bytes"
    elif damage == "no_manifest":
        (p2 / "manifest.json").unlink()
        pattern = "partial"
    elif damage == "missing_part":
        (p2 / "policy.pt").unlink()
        pattern = "missing"
    else:
        (p2 / "manifest.json").write_text("{not json")
        pattern = "unreadable"
    with pytest.raises(CheckpointError, match=pattern):
        verify_checkpoint(p2)
    assert load_latest(tmp_path).step == 1


def test_all_corrupt_raises(tmp_path):
    p = save_checkpoint(tmp_path, 1, parts(1))
    m = json.loads((p / "manifest.json").read_text())
    m["files"]["policy"]["sha256"] = "0" * 64
    (p / "manifest.json").write_text(json.dumps(m))
    with pytest.raises(CheckpointError, match="no usable checkpoint"):
        load_latest(tmp_path)


def test_leftover_tmp_dir_ignored(tmp_path):
    save_checkpoint(tmp_path, 1, parts(1))
    (tmp_path / ".tmp-step_000002-123").mkdir()
    (tmp_path / ".tmp-step_000002-123" / "policy.pt").write_bytes(b"partial")
    assert load_latest(tmp_path).step == 1


# ----------------------------------------------------------------------------- parts that could run code


class _RunsCode:
    """Unpickling this would call os.system (touching a marker file) if the loader allowed arbitrary globals."""

    def __init__(self, marker):
        self.marker = str(marker)

    def __reduce__(self):
        import os

        return (os.system, (f"touch {self.marker}",))


def _plant(ck_dir, part, obj):
    """Replace one part of a checkpoint with `obj` and re-sign the manifest, as a crafted directory would."""
    import hashlib

    f = ck_dir / f"{part}.pt"
    torch.save(obj, f)
    m = json.loads((ck_dir / "manifest.json").read_text())
    m["files"][part].update(bytes=f.stat().st_size, sha256=hashlib.sha256(f.read_bytes()).hexdigest())
    (ck_dir / "manifest.json").write_text(json.dumps(m))


def test_a_part_that_would_run_code_is_refused_and_never_skipped_past(tmp_path):
    from specrl.checkpoint.store import UnsafeCheckpointError

    marker = tmp_path / "ran"
    save_checkpoint(tmp_path / "ck", 1, parts(1))
    p2 = save_checkpoint(tmp_path / "ck", 2, parts(2))
    _plant(p2, "state", {"step": 2, "cursor": _RunsCode(marker)})
    verify_checkpoint(p2)  # the manifest matches: only the loader can stop it
    with pytest.raises(UnsafeCheckpointError, match=r"step_000002:.*'state'.*`posix\.system`"):
        load_latest(tmp_path / "ck")  # not a corrupt checkpoint to skip: the directory is untrusted
    assert not marker.exists()


def test_numpy_state_is_stored_as_plain_data_and_comes_back_as_numpy(tmp_path):
    import numpy as np

    np.random.seed(3)
    np.random.rand(5)
    st = np.random.get_state()
    p = save_checkpoint(tmp_path, 1, {"trainer": {"rng": {"numpy": st}, "x": np.float64(0.5), "n": np.int64(7)}})
    assert torch.serialization.get_unsafe_globals_in_checkpoint(p / "trainer.pt") == []
    back = load_checkpoint(p).parts["trainer"]
    assert back["x"] == 0.5 and back["n"] == 7 and isinstance(back["rng"]["numpy"], tuple)
    np.random.seed(0)
    np.random.set_state(back["rng"]["numpy"])
    np.random.set_state(st)
    want = np.random.rand(3)
    np.random.set_state(back["rng"]["numpy"])
    assert np.array_equal(np.random.rand(3), want)


def test_a_part_that_pickles_numpy_directly_is_refused(tmp_path):
    """A part whose pickle builds a numpy array (numpy's RNG state pickled as an ndarray) is not plain data: refused
    like any other global (specrl stores numpy arrays as tagged plain lists)."""
    import numpy as np

    from specrl.checkpoint.store import UnsafeCheckpointError

    p = save_checkpoint(tmp_path, 1, parts(1))
    _plant(p, "state", {"step": 1, "rng": np.random.get_state()})
    with pytest.raises(UnsafeCheckpointError, match=r"'state' \(state\.pt\).*`numpy"):
        load_checkpoint(p)


# ----------------------------------------------------------------------------- the format version
@pytest.mark.parametrize("found, match", [
    (1, r"checkpoint format 1 \(written by an older specrl\); this specrl \(.+\) reads checkpoint format 2 only\. "
        r"Finish that run with the specrl version that wrote it, or start a new run"),
    (None, r"checkpoint with no format version \(written before format 1\); this specrl \(.+\) reads checkpoint "
           r"format 2 only\. Finish that run with the specrl version that wrote it, or start a new run"),
    (3, r"checkpoint format 3 \(written by specrl 9\.0\); this specrl \(.+\) reads checkpoint "
        r"format 2 only\. Resume it with the specrl version that wrote it"),
])
def test_a_checkpoint_of_another_format_is_refused_naming_both_versions(tmp_path, found, match):
    """An old run directory (a format-1 manifest written by hand, as specrl 0.1 wrote them: `torch.save` parts for the
    policy and optimizer) is refused with what to do, never skipped past to an older checkpoint."""
    import hashlib

    from specrl.checkpoint.store import FORMAT_VERSION, CheckpointFormatError

    assert FORMAT_VERSION == 2
    save_checkpoint(tmp_path, 1, parts(1))  # a good checkpoint of this format: the resume must not fall back to it
    old = tmp_path / "step_000002"
    old.mkdir()
    files = {}
    for name, obj in (("policy", {"w": torch.zeros(2)}), ("optimizer", {"state": {}, "param_groups": []})):
        torch.save(obj, old / f"{name}.pt")
        data = (old / f"{name}.pt").read_bytes()
        files[name] = {"file": f"{name}.pt", "bytes": len(data), "sha256": hashlib.sha256(data).hexdigest()}
    manifest = {"step": 2, "files": files, "meta": {}}
    if found is not None:
        manifest["format"] = found
    if found == 3:
        manifest["specrl"] = "9.0"
    (old / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(CheckpointFormatError, match=match):
        verify_checkpoint(old)
    with pytest.raises(CheckpointFormatError, match="step_000002: checkpoint"):
        load_latest(tmp_path)


def test_a_manifest_records_the_format_and_the_specrl_version(tmp_path):
    from specrl.checkpoint.store import FORMAT_VERSION, specrl_version

    m = verify_checkpoint(save_checkpoint(tmp_path, 1, parts(1)))
    assert m["format"] == FORMAT_VERSION and m["specrl"] == specrl_version() != ""


def test_resume_refuses_a_planted_pickle_naming_it(tmp_path):
    from specrl.errors import SpecRLError
    from specrl.run.loop import train_main
    from tests.test_reliability import cfg_dict
    from tests.test_rl_trainer import write_cfg
    from tests.tiny import make_tiny_checkpoint

    tiny = make_tiny_checkpoint(tmp_path / "tiny", seed=0)
    run = train_main(str(write_cfg(tmp_path / "c.yaml", cfg_dict(tiny, run__steps=1))), [], None,
                     str(tmp_path / "run"), False)
    marker = tmp_path / "ran"
    ck = run / "checkpoints" / "step_000001"
    _plant(ck, "trainer", {"step": 1, "sampler": _RunsCode(marker)})
    with pytest.raises(SpecRLError, match=r"step_000001:.*'trainer'.*`posix\.system`"):
        train_main(None, ["run.steps=2"], str(run), None, False)
    assert not marker.exists()


# ----------------------------------------------------------------------------- parts their owner writes
class _OwnerWritten:
    """A part written by its owner (as the async learner actor writes its state), with `write_part`."""

    def __init__(self, obj=None, fail: Exception | None = None, write: bool = True):
        self.obj, self.fail, self.write, self.paths = obj, fail, write, []

    def write_file(self, path):
        self.paths.append(path)
        if self.fail is not None:
            raise self.fail
        if self.write:
            write_part(self.obj, path)


def test_a_part_written_by_its_owner_is_recorded_and_loads_like_the_others(tmp_path):
    import numpy as np

    policy = {"w": torch.randn(3, 4), "b": torch.arange(5)}
    state = {"rng": np.random.RandomState(3).get_state(), "step": 7}
    owner = _OwnerWritten(policy)
    p = save_checkpoint(tmp_path, 4, {"policy": owner, "learner": state})
    assert [(q.parent.name.startswith(".tmp-step_000004"), q.name) for q in owner.paths] == [(True, "policy.pt")]
    manifest = verify_checkpoint(p)
    assert set(manifest["files"]) == {"policy", "learner"} and manifest["files"]["policy"]["file"] == "policy.pt"
    loaded = load_latest(tmp_path)
    assert set(loaded.parts["policy"]) == {"w", "b"}
    assert all(torch.equal(loaded.parts["policy"][k], v) for k, v in policy.items())
    assert loaded.parts["learner"]["step"] == 7


@pytest.mark.parametrize("fail", [OSError(28, "No space left on device"), RuntimeError("write failed"), None])
def test_a_part_whose_owner_fails_leaves_nothing_behind(tmp_path, fail):
    save_checkpoint(tmp_path, 1, {"policy": {"w": torch.ones(2)}})
    owner = _OwnerWritten({"w": torch.zeros(2)}, fail=fail, write=fail is not None)
    match = r"cannot write checkpoint .*step_000002.* MiB free there" if fail is not None else \
        r"part 'policy': its writer returned without writing"
    with pytest.raises(CheckpointError, match=match):
        save_checkpoint(tmp_path, 2, {"policy": owner})
    assert sorted(q.name for q in tmp_path.iterdir()) == ["step_000001"]  # the partial write is gone
    assert load_latest(tmp_path).step == 1


class _Global:
    """Pickles as a call of `module.name(*args)`: a crafted `.metadata` naming any global it likes."""

    def __init__(self, fn, *args):
        self.fn, self.args = fn, args

    def __reduce__(self):
        return (self.fn, self.args)


@pytest.mark.parametrize("what", ["os.system", "a DCP class it does not need", "a name a DCP module imported"])
def test_a_crafted_dcp_metadata_is_refused_with_no_code_run(tmp_path, what):
    import os
    import pickle

    from torch.distributed.checkpoint import FileSystemWriter, filesystem

    from specrl.checkpoint.sharded_state import SafeReader, save_dcp
    from specrl.errors import SpecRLError
    from specrl.model.transformer import tiny_model

    policy = tiny_model("llama", vocab_size=64)
    opt = torch.optim.AdamW(policy.parameters())
    save_dcp(str(tmp_path / "ck"), policy, None, opt)
    assert SafeReader(str(tmp_path / "ck")).read_metadata().state_dict_metadata  # the real one loads
    marker = tmp_path / "ran"
    if what == "a name a DCP module imported":  # pathlib.Path under the name filesystem.Path (a raw GLOBAL opcode)
        assert filesystem.Path is not None
        raw = f"ctorch.distributed.checkpoint.filesystem\nPath\n(V{marker}\ntR.".encode()
    else:
        raw = pickle.dumps({"os.system": _Global(os.system, f"touch {marker}"),
                            "a DCP class it does not need": _Global(FileSystemWriter, str(marker))}[what])
    (tmp_path / "ck" / ".metadata").write_bytes(raw)
    with pytest.raises(SpecRLError, match=r"refused.*DCP checkpoint"):
        SafeReader(str(tmp_path / "ck")).read_metadata()
    assert not marker.exists()


# ----------------------------------------------------------------------------- the model and optimizer state (DCP)
def test_a_single_process_learner_writes_one_dcp_directory_part(tmp_path):
    """One process writes the model and optimizer state with DCP (no process group): every file of the directory is in
    the manifest and checked, and the state comes back bit for bit into a fresh model and optimizer."""
    from specrl.checkpoint.sharded_state import DCP_PART, DcpPart, load_dcp, read_model_tensors
    from specrl.model.transformer import tiny_model

    policy = tiny_model("llama", vocab_size=64, seed=0)
    opt = torch.optim.AdamW(policy.parameters(), lr=1e-3)
    policy(torch.randint(0, 64, (2, 5)))[0].sum().backward()
    opt.step()
    p = save_checkpoint(tmp_path / "ck", 1, {DCP_PART: DcpPart(policy, None, [opt]), "learner": {"step": 1}})
    m = verify_checkpoint(p)
    assert m["files"][DCP_PART]["dir"] == DCP_PART and ".metadata" in m["files"][DCP_PART]["files"]
    assert set(m["files"][DCP_PART]["files"]) == {str(f.relative_to(p / DCP_PART))
                                                   for f in (p / DCP_PART).rglob("*") if f.is_file()}
    ck = load_latest(tmp_path / "ck")
    back = tiny_model("llama", vocab_size=64, seed=1)
    opt2 = torch.optim.AdamW(back.parameters(), lr=1e-3)
    load_dcp(ck.parts[DCP_PART], back, None, [opt2])
    assert all(torch.equal(v, back.state_dict()[k]) for k, v in policy.state_dict().items())
    for a, b in zip(policy.parameters(), back.parameters(), strict=True):
        assert all(torch.equal(opt.state[a][k], opt2.state[b][k]) for k in ("step", "exp_avg", "exp_avg_sq"))
    assert all(torch.equal(v, policy.state_dict()[k.removeprefix("policy.")])
               for k, v in read_model_tensors(ck.parts[DCP_PART]).items())
    data = sorted(f for f in (p / DCP_PART).iterdir() if f.suffix == ".distcp")[0]
    b = bytearray(data.read_bytes())
    b[len(b) // 2] ^= 0xFF
    data.write_bytes(bytes(b))
    with pytest.raises(CheckpointError, match=rf"'{DCP_PART}/{data.name}' fails.*SHA-256"):
        verify_checkpoint(p)


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
def test_a_dcp_entry_that_would_run_code_is_refused(tmp_path):
    """DCP unpickles a non-tensor entry (an optimizer's hyperparameters) with `weights_only=False`; specrl's reader
    first reads it with `weights_only=True`, so a crafted entry is refused before it runs."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import FileSystemWriter

    from specrl.checkpoint.sharded_state import _load
    from specrl.errors import SpecRLError

    marker = tmp_path / "ran"
    dcp.save({"optim": {"lr": _RunsCode(marker)}, "w": torch.ones(2)},
             storage_writer=FileSystemWriter(str(tmp_path / "ck")), no_dist=True)
    with pytest.raises(SpecRLError, match=r"'optim\.lr'.*`posix\.system`"):
        _load({"optim": {"lr": 0.0}, "w": torch.zeros(2)}, str(tmp_path / "ck"))
    assert not marker.exists()
    state = {"w": torch.zeros(2)}
    _load(state, str(tmp_path / "ck"))  # the tensors alone load
    assert torch.equal(state["w"], torch.ones(2))


@pytest.mark.parametrize("fail", [OSError(28, "No space left on device"), RuntimeError("file write failed")])
def test_a_dcp_part_that_fails_to_write_leaves_nothing_behind(tmp_path, monkeypatch, fail):
    """A full disk while DCP writes the model and optimizer state: DCP's own exception wrapper is taken off, the
    store names the cause and removes the partial write."""
    from specrl.checkpoint.sharded_state import DCP_PART, DcpPart
    from specrl.model.transformer import tiny_model

    policy = tiny_model("llama", vocab_size=64)
    opt = torch.optim.AdamW(policy.parameters())
    save_checkpoint(tmp_path, 1, {"learner": {"step": 1}})
    real = torch.save

    def save(obj, f, *a, **k):
        if not isinstance(f, (str, bytes)) and not hasattr(f, "__fspath__"):  # DCP writes tensors into its stream
            raise fail
        return real(obj, f, *a, **k)

    monkeypatch.setattr(torch, "save", save)
    with pytest.raises(CheckpointError, match=r"step_000002.*disk is full"):
        save_checkpoint(tmp_path, 2, {DCP_PART: DcpPart(policy, None, [opt]), "learner": {"step": 2}})
    assert sorted(q.name for q in tmp_path.iterdir()) == ["step_000001"]
