"""Tests assert fields and facts, not sentences: `tools/sentence_asserts.py` finds no assert comparing a string of 5
or more words, no `pytest.raises(match=...)` of 5 or more words and no assert reading a line at a fixed position in
tests/. The checker is tested on synthetic code too, so the rule cannot pass because the checker sees nothing."""

from __future__ import annotations

from pathlib import Path

from tests.bench import load_tool

TOOL = Path(__file__).resolve().parents[1] / "tools" / "sentence_asserts.py"


def _tool():
    return load_tool("sentence_asserts")


def test_no_test_compares_a_sentence_or_a_line_position():
    tool = _tool()
    bad = [f"{p.relative_to(TOOL.parents[1])}:{line} {kind}"
           for p in sorted((TOOL.parents[1] / "tests").rglob("*.py")) for line, kind in tool.hits(p)]
    assert not bad, ("check the field or the fact (name, value, bound), not the sentence:\n"
                     + "\n".join(f"  {b}" for b in bad))


def test_the_checker_sees_sentences_matches_and_line_positions(tmp_path):
    src = tmp_path / "test_x.py"
    src.write_text(
        "import pytest\n"
        "def test_a(text, lines):\n"
        "    assert 'the run stopped after two steps' in text\n"           # sentence
        "    assert 'step 2' in text\n"                                    # a fact: fine
        "    assert lines[3] == 'x'\n"                                     # line position
        "    with pytest.raises(ValueError, match=r'must be one of a, b or c'):\n"  # sentence regex
        "        pass\n"
        "    with pytest.raises(ValueError, match=r'k.*>= 1'):\n"          # facts: fine
        "        pass\n")
    assert sorted(_tool().hits(src)) == [(3, "sentence"), (5, "line"), (6, "sentence")]
