"""`make test` runs most of the suite on several xdist workers and the tests marked `serial` alone, after them.

A test that starts Ray, or processes that must meet (a process group's rendezvous, torchrun) or answer within short
timeouts, could miss its deadlines beside another worker's test, so it must carry `@pytest.mark.serial` (or its
module `pytestmark = pytest.mark.serial`). This scans every test module's code (comments dropped) for the ways the
suite starts them; tests/conftest.py refuses the `local_ray` fixture without the mark, and any serial test on a
worker.
"""

from __future__ import annotations

import ast
import io
import re
import tokenize
from pathlib import Path

import pytest

TESTS = Path(__file__).resolve().parent
STARTS = re.compile(r"\bray\.init\(|\bstart_local_ray\(|\bcluster_utils\b|\btorchrun\b|\bLearnerGroup\(|"
                    r"\blocal_ray\b|\bkill_tree\(|\bmem\.measure\(")


def _code_lines(src: str) -> dict[int, str]:
    """Line number -> the line without its comment."""
    lines = dict(enumerate(src.splitlines(), start=1))
    for tok in tokenize.generate_tokens(io.StringIO(src).readline):
        if tok.type == tokenize.COMMENT:
            lines[tok.start[0]] = lines[tok.start[0]][:tok.start[1]]
    return lines


def _is_serial_mark(node: ast.AST) -> bool:
    return ast.unparse(node).replace(" ", "") in ("pytest.mark.serial", "pytest.mark.serial()")


def unmarked_starts(src: str) -> list[str]:
    """What in `src` starts Ray or meeting processes outside a serial mark: 'line N: code' for each."""
    tree = ast.parse(src)
    if any(isinstance(n, ast.Assign) and any(getattr(t, "id", None) == "pytestmark" for t in n.targets)
           and (_is_serial_mark(n.value) or (isinstance(n.value, ast.List | ast.Tuple)
                                              and any(_is_serial_mark(e) for e in n.value.elts)))
           for n in tree.body):
        return []
    marked: list[tuple[int, int]] = []
    for n in tree.body:
        if isinstance(n, ast.FunctionDef) and any(_is_serial_mark(d) for d in n.decorator_list):
            marked.append((n.decorator_list[0].lineno, n.end_lineno))
    return [f"line {ln}: {code.strip()}" for ln, code in sorted(_code_lines(src).items())
            if STARTS.search(code) and not any(a <= ln <= b for a, b in marked)]


def test_the_scanner_finds_an_unmarked_start_and_accepts_both_marks():
    body = "def test_a(local_ray):\n    ray.init(address='auto')  # starts\n"
    assert unmarked_starts("import pytest\n\n\n" + body) == ["line 4: def test_a(local_ray):",
                                                             "line 5: ray.init(address='auto')"]
    assert unmarked_starts("import pytest\n\n\n@pytest.mark.serial\n" + body) == []
    assert unmarked_starts("import pytest\n\npytestmark = pytest.mark.serial\n\n\n" + body) == []
    assert unmarked_starts("import pytest\n\npytestmark = [pytest.mark.slow, pytest.mark.serial]\n\n" + body) == []
    assert unmarked_starts("# ray.init( in a comment\nx = 1\n") == []
    # a helper outside any marked test needs the module's mark
    helper = "def _ranks():\n    return ['torchrun', '--nproc_per_node', '2']\n\n\n@pytest.mark.serial\n" + body
    assert unmarked_starts(helper) == ["line 2: return ['torchrun', '--nproc_per_node', '2']"]


def test_every_test_that_starts_ray_or_meeting_processes_is_marked_serial():
    found = {p.name: unmarked_starts(p.read_text()) for p in sorted(TESTS.glob("test_*.py"))
             if p.name != Path(__file__).name}
    bad = {name: lines for name, lines in found.items() if lines}
    assert not bad, ("these start Ray or meeting processes without @pytest.mark.serial (or the module's "
                     f"`pytestmark = pytest.mark.serial`): {bad}")


def _pytest_on(tmp_path: Path, body: str, worker: str | None) -> tuple[int, str]:
    """Run pytest with this suite's conftest (as a plugin) and ini on one test file written to tmp_path."""
    import os
    import subprocess
    import sys

    (tmp_path / "test_probe.py").write_text("import pytest\n\n\n" + body)
    env = {k: v for k, v in os.environ.items() if k != "PYTEST_XDIST_WORKER"}
    if worker:
        env["PYTEST_XDIST_WORKER"] = worker
    root = TESTS.parent
    r = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "tests.conftest", "-p", "no:cacheprovider",
                        "-c", str(root / "pyproject.toml"), "--rootdir", str(root), str(tmp_path / "test_probe.py")],
                       cwd=root, env=env, capture_output=True, text=True, timeout=300)
    return r.returncode, r.stdout + r.stderr


def test_conftest_refuses_a_serial_test_on_a_worker_and_local_ray_unmarked(tmp_path):
    marked = "@pytest.mark.serial\ndef test_a():\n    pass\n"
    code, out = _pytest_on(tmp_path, marked, "gw0")
    assert code == pytest.ExitCode.USAGE_ERROR and "::test_a" in out and "-m serial" in out
    code, out = _pytest_on(tmp_path, marked, None)  # the serial pass, not on a worker: it runs
    assert code == pytest.ExitCode.OK, out
    code, out = _pytest_on(tmp_path, "def test_b(local_ray):\n    pass\n", None)
    assert code == pytest.ExitCode.USAGE_ERROR and "::test_b" in out and "local_ray" in out
