"""Whole commands under the placement guard (`tools/device_guard_run.py`): the guard reaches every process a
command starts, records what a CUDA machine would reject with the site, and a tiny `specrl run` (both arms and
the certificate) and `specrl generate` complete with none. The other commands (`specrl train` sync, async on
Ray, `learner.world_size: 2`, `check-backend`, `draft build` / `draft eval`) were run under it by hand
(docs/losslessness.md)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tools"))

import device_guard_run as runner  # noqa: E402

# `make test` runs this module alone, after its parallel part:
# it runs the main job in a spawned child under the device guard.
pytestmark = pytest.mark.serial


@pytest.fixture(autouse=True)
def _one_thread(monkeypatch):
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")


def _snippet(tmp_path, code: str) -> list[str]:
    script = tmp_path / "snippet.py"
    script.write_text(code)
    return ["python", str(script)]


def test_the_runner_guards_the_main_process_and_a_spawned_child(tmp_path):
    """A host tensor fed to a model loaded for the run's device is recorded with its site, in the main process and
    in a spawned child (a guard installed from PYTHONPATH); placed code records nothing; the exit code says so."""
    from tests.tiny import make_tiny_checkpoint

    ck = make_tiny_checkpoint(tmp_path / "ck", seed=0)
    code = f"""
import multiprocessing as mp
import torch
from specrl.model.loader import load_model

def forward(placed):
    m, _ = load_model({str(ck)!r}, dtype=torch.float32, device="cpu")
    dev = next(m.parameters()).device
    m(torch.zeros(1, 3, dtype=torch.long, device=dev) if placed else torch.zeros(1, 3, dtype=torch.long))

if __name__ == "__main__":
    import sys
    placed = sys.argv[1] == "placed"
    forward(placed)
    p = mp.get_context("spawn").Process(target=forward, args=(placed,))
    p.start(); p.join()
    sys.exit(p.exitcode)
"""
    bad = runner.run(_snippet(tmp_path, code) + ["host"], tmp_path / "bad")
    assert bad["returncode"] == 0 and bad["processes"] == 2
    # the embedding of host tokens, once per process (what follows from them is recorded too)
    assert any(s["op"] == "embedding" and s["site"].endswith("transformer.py:296") and s["count"] == 2
               for s in bad["sites"]), bad
    pids = {v["pid"] for v in runner.read_jsonl(tmp_path / "bad" / "violations.jsonl")}
    assert len(pids) == 2  # one in each process
    good = runner.run(_snippet(tmp_path, code) + ["placed"], tmp_path / "good")
    assert good["returncode"] == 0 and good["processes"] == 2 and good["violations"] == 0
    assert json.loads((tmp_path / "good" / "summary.json").read_text())["violations"] == 0


def test_the_runners_exit_codes_and_raise_mode(tmp_path):
    """Exit 3 on violations, 0 when clean, 4 when no process imported torch, 2 without `--`; --raise fails the
    command at the first violation, as CUDA would."""
    code = "import torch\nx = torch.ones(3, device='cpu:0')  # the policy's device\nprint(x + torch.ones(3))\n"
    log = ["--log", str(tmp_path / "m"), "--"]
    assert runner.main(log + _snippet(tmp_path, code)) == 3
    assert runner.main(log + _snippet(tmp_path, code.replace("torch.ones(3))", "torch.ones(3, device=x.device))"))) == 0
    assert runner.main(log + ["python", "-c", "pass"]) == 4
    assert runner.main(["python", "-c", "pass"]) == 2
    with pytest.raises(SystemExit):
        runner.main(["--device", "tpu", "--", "python", "-c", "pass"])
    s = runner.run(_snippet(tmp_path, code), tmp_path / "log", mode="raise")
    assert s["returncode"] != 0 and s["violations"] == 1 and s["sites"][0]["site"].endswith("snippet.py:3")


def test_a_tiny_main_job_and_generate_run_clean_under_the_guard(tmp_path):
    """`specrl run` (both arms, the certificate) and a speculative `specrl generate` at tiny sizes: the guard is in
    the process, the policy is placed on its device, and nothing is allocated on the host beside it."""
    from tests.test_rl_trainer import cfg_dict
    from tests.tiny import make_tiny_checkpoint

    tiny = make_tiny_checkpoint(tmp_path / "ckpt", seed=0)
    draft = make_tiny_checkpoint(tmp_path / "draft", seed=1)
    cfg = cfg_dict(tiny, speculative__drafter=f"draft-model:{draft}", speculative__num_draft_tokens=2,
                   speculative__verify="rejection", grpo__val_every=0, run__steps=1, run__checkpoint_every=0,
                   run__name="g")
    (tmp_path / "c.yaml").write_text(yaml.safe_dump(cfg))
    s = runner.run(["specrl", "run", "--config", str(tmp_path / "c.yaml")], tmp_path / "log", cwd=str(tmp_path))
    assert s["returncode"] == 0 and s["processes"] == 1 and s["violations"] == 0, s
    cert = json.loads((tmp_path / "runs" / "g" / "speculative" / "certificate.json").read_text())
    assert cert["passed"] and cert["num_tokens"] > 0
    prompts = tmp_path / "p.jsonl"
    prompts.write_text('{"prompt_token_ids": [1, 2, 3]}\n{"prompt_token_ids": [4, 5]}\n')
    s = runner.run(["specrl", "generate", "--model", str(tiny), "--prompts", str(prompts), "--out",
                    str(tmp_path / "o.jsonl"), "--temperature", "1.0", "--max-new-tokens", "6", "--num-samples", "2",
                    "--drafter", f"draft-model:{draft}", "--k", "auto", "--dtype", "fp32", "--max-seq-len", "64"],
                   tmp_path / "log2", cwd=str(tmp_path))
    assert s["returncode"] == 0 and s["violations"] == 0, s
    assert len((tmp_path / "o.jsonl").read_text().splitlines()) == 4

