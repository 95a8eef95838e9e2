"""The learner contract (`specrl.trainer.protocol.LearnerProtocol`): every learner implements it, its defaults do
what a one-process learner needs, and the code that drives learners never asks which kind it holds."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest
import torch

from specrl.trainer.protocol import LearnerProtocol

ROOT = Path(__file__).resolve().parents[1]
DRIVERS = ("specrl/trainer", "specrl/cluster", "specrl/run")


class _Toy(LearnerProtocol):
    def __init__(self):
        self.step_count, self.log, self.policy = 3, print, torch.nn.Linear(2, 3)

    def learn(self, r, seconds):
        raise NotImplementedError

    def named_weights(self):
        return self.version, {"w": self.policy.weight}, None

    def check_weights(self, step):
        pass

    def state_parts(self):
        return {}

    def load_parts(self, parts, st):
        pass


def test_the_defaults_of_a_learner_holding_its_policy():
    toy, pushed = _Toy(), []

    class Sync:
        def push(self, version, policy, drafter=None):
            pushed.append((version, sorted(policy), drafter))

    toy.publish(Sync())
    assert pushed == [(3, ["w"], None)] and toy.version == 3
    assert toy.resident_parameters() == 9
    assert toy.close() is None


def test_a_learner_must_offer_the_whole_contract():
    class Half(LearnerProtocol):
        def learn(self, r, seconds):
            return None

    with pytest.raises(TypeError, match="abstract"):
        Half()


def test_every_learner_implements_the_contract():
    from specrl.cluster.learner_group import LearnerGroup
    from specrl.parallel.data_parallel import ShardedLearner
    from specrl.trainer.learner import Learner

    for cls in (Learner, ShardedLearner, LearnerGroup):
        assert issubclass(cls, LearnerProtocol) and not cls.__abstractmethods__, cls


def _asks_which_learner(node: ast.AST) -> bool:
    if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Name)):
        return False
    if node.func.id == "hasattr":
        return "learner" in ast.unparse(node.args[0]).lower()
    if node.func.id == "isinstance" and len(node.args) == 2:
        return "learner" in ast.unparse(node.args[1]).lower() or "learner" in ast.unparse(node.args[0]).lower()
    return False


def test_no_driver_asks_which_learner_it_holds():
    files = [p for d in DRIVERS for p in sorted((ROOT / d).rglob("*.py"))]
    bad = [f"{p.relative_to(ROOT)}:{n.lineno}: {ast.unparse(n)}" for p in files
           for n in ast.walk(ast.parse(p.read_text(encoding="utf-8"))) if _asks_which_learner(n)]
    assert not bad, "\n".join(bad)
    assert _asks_which_learner(ast.parse('hasattr(self.learner, "export")').body[0].value)
    assert _asks_which_learner(ast.parse("isinstance(self.learner, Learner)").body[0].value)
