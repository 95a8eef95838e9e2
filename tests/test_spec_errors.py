"""Bad speculative-decoding input gets a clear error."""

import json
import re

import pytest

from specrl import RolloutEngine
from specrl.drafters import EMBEDDED_NAMES, DraftModelDrafter, NGramDrafter, make_drafter
from specrl.drafters.storage.shipped import shipped_dir
from specrl.errors import SpecRLError
from specrl.model.transformer import tiny_model


@pytest.fixture(scope="module")
def target():
    return tiny_model("llama", vocab_size=64)


@pytest.mark.parametrize("k", [-1, 8, 2.5, "three"])
def test_bad_num_draft_tokens(target, k):
    with pytest.raises(SpecRLError, match=r"num_draft_tokens.*0\.\.7.*'auto'"):
        RolloutEngine(target, max_seq_len=64, drafter=NGramDrafter(), num_draft_tokens=k)


def test_unknown_verify_mode(target):
    with pytest.raises(SpecRLError, match=r"verify='exact'.*\['rejection', 'seed_exact'\]"):
        RolloutEngine(target, max_seq_len=64, drafter=NGramDrafter(), verify="exact")


def test_draft_model_vocab_mismatch(target):
    with pytest.raises(SpecRLError, match=r"vocab size 32\b.*\b64\b"):
        RolloutEngine(target, max_seq_len=64, drafter=DraftModelDrafter(tiny_model("llama", vocab_size=32)))


def test_unknown_drafter_spec_and_missing_paths(target, tmp_path):
    with pytest.raises(SpecRLError, match="unknown drafter 'medusa'"):
        make_drafter("medusa", target)
    with pytest.raises(SpecRLError, match="does not exist"):
        make_drafter(f"draft-model:{tmp_path}/nope", target)
    with pytest.raises(SpecRLError, match="does not exist"):
        make_drafter(f"eagle:{tmp_path}/nope", target)


def test_default_drafter_of_another_model_says_how_to_build_one(target, tmp_path, monkeypatch):
    monkeypatch.setenv("SPECRL_HOME", str(tmp_path))
    with pytest.raises(SpecRLError, match=r"smollm2-135m.*draft init.*eagle"):
        make_drafter("eagle:default", target)
    assert not (tmp_path / "drafters").exists()  # nothing was built for the wrong model


def test_embedded_model_shape_is_recognised():
    from types import SimpleNamespace

    from specrl.drafters import _is_embedded
    from specrl.model.transformer import ModelArgs

    assert _is_embedded(SimpleNamespace(args=ModelArgs(vocab_size=49152)))  # SmolLM2-135M: build its default
    assert not _is_embedded(SimpleNamespace(args=ModelArgs(vocab_size=49152, num_layers=12)))


def test_default_drafter_is_built_once_and_atomically(tmp_path, monkeypatch):
    import specrl.drafters.storage.default as dd
    import specrl.drafters.training.build.from_rollouts as build

    monkeypatch.setenv("SPECRL_HOME", str(tmp_path))
    calls = []

    def fake_build(model, kind, prompts, samples, epochs, out, max_new_tokens, temperature, progress, source):
        calls.append((model, kind, source, samples, epochs, max_new_tokens, temperature))
        assert callable(prompts)  # the task's prompts, rendered once the builder has the tokenizer
        assert ".building-" in str(out)  # written beside the final directory, renamed when complete
        out.mkdir(parents=True)
        (out / "config.json").write_text(json.dumps({"kind": kind, "format_version": 2}))
        return out

    monkeypatch.setattr(build, "train_drafter_offline", fake_build)
    path = dd.ensure_default_drafter("mtp", progress=False)
    assert path == dd.default_drafter_dir("mtp") and (path / "config.json").exists()
    assert calls == [("smollm2-135m", "mtp", "chain_sum (number)", dd.DEFAULT_BUILD["samples"],
                      dd.DEFAULT_BUILD["epochs"], 64, 1.0)]
    assert dd.ensure_default_drafter("mtp", progress=False) == path and len(calls) == 1  # cached
    think = dd.ensure_default_drafter("mtp", "think", progress=False)  # the long-reasoning workload's own
    assert think == dd.default_drafter_dir("mtp", "think") != path
    assert calls[-1] == ("smollm2-135m", "mtp", "chain_sum (reasoning)", 320, 3, 512, 0.7)
    n = len(calls)  # eagle:think and eagle:default ship in the package: verified and used, never built
    assert dd.ensure_default_drafter("eagle", "think", progress=False) == shipped_dir("think") and len(calls) == n
    assert dd.ensure_default_drafter("eagle", progress=False) == shipped_dir("default") and len(calls) == n
    with pytest.raises(SpecRLError, match=rf"'thinking'.*allowed: {', '.join(EMBEDDED_NAMES)}"):
        dd.default_drafter_dir("eagle", "thinking")
    assert sorted(p.name for p in path.parent.iterdir()) == sorted([path.name, think.name])  # no temporary dirs
    with pytest.raises(SpecRLError, match="no default 'ngram' drafter"):
        dd.ensure_default_drafter("ngram")


