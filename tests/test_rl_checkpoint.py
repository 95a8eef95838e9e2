"""Atomic checkpoints: round trip, pruning, detection of corrupt/partial checkpoints and fallback."""

import json

import pytest
import torch

from specrl.rl.checkpoint import (
    CheckpointError,
    list_checkpoints,
    load_checkpoint,
    load_latest,
    save_checkpoint,
    verify_checkpoint,
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
