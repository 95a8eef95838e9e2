"""`specrl.config` is a leaf: its modules import nothing from the layers that read the config (algorithms, backends,
rollout, drafters); the names those registries own are checked by `specrl.trainer.config_check` right after loading,
with the errors the config used to give."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from specrl.errors import SpecRLError
from specrl.trainer.config_check import check_config, load_config

CONFIG = Path(__file__).resolve().parents[1] / "specrl" / "config"
FORBIDDEN = ("specrl.algorithms", "specrl.backends", "specrl.rollout", "specrl.drafters")


def _imports(path: Path) -> list[tuple[str, int]]:
    out = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            out += [(a.name, node.lineno) for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            out.append((node.module, node.lineno))
    return out


def test_config_imports_none_of_the_layers_that_use_it():
    bad = [f"{p.name}:{line} imports {mod}" for p in sorted(CONFIG.glob("*.py")) for mod, line in _imports(p)
           if any(mod == f or mod.startswith(f + ".") for f in FORBIDDEN)]
    assert not bad, bad


def test_the_scanner_sees_an_upward_import(tmp_path):
    f = tmp_path / "x.py"
    f.write_text("def g():\n    from specrl.algorithms.losses import LOSSES\n")
    assert ("specrl.algorithms.losses", 2) in _imports(f)


@pytest.mark.parametrize("sets,path,msg", [
    (["grpo.loss_type=ppo"], "grpo.loss_type", "unknown loss 'ppo'"),
    (["rollout.backend=sglang"], "rollout.backend", "unknown rollout backend 'sglang'"),
    (["speculative.drafter=medusa"], "speculative.drafter", "unknown drafter kind 'medusa'"),
    (["speculative.drafter=ngram", "drafter.online=true"], "config", "drafter.online trains a learned drafter"),
    (["grpo.loss_type=dr_grpo", "grpo.normalize_rewards=true"], "grpo", "does not divide advantages"),
])
def test_registry_names_are_checked_at_load(sets, path, msg):
    with pytest.raises(SpecRLError) as e:
        load_config(None, sets)
    head, *lines = str(e.value).split("\n")
    assert head == f"invalid config with --set {' '.join(sets)}:"
    assert [line.strip().partition(": ")[0] for line in lines] == [path]
    assert any(msg in line for line in lines)  # the one line above, naming what was wrong


def test_check_fills_the_loss_clip_defaults_and_keeps_given_ones():
    from specrl.config.schema import validate_config

    raw = validate_config({"grpo": {"loss_type": "gspo", "clip_high": 0.001}})
    assert raw.grpo.clip_low is None  # the leaf leaves the loss's default to the loss registry
    checked = check_config(raw)
    assert (checked.grpo.clip_low, checked.grpo.clip_high) == (3e-4, 1e-3)
