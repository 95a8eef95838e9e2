"""`specrl draft build` for the parallel head and the recipe's loss: a tiny recipe of kind parallel builds, packages
and evaluates end to end; a killed ce+tv training resumes bit-identically; the TV term changes what is learned; a
build reads another build's rollouts and features when their data fields agree, and refuses them by name when not."""

import json
import re

import pytest
import torch

from specrl.drafters.training.build.recipe import Recipe
from specrl.errors import SpecRLError
from tests.test_draft_build import tiny_build


def _same_weights(a, b) -> bool:
    return all(torch.equal(x, y) for x, y in zip(a.state_dict().values(), b.state_dict().values(), strict=True))


def test_a_tiny_parallel_recipe_trains_packages_and_evaluates(tmp_path):
    from specrl.drafters.kinds.parallel import ParallelDrafter
    from specrl.drafters.storage.shipped import check_shipped, load_shipped
    from specrl.drafters.training.build.release import run_eval, run_package
    from specrl.drafters.training.build.stages import run_train

    model, recipe = tiny_build(tmp_path, kind="parallel", max_k=3)
    rec = run_train(recipe, tmp_path, model, progress=False)
    assert rec["finished"] and rec["steps"] == 6 and rec["loss_per_epoch"][-1] < rec["loss_per_epoch"][0]
    out = run_package(recipe, tmp_path, model)
    held = [[1, 30 + i, 7, 9] for i in range(2)]
    ev = run_eval(recipe, tmp_path, lambda tok: ([], held), model, ks=(1, 3), log=lambda *_: None)
    assert set(ev["acceptance_length"]) == {"1", "3"} and all(1 <= v <= 4 for v in ev["acceptance_length"].values())
    m = check_shipped(out, model)
    assert m["kind"] == "parallel" and m["recipe"]["kind"] == "parallel" and m["recipe"]["max_k"] == 3
    d = load_shipped("parallel", "package", model, root=tmp_path)
    assert isinstance(d, ParallelDrafter) and d.max_k == 3
    with pytest.raises(SpecRLError, match=r"kind 'mtp'.*eagle, parallel"):
        Recipe(name="x", kind="mtp")
    with pytest.raises(SpecRLError, match=r"loss.*ce\+tv.*'tv'"):
        Recipe(name="x", loss="tv")


def test_a_markov_parallel_recipe_trains_and_packages_its_mix_and_a_resume_keeps_the_setting(tmp_path):
    from specrl.drafters.storage.shipped import load_shipped
    from specrl.drafters.training.build.release import run_package
    from specrl.drafters.training.build.stages import run_train

    model, recipe = tiny_build(tmp_path, kind="parallel", max_k=3, markov=True)
    rec = run_train(recipe, tmp_path, model, progress=False)
    assert rec["finished"] and rec["loss_per_epoch"][-1] < rec["loss_per_epoch"][0]
    run_package(recipe, tmp_path, model)
    d = load_shipped("parallel", "package", model, root=tmp_path)
    assert d.config()["markov"] is True and d.markov.down.weight.abs().max() > 0  # the mix was trained
    with pytest.raises(SpecRLError, match="other settings.*markov"):
        run_train(Recipe(**{**recipe.as_dict(), "curve": (1, 2), "markov": False}), tmp_path, model, progress=False)
    with pytest.raises(SpecRLError, match=r"markov.*kind parallel.*'eagle'"):
        Recipe(name="x", markov=True)
    with pytest.raises(SpecRLError, match=r"markov.*'on'"):
        Recipe(name="x", kind="parallel", markov="on")


