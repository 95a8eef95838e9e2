"""The sizes docs/architecture.md promises a reader: every module under specrl/ at most 400 lines, every folder at
most 10 modules (its `.py` files, `__init__.py` included), so a module can be read at once and a folder's names
scanned at a glance. Data folders (no `.py` files) do not count. The checkers are tested on a synthetic tree too,
so a rule test cannot pass because the checker looks nowhere."""

from __future__ import annotations

from pathlib import Path

ROOT = Path(__file__).resolve().parents[1] / "specrl"
MAX_LINES = 400
MAX_MODULES = 10


def long_modules(root: Path = ROOT, limit: int = MAX_LINES) -> list[str]:
    """'path: N lines' for every module of `root` longer than `limit` lines."""
    out = []
    for p in sorted(root.rglob("*.py")):
        n = len(p.read_text(encoding="utf-8").splitlines())
        if n > limit:
            out.append(f"{p.relative_to(root.parent)}: {n} lines")
    return out


def crowded_folders(root: Path = ROOT, limit: int = MAX_MODULES) -> list[str]:
    """'folder: N modules (names)' for every folder of `root` holding more than `limit` `.py` files."""
    folders: dict[Path, list[str]] = {}
    for p in root.rglob("*.py"):
        folders.setdefault(p.parent, []).append(p.name)
    return [f"{d.relative_to(root.parent)}: {len(names)} modules ({', '.join(sorted(names))})"
            for d, names in sorted(folders.items()) if len(names) > limit]


def test_every_module_is_at_most_400_lines():
    bad = long_modules()
    assert not bad, f"modules over {MAX_LINES} lines (split them by job):\n" + "\n".join(f"  {b}" for b in bad)


def test_every_folder_holds_at_most_10_modules():
    bad = crowded_folders()
    assert not bad, (f"folders over {MAX_MODULES} modules (give a job its own folder):\n"
                     + "\n".join(f"  {b}" for b in bad))


def test_the_checkers_see_a_long_module_and_a_crowded_folder(tmp_path):
    pkg = tmp_path / "pkg"
    (pkg / "sub").mkdir(parents=True)
    (pkg / "data").mkdir()
    for i in range(3):
        (pkg / f"m{i}.py").write_text("x = 1\n")
    (pkg / "sub" / "long.py").write_text("x = 1\n" * 5)
    (pkg / "data" / "table.json").write_text("{}")
    assert crowded_folders(pkg, limit=2) == ["pkg: 3 modules (m0.py, m1.py, m2.py)"]
    assert crowded_folders(pkg, limit=3) == []
    assert long_modules(pkg, limit=4) == ["pkg/sub/long.py: 5 lines"]
    assert long_modules(pkg, limit=5) == []
