"""Every module a package docstring names exists: a `name.py` or `folder/` in backticks is looked up in that package,
a dotted `specrl.a.b[.attr]` from the repository root (its last part may be a name the module defines). Packages
move; their docstrings must follow, and this test says which one did not."""

from __future__ import annotations

import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = sorted(p.parent for p in (ROOT / "specrl").rglob("__init__.py") if "data" not in p.parent.parts[-1:])


def _module_path(dotted: str) -> Path | None:
    base = ROOT.joinpath(*dotted.split("."))
    for cand in (base.with_suffix(".py"), base / "__init__.py"):
        if cand.is_file():
            return cand
    return None


def named(doc: str) -> tuple[list[str], list[str]]:
    """(files and folders relative to the package, dotted specrl names) that `doc` names in backticks."""
    ticks = re.findall(r"`([^`\s]+)`", doc)
    local = [t for t in ticks if re.fullmatch(r"[a-z_][a-z0-9_]*(/[a-z_][a-z0-9_]*)*(\.py|/)", t)]
    dotted = [m for t in ticks for m in [re.match(r"specrl(\.[a-z_][a-z0-9_]*)+", t)] if m]
    return local, [m.group(0) for m in dotted]


def missing(pkg: Path) -> list[str]:
    doc = ast.get_docstring(ast.parse((pkg / "__init__.py").read_text(encoding="utf-8"))) or ""
    local, dotted = named(doc)
    out = [f"{t} (no such file or folder in {pkg.relative_to(ROOT)})" for t in local if not (pkg / t).exists()]
    for name in dotted:
        parts = name.split(".")
        for n in range(len(parts), 0, -1):
            found = _module_path(".".join(parts[:n]))
            if found is not None:
                break
        rest = parts[n:]
        # after the longest module: at most one name, which the module must define (or re-export lazily)
        if len(rest) > 1 or (rest and not re.search(rf"\b{rest[0]}\b", found.read_text(encoding="utf-8"))):
            out.append(f"{name} (no such module or name)")
    return out


def test_every_module_a_package_docstring_names_exists():
    bad = [f"{pkg.relative_to(ROOT)}/__init__.py names {m}" for pkg in PACKAGES for m in missing(pkg)]
    assert not bad, "\n".join(bad)


def test_the_checker_catches_a_moved_module(tmp_path):
    assert named("owns `api.py` and `verify.py`, `spec_decode/`, see `specrl.rl` and `specrl.x.y`")[0] == \
        ["api.py", "verify.py", "spec_decode/"]
    pkg = ROOT / "specrl" / "rollout"
    assert not (pkg / "api.py").exists()  # the module that rollout's docstring used to name
    assert _module_path("specrl.rl") is None and _module_path("specrl.rollout.protocol") is not None