def test_a_killed_ce_tv_training_resumes_bit_identically_and_the_tv_term_is_trained(tmp_path):
    from specrl.drafters.storage.io import load_drafter
    from specrl.drafters.training.build.stages import run_train

    over = {"kind": "parallel", "max_k": 3, "loss": "ce+tv", "tv_weight": 2.0}
    model, recipe = tiny_build(tmp_path / "a", **over)
    full = run_train(recipe, tmp_path / "a", model, progress=False)
    tiny_build(tmp_path / "b", **over)
    part = run_train(recipe, tmp_path / "b", model, progress=False, stop_after=2)
    assert not part["finished"] and part["steps"] == 2
    rest = run_train(recipe, tmp_path / "b", model, progress=False, log=lambda *_: None)
    assert rest["resumed_from"] == 2 and rest["loss_per_epoch"] == full["loss_per_epoch"]
    a, b = (load_drafter(tmp_path / w / "train" / "drafter", model) for w in ("a", "b"))
    assert _same_weights(a, b)
    with pytest.raises(SpecRLError, match="other settings.*objective"):
        run_train(Recipe(**{**recipe.as_dict(), "curve": (1, 2), "loss": "ce"}), tmp_path / "b", model,
                  progress=False)
    with pytest.raises(SpecRLError, match="other settings.*max_k"):
        run_train(Recipe(**{**recipe.as_dict(), "curve": (1, 2), "max_k": 2}), tmp_path / "b", model, progress=False)
    tiny_build(tmp_path / "c", kind="parallel", max_k=3)  # the same data and seed, soft cross-entropy alone
    ce = run_train(Recipe(**{**recipe.as_dict(), "curve": (1, 2), "loss": "ce"}), tmp_path / "c", model,
                   progress=False)
    assert ce["loss_per_epoch"][0] < full["loss_per_epoch"][0]  # the ce+tv loss adds 2 * TV > 0
    assert not _same_weights(load_drafter(tmp_path / "c" / "train" / "drafter", model), a)


def test_a_build_reads_another_builds_data_when_the_data_fields_agree(tmp_path):
    from specrl.drafters.training.build.stages import data_root, link_data, run_features, run_rollouts, run_train

    model, eagle = tiny_build(tmp_path / "src")
    par = Recipe(**{**eagle.as_dict(), "curve": (1, 2), "name": "tiny-parallel", "kind": "parallel", "max_k": 2})
    assert par.hash() == eagle.hash()
    w = tmp_path / "par"
    with pytest.raises(SpecRLError, match="no build.json"):
        link_data(par, w, tmp_path / "nowhere")
    run_features(eagle, tmp_path / "src", model, progress=False)  # the source build: rollouts, then features
    link_data(par, w, tmp_path / "src")
    assert data_root(w) == (tmp_path / "src").resolve()
    (tmp_path / "src" / "features" / "feat-00001.safetensors").unlink()
    with pytest.raises(SpecRLError, match=r"feat-00001\.safetensors.*missing.*features"):
        run_train(par, w, model, progress=False)
    run_features(eagle, tmp_path / "src", model, progress=False)
    assert len(run_rollouts(par, w, prompts=None)) == 2  # a linked build generates nothing: it checks the shards
    rec = run_train(par, w, model, progress=False)
    assert rec["finished"] and (w / "train" / "drafter" / "config.json").exists()
    assert not (w / "rollouts").exists() and not (w / "features").exists()
    shard = tmp_path / "src" / "rollouts" / "shard-00001.jsonl"
    shard.rename(shard.with_suffix(".aside"))
    with pytest.raises(SpecRLError, match=r"shards \[1\].*--stage rollouts"):
        run_rollouts(par, w, prompts=None)
    other = Recipe(**{**par.as_dict(), "curve": (1, 2), "temperature": 0.5, "max_new_tokens": 10})
    with pytest.raises(SpecRLError, match=r"temperature 1\.0 .*max_new_tokens"):
        link_data(other, tmp_path / "par2", tmp_path / "src")
    with pytest.raises(SpecRLError, match=r"build directory itself"):
        link_data(eagle, tmp_path / "src", tmp_path / "src")


def test_the_cli_refuses_data_of_other_data_fields_before_any_work(tmp_path):
    from typer.testing import CliRunner

    from specrl.cli import app

    src = tmp_path / "src"
    src.mkdir()
    (src / "build.json").write_text(json.dumps({"recipe": {**Recipe.load("think").as_dict(), "prompts": 64},
                                                "data_hash": "0" * 64}))
    r = CliRunner().invoke(app, ["draft", "build", "--recipe", "think-parallel", "--work", str(tmp_path / "w"),
                                 "--data-from", str(src), "--stage", "train"])
    assert r.exit_code == 2 and re.search(r"prompts 64\b.*'think-parallel': 2816", r.output), r.output
