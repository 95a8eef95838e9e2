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
