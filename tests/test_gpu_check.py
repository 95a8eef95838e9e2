"""tools/gpu_check.py: refuses clearly without CUDA; every section runs at toy sizes on CPU (--dry-run-cpu)."""

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has a CUDA device")
def test_refuses_without_cuda(tmp_path):
    p = subprocess.run([sys.executable, str(ROOT / "tools" / "gpu_check.py"), "--out", str(tmp_path)],
                       capture_output=True, text=True, timeout=120)
    assert p.returncode == 2
    assert p.stderr.startswith("no CUDA device: ") and "NVIDIA GPU" in p.stderr
    assert not (tmp_path / "gpu_check.json").exists()


def test_dry_run_runs_every_section(tmp_path):
    sys.path.insert(0, str(ROOT / "tools"))
    from gpu_check import main

    assert main(["--dry-run-cpu", "--out", str(tmp_path)]) == 0
    rec = json.loads((tmp_path / "gpu_check.json").read_text())
    assert {s["status"] for s in rec["sections"].values()} == {"ok"}
    assert [r["B"] for r in rec["sections"]["decode"]["result"]] == [1, 2]
    assert rec["sections"]["learner"]["result"]["weights_moved"] > 0
    assert "| B | engine tok/s |" in (tmp_path / "gpu_check.md").read_text()
    rows = rec["sections"]["commands"]["result"]
    assert [(r["command"], r["status"], r["violations"]) for r in rows] == [
        ("specrl generate", "ok", 0), ("FSDP2 learner step, one rank", "ok", 0)]
    assert all(r["processes"] >= 1 for r in rows)


def test_the_cuda_commands_cover_every_command_on_the_device(tmp_path):
    """What the check runs on a GPU: every whole command, each config naming run.device: cuda."""
    import yaml

    sys.path.insert(0, str(ROOT / "tools"))
    from gpu_commands import commands

    cmds = dict(commands(tmp_path, "cuda"))
    assert {"specrl run", "specrl train (sync)", "specrl generate", "specrl check-backend",
            "FSDP2 learner step, one rank", "specrl draft build", "specrl draft eval"} <= set(cmds)
    configs = [a[a.index("--config") + 1] for a in cmds.values() if "--config" in a]
    assert configs and all(yaml.safe_load(Path(c).read_text())["run"]["device"] == "cuda" for c in configs)
    assert cmds["specrl generate"][-2:] == ["--device", "cuda"] and cmds["FSDP2 learner step, one rank"][-1] == "cuda"
