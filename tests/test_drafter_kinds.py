"""No code outside the drafter-kind registry compares drafter-kind names (docs/extending.md, docs/architecture.md).

Every kind, built in or a user's, is a row of `specrl.rollout.drafter_spec.DRAFTER_KINDS`, which
`specrl.drafters` completes with each built-in kind's builder and class; what callers used to decide by a kind's
name is a column of that row or a method of the drafter's class. Every `.py` file under specrl/ is parsed with
`ast` (nothing is imported) and every comparison (`==`, `!=`, `in`, `not in`, `match ... case`) of a built-in
kind's name as a string literal is reported with its file and line, outside the registry modules. The checker
self-tests on synthetic snippets so it cannot pass vacuously. The built-in kinds then build, load and train
through the same rows a user's kind does.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from specrl.rollout.drafter_spec import BUILTIN_KINDS, DRAFTER_KINDS

ROOT = Path(__file__).resolve().parents[1]
# the modules that hold the table: the rows (and the spec parser) and the builders that complete them
REGISTRY = {"specrl/rollout/drafter_spec.py", "specrl/drafters/__init__.py", "specrl/drafters/registry.py"}
# the simulator's drafters have their own names (specrl.sim.costs.speculation.DRAFTERS: none, eagle3, mtp, draft-model,
# ngram), some spelled like kinds; a kind's row names the simulator drafter that prices it (`DrafterKind.sim`)
OWN_NAMES = ("specrl/sim/",)
# comparisons left in modules that another change is rewriting, as (file, source of the comparison); each entry is
# asserted to still be there, so a fixed one must leave this list


def _literals(node: ast.AST) -> list[str]:
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        return [node.value]
    if isinstance(node, (ast.Tuple, ast.List, ast.Set)):
        return [v for e in node.elts for v in _literals(e)]
    return []


def kind_comparisons(source: str, names: frozenset[str] | set[str] = BUILTIN_KINDS) -> list[tuple[int, str]]:
    """(line, source) of every comparison of one of `names` as a string literal in `source`."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Compare):
            ops_ok = all(isinstance(op, (ast.Eq, ast.NotEq, ast.In, ast.NotIn)) for op in node.ops)
            if ops_ok and any(set(_literals(side)) & set(names) for side in (node.left, *node.comparators)):
                found.append((node.lineno, ast.unparse(node)))
        elif isinstance(node, ast.Match):
            for case in node.cases:
                for pat in ast.walk(case.pattern):
                    if isinstance(pat, ast.MatchValue) and set(_literals(pat.value)) & set(names):
                        found.append((pat.lineno, f"case {ast.unparse(pat)}"))
    return sorted(found)


def offences(root: Path = ROOT) -> list[tuple[str, int, str]]:
    out = []
    for path in sorted((root / "specrl").rglob("*.py")):
        rel = path.relative_to(root).as_posix()
        if rel in REGISTRY or rel.startswith(OWN_NAMES):
            continue
        out += [(rel, line, src) for line, src in kind_comparisons(path.read_text(encoding="utf-8"))]
    return out


def test_no_code_outside_the_registry_compares_drafter_kind_names():
    bad = [f"  {f}:{line}: {s}" for f, line, s in offences()]
    assert not bad, ("code outside the drafter-kind registry compares kind names; read the kind's row "
                     "(parse_drafter_spec(spec).info, DRAFTER_KINDS) or call a method of the drafter's class "
                     "instead:\n" + "\n".join(bad))


def test_checker_catches_synthetic_kind_comparisons():
    bad = '''
if kind == "eagle":
    pass
ok = spec.kind in ("ngram", "suffix") or "mtp" != drafter.kind or cfg["kind"] not in ["draft-model"]
match spec.kind:
    case "hybrid":
        pass
'''
    got = kind_comparisons(bad)
    assert [line for line, _ in got] == [2, 4, 4, 4, 6], got
    clean = '''
if spec.info.vllm == "eagle3" or name == "eagles" or spec.info.drafts:
    pass
kinds = {"ngram": 1}  # a table keyed by a name is no comparison
x = "eagle" if flag else "mtp"
'''
    assert kind_comparisons(clean) == []
    assert kind_comparisons('k == "fixed"', {"fixed"}) == [(1, "k == 'fixed'")]


def test_every_builtin_kind_builds_through_its_row():
    import specrl.drafters  # noqa: F401  (completes the rows)

    assert BUILTIN_KINDS == {"none", "ngram", "suffix", "draft-model", "eagle", "mtp", "parallel", "hybrid"}
    for name in BUILTIN_KINDS:
        row = DRAFTER_KINDS[name]
        assert callable(row.build), name
        assert row.drafts == (name != "none")
    from specrl.drafters import make_drafter
    from specrl.drafters.kinds.ngram import NGramDrafter
    from specrl.drafters.kinds.suffix import SuffixDrafter

    assert make_drafter("none") is None and make_drafter(None) is None
    assert isinstance(make_drafter("ngram"), DRAFTER_KINDS["ngram"].drafter_class) and \
        DRAFTER_KINDS["ngram"].drafter_class is NGramDrafter
    assert DRAFTER_KINDS["suffix"].drafter_class is SuffixDrafter


def test_a_builtin_row_is_completed_once_and_not_redeclared():
    from dataclasses import replace

    import specrl.drafters  # noqa: F401
    from specrl.errors import SpecRLError
    from specrl.rollout.drafter_spec import register_drafter_kind

    row = DRAFTER_KINDS["ngram"]
    with pytest.raises(SpecRLError, match="'ngram' is already registered"):
        register_drafter_kind(replace(row, build=lambda spec, target, dtype: None))
    with pytest.raises(SpecRLError, match="'eagle' is already registered"):
        register_drafter_kind(replace(DRAFTER_KINDS["eagle"], vllm=None))
    assert DRAFTER_KINDS["ngram"] is row


def test_trainable_kinds_train_build_and_save_through_their_class():
    """The columns and methods that replaced name checks: draft init's kinds, the directory kinds and their
    oldest format, the vLLM export's kinds."""
    from specrl.drafters.storage.export import exports
    from specrl.drafters.storage.io import directory_kinds, min_format_version
    from specrl.drafters.training.build.from_rollouts import build_kinds

    assert list(build_kinds()) == ["eagle", "mtp", "draft-model", "parallel"]
    assert sorted(directory_kinds()) == ["eagle", "mtp", "parallel"]
    assert (min_format_version("eagle"), min_format_version("mtp"), min_format_version(None)) == (2, 1, 1)
    assert min_format_version("parallel") == 2
    assert [k for k in DRAFTER_KINDS if exports(k)] == ["eagle"]
