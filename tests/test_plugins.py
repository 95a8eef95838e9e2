"""Users' extensions reach every process: a loss, a drafter kind and a reward function registered in a module
outside the package (named in the config's `plugins`) train a step in the async pipeline's Ray actors and on two
learner ranks, and a plugin that cannot be imported is a clear error."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest
import yaml

from specrl.errors import SpecRLError
from tests.test_rl_trainer import cfg_dict
from tests.tiny import make_tiny_checkpoint

# `make test` runs this module alone, after its parallel part:
# it starts a local Ray, async actors and two learner ranks.
pytestmark = pytest.mark.serial

PLUGIN = '''
import os
from pathlib import Path

from specrl.drafters import register_drafter
from specrl.drafters.base import Drafter, Proposal, pad_proposals
from specrl.algorithms.losses import LOSSES, register_loss

CALLS = Path(__file__).with_suffix(".calls")


class PluginDrafter(Drafter):
    kind = "plugfixed"

    def __init__(self, token):
        self.token = token

    def propose(self, batch, k):
        with CALLS.open("a") as f:
            f.write(f"drafter {os.getpid()}\\n")
        return Proposal(pad_proposals([[self.token] * k for _ in batch.tokens], k))


register_drafter("plugfixed", lambda spec, target, dtype: PluginDrafter(int(spec.arg)), arg="TOKEN")


@register_loss("plugin_dapo", normalizer="tokens")
def plugin_dapo(logp, old_logp, advantages, mask, **kw):
    with CALLS.open("a") as f:
        f.write(f"loss {os.getpid()}\\n")
    return LOSSES["dapo"].fn(logp, old_logp, advantages, mask, **kw)


def plugin_reward(prompt, completion, row):
    return float(len(completion) % 5)
'''


@pytest.fixture
def plugin(tmp_path):
    from specrl.algorithms.losses import LOSSES
    from specrl.rollout.drafter_spec import DRAFTER_KINDS, unregister_drafter_kind

    path = tmp_path / "my_ext.py"
    path.write_text(PLUGIN)
    yield path
    if "plugfixed" in DRAFTER_KINDS:
        unregister_drafter_kind("plugfixed")
    LOSSES.pop("plugin_dapo", None)
    for name in [m for m in sys.modules if m.startswith("specrl_plugin_my_ext")]:
        del sys.modules[name]


def _run(tmp_path, plugin, name, **over) -> tuple[Path, dict[str, set[int]]]:
    from specrl.cluster import make_trainer
    from specrl.observability.metrics import read_jsonl
    from specrl.run.loop import train_main

    tiny = make_tiny_checkpoint(tmp_path / "ckpt", seed=0)
    d = cfg_dict(tiny, **{"grpo__loss_type": "plugin_dapo", "grpo__val_every": 0,
                          "speculative__drafter": "plugfixed:7", "speculative__num_draft_tokens": 2,
                          "reward__functions": [f"{plugin}:plugin_reward"], "run__steps": 1, "run__name": name,
                          "run__checkpoint_every": 0, "learner__collective_timeout_s": 20.0, **over})
    d["plugins"] = [str(plugin)]
    cfg = tmp_path / f"{name}.yaml"
    cfg.write_text(yaml.safe_dump(d))
    run = train_main(str(cfg), [], None, str(tmp_path / name), make_trainer=make_trainer)
    calls: dict[str, set[int]] = {}
    for line in plugin.with_suffix(".calls").read_text().split("\n"):
        if line:
            what, pid = line.split()
            calls.setdefault(what, set()).add(int(pid))
    rec, = read_jsonl(run / "metrics.jsonl")
    assert rec["step"] == 1 and any("plugin_reward" in n for n in rec["reward_components"]), rec
    assert rec["acceptance_length"] is not None  # the plugin's drafts were verified
    return run, calls


def test_a_plugin_trains_in_the_async_pipelines_actors(tmp_path, plugin, local_ray):
    _, calls = _run(tmp_path, plugin, "async", pipeline__mode="async", pipeline__max_trajectory_age_steps=0)
    # the rollout worker drafted and the learner actor computed the loss, both in processes other than this one
    assert calls["drafter"] and os.getpid() not in calls["drafter"]
    assert calls["loss"] and os.getpid() not in calls["loss"]


def test_a_plugin_trains_on_two_learner_ranks(tmp_path, plugin, local_ray):
    _, calls = _run(tmp_path, plugin, "ranks", speculative__drafter="plugfixed:7", learner__world_size=2)
    assert len(calls["loss"] - {os.getpid()}) == 2  # each rank imported the plugin and ran its loss


def test_a_plugin_that_cannot_be_imported_is_named(tmp_path):
    from specrl.trainer.config_check import load_config

    with pytest.raises(SpecRLError, match="cannot import module 'no_such_ext'"):
        load_config(None, ["plugins=[no_such_ext]"])
    with pytest.raises(SpecRLError, match=r"missing\.py.*not exist"):
        load_config(None, [f"plugins=[{tmp_path / 'missing.py'}]"])
    bad = tmp_path / "broken.py"
    bad.write_text("raise RuntimeError('boom')\n")
    with pytest.raises(SpecRLError, match=r"broken\.py.*RuntimeError: boom"):
        load_config(None, [f"plugins=[{bad}]"])
    with pytest.raises(SpecRLError, match="unknown loss 'plugin_dapo'"):  # without the plugin the name is unknown
        load_config(None, ["grpo.loss_type=plugin_dapo"])
