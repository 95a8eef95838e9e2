"""Count test asserts that compare a sentence or a fixed line position (tests assert fields and facts, not prose).

Parses every `tests/**/*.py` with `ast` and counts:
  sentence: a string literal of 5 or more words (split on whitespace) that is an operand of a comparison inside an
            `assert` (`"..." in text`, `text == "..."`, `not in`, `!=`), or the `match=` of `pytest.raises` /
            `pytest.warns` (a regex: its words are counted after dropping regex escapes);
  line:     an `assert` that reads a line list at a constant position: `x.splitlines()[k]` or `lines[k]` (a name
            ending in `lines`), k an integer constant (negative included).
f-strings count by their literal parts. It does not see a sentence built elsewhere and compared through a variable.
Prints each hit as path:line kind, then the totals; `--quiet` prints the totals only.
"""

from __future__ import annotations

import ast
import re
import sys
from pathlib import Path

MIN_WORDS = 5


def _text(node: ast.AST) -> str | None:
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        return node.value
    if isinstance(node, ast.JoinedStr):
        return " ".join(v.value for v in node.values if isinstance(v, ast.Constant) and isinstance(v.value, str))
    return None


def _words(s: str, regex: bool = False) -> int:
    if regex:
        s = re.sub(r"\\.", " ", s)
        s = re.sub(r"[\^$.*+?()\[\]{}|]", " ", s)
    return len([w for w in s.split() if any(c.isalnum() for c in w)])


def _const_int(node: ast.AST) -> bool:
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.USub):
        node = node.operand
    return isinstance(node, ast.Constant) and isinstance(node.value, int) and not isinstance(node.value, bool)


def _line_subscript(node: ast.AST) -> bool:
    if not (isinstance(node, ast.Subscript) and _const_int(node.slice)):
        return False
    v = node.value
    if isinstance(v, ast.Call) and isinstance(v.func, ast.Attribute) and v.func.attr == "splitlines":
        return True
    return isinstance(v, ast.Name) and v.id.lower().endswith("lines")


def hits(path: Path) -> list[tuple[int, str]]:
    tree = ast.parse(path.read_text(), str(path))
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Assert):
            for cmp in (n for n in ast.walk(node.test) if isinstance(n, ast.Compare)):
                operands = [cmp.left, *cmp.comparators]
                if any((t := _text(o)) is not None and _words(t) >= MIN_WORDS for o in operands):
                    out.append((node.lineno, "sentence"))
                    break
            if any(_line_subscript(n) for n in ast.walk(node.test)):
                out.append((node.lineno, "line"))
        elif (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
              and node.func.attr in ("raises", "warns")):
            for kw in node.keywords:
                t = _text(kw.value) if kw.arg == "match" else None
                if t is not None and _words(t, regex=True) >= MIN_WORDS:
                    out.append((node.lineno, "sentence"))
    return out


def main(argv: list[str]) -> int:
    root = Path(__file__).resolve().parent.parent / "tests"
    totals = {"sentence": 0, "line": 0}
    for path in sorted(root.rglob("*.py")):
        for line, kind in sorted(hits(path)):
            totals[kind] += 1
            if "--quiet" not in argv:
                print(f"{path.relative_to(root.parent)}:{line} {kind}")
    print(f"sentence asserts: {totals['sentence']}  line-position asserts: {totals['line']}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
