"""Every code block of README.md runs as written: ```python blocks are executed, ```yaml blocks load through the
config loader (and name files that exist), ```bash blocks name Makefile targets that exist.

The Python blocks run in a temporary working directory (the training quickstart writes `runs/quickstart` there)
on the embedded model; the README keeps them small (one GRPO step, 16 new tokens), so this takes about a minute on
one thread.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from specrl.trainer.config_check import load_config

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
FENCE = re.compile(r"^```(\w*)\n(.*?)^```", re.S | re.M)


def blocks(lang: str) -> list[str]:
    return [body for kind, body in FENCE.findall(README.read_text()) if kind == lang]


def test_readme_is_an_entry_point():
    text = README.read_text()
    assert len(text.splitlines()) <= 150
    assert "arxiv.org/abs/2604.26779" in text
    assert blocks("python") and blocks("yaml") and blocks("bash")
    for link in re.findall(r"\]\(([^)#]+)\)", text):
        if not link.startswith("http"):
            assert (ROOT / link).exists(), f"README links to {link}, which does not exist"


@pytest.mark.parametrize("index", range(len(blocks("yaml"))))
def test_readme_yaml_loads(index, tmp_path):
    p = tmp_path / "readme.yaml"
    p.write_text(blocks("yaml")[index])
    cfg = load_config(p)
    for path in [cfg.task.path, *(f.rpartition(":")[0] for f in cfg.reward.functions)]:
        if path and ("/" in path or path.endswith((".py", ".jsonl", ".parquet"))):
            assert (ROOT / path).exists(), f"the README's YAML names {path}, which does not exist"


def test_readme_bash_names_make_targets():
    targets = set(re.findall(r"^([\w-]+):", (ROOT / "Makefile").read_text(), re.M))
    for body in blocks("bash"):
        for target in re.findall(r"^make ([\w-]+)", body, re.M):
            assert target in targets, f"README runs `make {target}`, which the Makefile does not define"


@pytest.mark.slow
@pytest.mark.parametrize("index", range(len(blocks("python"))))
def test_readme_python_runs(index, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    code = blocks("python")[index]
    exec(compile(code, f"README.md python block {index}", "exec"), {"__name__": "__main__"})
