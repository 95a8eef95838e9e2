"""Every page under docs/ opens with what it shows in five lines: right after its `# title`, one block (no blank
line inside) that is a paragraph of at most 5 lines, or a lead-in line ending in ':' and at most 5 bullets. The
test names the page and what its opening holds, so a page that starts with a table, a heading or a long preamble is
caught."""

from __future__ import annotations

from pathlib import Path

import pytest

DOCS = sorted((Path(__file__).resolve().parents[1] / "docs").glob("*.md"))


def opening(text: str) -> list[str]:
    """The lines of the block that follows the page's title (up to the next blank line)."""
    lines = text.splitlines()
    if not lines or not lines[0].startswith("# "):
        raise AssertionError("the page does not start with a '# ' title")
    rest = lines[1:]
    while rest and not rest[0].strip():
        rest = rest[1:]
    block = []
    for line in rest:
        if not line.strip():
            break
        block.append(line)
    return block


def problem(block: list[str]) -> str | None:
    """Why `block` is not a five-line opening, or None."""
    if not block:
        return "nothing follows the title"
    first = block[0].lstrip()
    if first.startswith(("#", "|", "```", "<")):
        return f"it opens with {first[:20]!r}, not a summary"
    bullets = [b for b in block[1:] if b.startswith("- ")]
    if block[0].endswith(":") and len(bullets) == len(block) - 1:
        return None if 1 <= len(bullets) <= 5 else f"a lead-in and {len(bullets)} bullets (at most 5)"
    if any(b.startswith(("- ", "* ", "1. ")) for b in block):
        return "bullets without a lead-in line ending in ':', or lines that are not bullets among them"
    return None if len(block) <= 5 else f"a paragraph of {len(block)} lines (at most 5)"


@pytest.mark.parametrize("page", DOCS, ids=lambda p: p.name)
def test_page_opens_with_what_it_shows_in_five_lines(page):
    assert problem(opening(page.read_text(encoding="utf-8"))) is None, page.name


def test_the_rule_rejects_what_it_should():
    assert problem([]) == "nothing follows the title"
    assert problem(["| a | b |"]) is not None
    assert problem(["line"] * 6) is not None and problem(["line"] * 5) is None
    assert problem(["In short:"] + ["- x"] * 6) is not None and problem(["In short:"] + ["- x"] * 5) is None
    assert problem(["- x", "- y"]) is not None