def test_default_drafter_built_with_another_recipe_is_rebuilt(tmp_path, monkeypatch, capsys):
    import specrl.drafters.storage.default as dd
    import specrl.drafters.training.build.from_rollouts as build

    monkeypatch.setenv("SPECRL_HOME", str(tmp_path))
    seen = []

    def fake_build(model, kind, prompts, samples, epochs, out, max_new_tokens, temperature, progress, source):
        seen.append(epochs)
        out.mkdir(parents=True)
        (out / "config.json").write_text(json.dumps({"kind": kind, "format_version": 2}))
        return out

    monkeypatch.setattr(build, "train_drafter_offline", fake_build)
    epochs = seen
    path = dd.ensure_default_drafter("mtp", "think", progress=False)  # (eagle:think ships: it is never built)
    assert json.loads((path / dd.RECIPE_FILE).read_text()) == dd.DEFAULT_BUILDS["think"]
    assert dd.ensure_default_drafter("mtp", "think", progress=False) == path and epochs == [3]  # current: kept
    built_with = dd.DEFAULT_BUILDS["think"]
    monkeypatch.setitem(dd.DEFAULT_BUILDS, "think", {**built_with, "epochs": 8})
    assert dd.ensure_default_drafter("mtp", "think", progress=False) == path and epochs == [3, 8]
    out = capsys.readouterr().out
    old, new = json.dumps(built_with), json.dumps(dd.DEFAULT_BUILDS["think"])
    assert re.search(rf"mtp:think\b.*{re.escape(old)}.*{re.escape(new)}.*rebuilding", out)
    (path / dd.RECIPE_FILE).unlink()  # a cache from a specrl that recorded no recipe
    dd.ensure_default_drafter("mtp", "think", progress=False)
    assert epochs == [3, 8, 8] and re.search(r"unrecorded recipe.*rebuilding", capsys.readouterr().out)
    # an EAGLE head of drafter format 1 (the layer before EAGLE-3's) under the current recipe: rebuilt (where
    # the package ships no eagle:default; it does, so its absence is simulated)
    import specrl.drafters.storage.shipped as shipped

    monkeypatch.setattr(shipped, "is_shipped", lambda kind, name, root=None: False)
    path = dd.ensure_default_drafter("eagle", "default", progress=False)
    (path / "config.json").write_text(json.dumps({"kind": "eagle", "format_version": 1}))
    dd.ensure_default_drafter("eagle", "default", progress=False)
    assert epochs == [3, 8, 8, 3, 3] and re.search(r"eagle:default\b.*format 1\b.*format 2\b.*rebuilding",
                                                   capsys.readouterr().out)
    left = sorted(p.name for p in path.parent.iterdir())
    assert left == sorted([path.name, dd.default_drafter_dir("mtp", "think").name])  # no temporary directory


def test_interrupted_default_build_leaves_no_default(tmp_path, monkeypatch):
    import specrl.drafters.storage.default as dd
    import specrl.drafters.training.build.from_rollouts as build

    monkeypatch.setenv("SPECRL_HOME", str(tmp_path))

    def failing_build(model, kind, prompts, samples, epochs, out, max_new_tokens, temperature, progress, source):
        out.mkdir(parents=True)
        raise KeyboardInterrupt

    monkeypatch.setattr(build, "train_drafter_offline", failing_build)
    with pytest.raises(KeyboardInterrupt):
        dd.ensure_default_drafter("mtp", progress=False)
    assert not dd.default_drafter_dir("mtp").exists()


def test_unbuilt_default_drafter_says_how_to_build_it_or_is_built_on_demand(tmp_path, monkeypatch):
    from types import SimpleNamespace

    from specrl.model.transformer import ModelArgs

    monkeypatch.setenv("SPECRL_HOME", str(tmp_path))
    embedded = SimpleNamespace(args=ModelArgs(vocab_size=49152))
    with pytest.raises(SpecRLError, match=r"not built.*--drafter mtp"):
        make_drafter("mtp:default", embedded)
    assert not (tmp_path / "drafters").exists()
    built = []

    def build_default(kind, name):
        built.append((kind, name))
        raise SpecRLError("stop here")  # a real builder returns the directory; loading it is tested elsewhere

    with pytest.raises(SpecRLError, match="stop here"):
        make_drafter("mtp:default", embedded, build_default=build_default)
    with pytest.raises(SpecRLError, match=r"not built.*--drafter mtp:think"):
        make_drafter("mtp:think", embedded)
    with pytest.raises(SpecRLError, match="stop here"):
        make_drafter("mtp:think", embedded, build_default=build_default)
    assert built == [("mtp", "default"), ("mtp", "think")]
