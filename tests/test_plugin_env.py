"""Plugins reach every process: an entry point that failed to load is tried again, and a plugin named as a module
(or a `.py` file) reaches a Ray actor on another node through the runtime env the pipeline's actors are created
with (`specrl.cluster.plugin_env`), tested on a local two-node `ray.cluster_utils.Cluster` (loopback only)."""

from __future__ import annotations

import os
import sys
from types import SimpleNamespace

import pytest

from specrl.errors import SpecRLError

# `make test` runs this module alone, after its parallel part: it starts a local two-node Ray cluster.
pytestmark = pytest.mark.serial

PKG = '''
from specrl.algorithms.losses import LOSSES, register_loss


@register_loss("plugenv_pkg_loss", normalizer="tokens")
def plugenv_pkg_loss(logp, old_logp, advantages, mask, **kw):
    return LOSSES["dapo"].fn(logp, old_logp, advantages, mask, **kw)
'''
FILE = PKG.replace("plugenv_pkg_loss", "plugenv_file_loss") + '''

def plugenv_reward(prompt, completion, row):
    return float(len(completion))
'''


# ----------------------------------------------------------------------------- entry points
class _EntryPoint(SimpleNamespace):
    def load(self):
        self.calls.append(self.value)
        if self.fail:
            raise RuntimeError(f"{self.value} broken")


def test_an_entry_point_that_failed_is_tried_again_and_the_ones_after_it_load(monkeypatch):
    import specrl.plugins as plugins

    calls: list[str] = []
    eps = [_EntryPoint(name="a", value="a_ext:register", fail=False, calls=calls),
           _EntryPoint(name="b", value="b_ext:register", fail=True, calls=calls),
           _EntryPoint(name="c", value="c_ext:register", fail=False, calls=calls)]
    monkeypatch.setattr(plugins, "entry_points", lambda group: eps if group == plugins.ENTRY_POINT_GROUP else [])
    monkeypatch.setattr(plugins, "_entry_points_loaded", False)
    monkeypatch.setattr(plugins, "_entry_points_done", set())
    with pytest.raises(SpecRLError, match=r"plugin 'b' \(b_ext:register\).*RuntimeError"):
        plugins.load_plugins([])
    assert calls == ["a_ext:register", "b_ext:register"]
    with pytest.raises(SpecRLError, match="plugin 'b'"):  # not marked done: tried again, a not loaded twice
        plugins.load_plugins([])
    assert calls == ["a_ext:register", "b_ext:register", "b_ext:register"]
    eps[1].fail = False  # fixed (e.g. its dependency installed): the next call loads it and c
    plugins.load_plugins([])
    assert calls[3:] == ["b_ext:register", "c_ext:register"]
    plugins.load_plugins([])
    assert len(calls) == 5 and plugins._entry_points_loaded


# ----------------------------------------------------------------------------- the runtime env
@pytest.fixture
def sources(tmp_path, monkeypatch):
    """A package and a .py file outside the package and outside PYTHONPATH: importable in this process only."""
    pkg = tmp_path / "src" / "plugenv_pkg"
    pkg.mkdir(parents=True)
    (pkg / "__init__.py").write_text(PKG)
    f = tmp_path / "files" / "plugenv_file.py"
    f.parent.mkdir()
    f.write_text(FILE)
    monkeypatch.syspath_prepend(str(tmp_path / "src"))
    yield pkg, f
    from specrl.algorithms.losses import LOSSES

    for name in ("plugenv_pkg_loss", "plugenv_file_loss"):
        LOSSES.pop(name, None)
    for m in [m for m in sys.modules if m.startswith(("plugenv_pkg", "specrl_plugin_plugenv_file"))]:
        del sys.modules[m]


def test_the_runtime_env_carries_local_plugins_not_installed_ones(sources):
    from specrl.cluster.plugin_env import actor_options, plugin_runtime_env

    pkg, f = sources
    env = plugin_runtime_env({"plugins": ["plugenv_pkg", str(f), "yaml", "specrl.drafters"],
                              "reward": {"functions": ["plugenv_pkg:fn", "no_such_mod:fn", f"{f}:fn"]}})
    assert env == {"py_modules": [str(pkg.resolve()), str(f.resolve())]}  # yaml is installed, specrl is specrl
    assert actor_options({"plugins": []}, num_cpus=1) == {"num_cpus": 1}
    with pytest.raises(SpecRLError, match="cannot import module 'no_such_plugin'"):
        plugin_runtime_env({"plugins": ["no_such_plugin.ext"]})


@pytest.fixture
def two_nodes(monkeypatch):
    """Two Ray nodes on this machine, loopback only: Ray would otherwise turn 127.0.0.1 into the machine's
    outward address when connecting (`resolve_ip_for_localhost`), unreachable in a sandbox."""
    import ray
    from ray._private import ray_constants
    from ray.cluster_utils import Cluster

    monkeypatch.setenv(ray_constants.ENABLE_RAY_CLUSTERS_ENV_VAR, "0")  # the nodes' processes: loopback
    monkeypatch.setattr(ray_constants, "ENABLE_RAY_CLUSTER", False)  # this process: loopback
    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 1, "node_ip_address": "127.0.0.1",
                                                            "include_dashboard": False})
    try:
        assert cluster.address.startswith("127.0.0.1:")
        cluster.add_node(num_cpus=1, resources={"other_node": 1}, node_ip_address="127.0.0.1")
        ray.init(address=cluster.address, include_dashboard=False, log_to_driver=False, logging_level="ERROR",
                 _node_ip_address="127.0.0.1")
        assert len([n for n in ray.nodes() if n["Alive"]]) == 2
        yield ray
    finally:
        ray.shutdown()
        cluster.shutdown()


def test_a_module_and_a_file_plugin_reach_an_actor_on_another_node(sources, two_nodes):
    from specrl.cluster.plugin_env import actor_options

    ray = two_nodes
    pkg, f = sources

    @ray.remote(num_cpus=0)
    class Probe:
        def load(self, specs):
            from specrl.algorithms.losses import LOSSES
            from specrl.plugins import load_plugins

            try:
                load_plugins(specs)
            except SpecRLError as e:
                return ray.get_runtime_context().get_node_id(), str(e)
            return ray.get_runtime_context().get_node_id(), sorted(n for n in LOSSES if n.startswith("plugenv"))

        def reward(self, spec):
            from specrl.data.rewards import load_reward_fn

            try:
                return load_reward_fn(spec)("p", "abc", {})
            except SpecRLError as e:
                return str(e)

    here = ray.get_runtime_context().get_node_id()
    data = {"plugins": ["plugenv_pkg", str(f)], "reward": {"functions": [f"{f}:plugenv_reward"]}}
    opts = actor_options(data, resources={"other_node": 0.1})
    assert len(opts["runtime_env"]["py_modules"]) == 2 and opts["resources"] == {"other_node": 0.1}
    carried = Probe.options(**opts).remote()
    bare = Probe.options(resources={"other_node": 0.1}).remote()
    ray.get([carried.__ray_ready__.remote(), bare.__ray_ready__.remote()], timeout=120)
    # the driver's file is gone from "this node" once the actor started: the actor must use its carried copy
    f.rename(f.with_suffix(".moved"))
    node, got = ray.get(carried.load.remote(data["plugins"]), timeout=120)
    assert node != here and got == ["plugenv_file_loss", "plugenv_pkg_loss"]
    assert ray.get(carried.reward.remote(f"{f}:plugenv_reward"), timeout=120) == 3.0  # a reward file, too
    assert "plugenv_file.py does not exist" in ray.get(bare.reward.remote(f"{f}:plugenv_reward"), timeout=120)
    # without the runtime env the module is unknown there
    node, err = ray.get(bare.load.remote(["plugenv_pkg"]), timeout=120)
    assert node != here and "cannot import module 'plugenv_pkg'" in err
    node, err = ray.get(bare.load.remote([str(f)]), timeout=120)
    assert "plugenv_file.py does not exist" in err
    assert os.environ.get("PYTHONPATH", "").find(str(pkg.parent)) < 0
