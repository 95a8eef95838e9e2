"""The resumable drafter build: checked rollout shards, resume after a kill, recipes that name what is wrong."""

import json

import pytest

from specrl.drafters.training.build.recipe import Recipe
from specrl.drafters.training.build.shards import (
    CorruptShard,
    check_shard,
    collect_rollouts,
    read_shard,
    shard_path,
    write_shard,
)
from specrl.errors import SpecRLError
from specrl.model.transformer import tiny_model
from specrl.rollout.sampling import SamplingParams


def rows(n, lo=0):
    return [{"id": lo + i, "prompt_ids": [1, 2, 3], "response_ids": list(range(4, 4 + i + 1)), "finish": "stop"}
            for i in range(n)]


def test_a_shard_round_trips_and_any_damage_is_named(tmp_path):
    info = write_shard(tmp_path, 0, rows(3))
    p = shard_path(tmp_path, 0)
    assert check_shard(p, 3) == info and [r["id"] for r in read_shard(p)] == [0, 1, 2]
    with pytest.raises(CorruptShard, match="expects 4"):
        check_shard(p, 4)
    raw = p.read_bytes()
    p.write_bytes(raw.replace(b'"id":1', b'"id":7'))
    with pytest.raises(CorruptShard, match="sha256"):
        check_shard(p)
    p.write_bytes(raw[: len(raw) // 2])
    with pytest.raises(CorruptShard, match="footer"):
        check_shard(p)


def test_a_killed_build_resumes_without_duplicating_or_redrawing_a_shard(tmp_path):
    model = tiny_model("llama", vocab_size=64, seed=0)
    prompts = [[1, 5 + i, 7] for i in range(7)]
    sp = SamplingParams(temperature=1.0, max_new_tokens=5, seed=3)
    full = collect_rollouts(model, prompts, tmp_path / "a", sp, shard_size=3, progress=False)
    assert [s.rows for s in full] == [3, 3, 1]
    # a build killed after its first shard, then resumed; and a shard damaged on disk, rebuilt
    part = collect_rollouts(model, prompts[:3], tmp_path / "b", sp, shard_size=3, progress=False)
    assert len(part) == 1
    resumed = collect_rollouts(model, prompts, tmp_path / "b", sp, shard_size=3, progress=False)
    assert [s.sha256 for s in resumed] == [s.sha256 for s in full]
    shard_path(tmp_path / "b", 1).write_text("garbage\n")
    logged = []
    again = collect_rollouts(model, prompts, tmp_path / "b", sp, shard_size=3, progress=False, log=logged.append)
    assert [s.sha256 for s in again] == [s.sha256 for s in full]
    assert len(logged) == 1 and "shard-00001" in logged[0]
    ids = [r["id"] for i in range(3) for r in read_shard(shard_path(tmp_path / "b", i))]
    assert ids == list(range(7))
    with pytest.raises(SpecRLError, match="another recipe"):
        collect_rollouts(model, prompts[:3], tmp_path / "b", sp, shard_size=3, progress=False)


def test_recipes_name_wrong_and_unknown_fields(tmp_path):
    assert Recipe.load("think").temperature == 0.7
    bad = tmp_path / "r.json"
    bad.write_text(json.dumps({"name": "x", "epoch": 3}))
    with pytest.raises(SpecRLError, match="unknown field.*epoch"):
        Recipe.load(bad)
    bad.write_text(json.dumps({"name": "x", "train_dtype": "fp8"}))
    with pytest.raises(SpecRLError, match=r"train_dtype.*float32.*bfloat16.*'fp8'"):
        Recipe.load(bad)
    bad.write_text(json.dumps({"name": "x", "temperature": 0}))
    with pytest.raises(SpecRLError, match="temperature must be > 0"):
        Recipe.load(bad)
    with pytest.raises(SpecRLError, match="no recipe file"):
        Recipe.load(tmp_path / "missing.json")
    assert Recipe(name="a").hash() != Recipe(name="a", temperature=0.5).hash()
    assert Recipe(name="a").hash() == Recipe(name="a", epochs=9).hash()  # training settings keep the data


def tiny_build(tmp_path, **over):
    """A tiny model's rollouts in a build directory, as the rollouts stage leaves them."""
    model = tiny_model("llama", vocab_size=64, seed=0, num_layers=5)
    recipe = Recipe(name="tiny", prompts=6, shard_size=3, heldout_prompts=2, max_new_tokens=12, temperature=1.0,
                    draft_vocab_size=24, target_topk=8, epochs=2, batch_size=2, curve=(1, 2), **over)
    prompts = [[1, 5 + i, 7, 9] for i in range(recipe.prompts)]
    sp = SamplingParams(temperature=recipe.temperature, max_new_tokens=recipe.max_new_tokens, seed=recipe.seed)
    collect_rollouts(model, prompts, tmp_path / "rollouts", sp, recipe.shard_size, progress=False)
    return model, recipe


def test_features_are_reused_only_for_their_shard_and_a_damaged_file_is_extracted_again(tmp_path):
    from specrl.drafters.training.build.features import feature_path, load_features
    from specrl.drafters.training.build.stages import run_features

    model, recipe = tiny_build(tmp_path)
    feats = run_features(recipe, tmp_path, model, progress=False)
    assert [f.rows for f in feats] == [3, 3]
    sf = load_features(feature_path(tmp_path / "features", 1))
    rows = list(read_shard(shard_path(tmp_path / "rollouts", 1)))
    assert sf.offsets.tolist()[-1] == sum(len(r["prompt_ids"]) + len(r["response_ids"]) for r in rows)
    assert sf.feats.shape == (sf.tokens.numel(), 3 * model.args.hidden_size)
    assert sf.loss_from.tolist() == [len(r["prompt_ids"]) for r in rows]
    before = feature_path(tmp_path / "features", 0).stat().st_mtime_ns
    feature_path(tmp_path / "features", 1).write_bytes(b"damaged")
    logged = []
    from specrl.drafters.training.build.features import extract_features
    from specrl.drafters.training.build.stages import whole_shards

    extract_features(model, tmp_path / "rollouts", tmp_path / "features", whole_shards(recipe, tmp_path),
                     (0, 2, 3), 8, progress=False, log=logged.append)  # other layers: both files are redone
    assert len(logged) == 2
    run_features(recipe, tmp_path, model, progress=False)
    assert feature_path(tmp_path / "features", 0).stat().st_mtime_ns != before
    assert load_features(feature_path(tmp_path / "features", 1)).tokens.tolist() == sf.tokens.tolist()


def test_a_killed_training_resumes_from_its_checkpoint_and_ends_where_an_unbroken_one_does(tmp_path):
    import torch

    from specrl.drafters.storage.io import load_drafter
    from specrl.drafters.training.build.stages import run_train

    model, recipe = tiny_build(tmp_path / "a")
    full = run_train(recipe, tmp_path / "a", model, progress=False)
    assert full["finished"] and full["steps"] == 6 and full["vocab"]["size"] == 24
    assert 0 < full["vocab"]["coverage"] <= 1
    # one and two of two shards' worth of epoch 1, then the end of epoch 2
    assert [(s["shards"], s["step"]) for s in full["snapshots"]] == [(1, 2), (2, 3), (-2, 6)]
    _, _ = tiny_build(tmp_path / "b")
    part = run_train(recipe, tmp_path / "b", model, progress=False, stop_after=2)
    assert not part["finished"] and part["steps"] == 2 and not (tmp_path / "b" / "train" / "drafter").exists()
    # a life killed after its checkpoint writes no stage record: its seconds are the checkpoint's
    ck = tmp_path / "b" / "train" / "checkpoint.pt"
    state = torch.load(ck, weights_only=True)
    torch.save({**state, "seconds": 1000.0}, ck)
    (tmp_path / "b" / "train" / "stage.json").unlink()
    logged = []
    rest = run_train(recipe, tmp_path / "b", model, progress=False, log=logged.append)
    assert rest["resumed_from"] == 2 and rest["finished"] and any("resuming" in m for m in logged)
    built = json.loads((tmp_path / "b" / "build.json").read_text())
    assert rest["seconds"] > 1000.0 and built["stage_seconds"]["train"] == rest["seconds"]
    assert rest["setup_seconds"] > 0.0
    assert rest["loss_per_epoch"] == full["loss_per_epoch"]
    a = load_drafter(tmp_path / "a" / "train" / "drafter", model)
    b = load_drafter(tmp_path / "b" / "train" / "drafter", model)
    for (n, x), (_, y) in zip(a.state_dict().items(), b.state_dict().items(), strict=True):
        assert torch.equal(x, y), n
    with pytest.raises(SpecRLError, match="other settings.*epochs"):
        run_train(Recipe(**{**recipe.as_dict(), "curve": (1, 2), "epochs": 3}), tmp_path / "b", model,
                  progress=False)
    # bf16 autocast (the shipped think recipe's train_dtype) trains too, into its own directory
    _, _ = tiny_build(tmp_path / "c")
    bf = run_train(Recipe(**{**recipe.as_dict(), "curve": (1, 2), "train_dtype": "bfloat16"}), tmp_path / "c",
                   model, progress=False)
    assert bf["finished"] and bf["loss_per_epoch"][-1] < bf["loss_per_epoch"][0]
    assert bf["loss_per_epoch"] != full["loss_per_epoch"]


def test_package_then_eval_writes_a_verified_manifest_with_the_heldout_figures(tmp_path):
    from specrl.drafters.storage.shipped import check_shipped, load_shipped
    from specrl.drafters.training.build.release import run_eval, run_package

    model, recipe = tiny_build(tmp_path)
    from specrl.drafters.training.build.stages import run_train

    run_train(recipe, tmp_path, model, progress=False)
    out = run_package(recipe, tmp_path, model)
    held = [[1, 30 + i, 7, 9] for i in range(2)]  # prompts the build never rolled out
    ev = run_eval(recipe, tmp_path, lambda tok: ([], held), model, ks=(1, 3), log=lambda *_: None)
    assert set(ev["acceptance_length"]) == {"1", "3"} and all(1 <= v <= 4 for v in ev["acceptance_length"].values())
    assert len(ev["per_k"]["3"]["accepted_at_least"]) == 3 and 0 <= ev["heldout_top1"] <= 1
    assert set(ev["cost"]) == {"1"} and ev["cost"]["1"]["c"] > 0  # B=8 needs 8 prompts; 2 were given
    m = check_shipped(out, model)
    assert m["eval"]["acceptance_length"] == ev["acceptance_length"] and m["dtype"] == "bfloat16"
    assert m["draft_vocab_size"] == 24 and m["data_hash"] and m["recipe"]["name"] == "tiny"
    d = load_shipped("eagle", "package", model, root=tmp_path)
    assert d.dtype.is_floating_point and str(d.dtype) == "torch.bfloat16"


def test_a_killed_eval_resumes_from_its_finished_k_and_never_reuses_another_head_s(tmp_path, monkeypatch):
    from specrl.drafters.training.build import heldout
    from specrl.drafters.training.build.release import run_eval, run_package
    from specrl.drafters.training.build.stages import run_train

    model, recipe = tiny_build(tmp_path)
    run_train(recipe, tmp_path, model, progress=False)
    run_package(recipe, tmp_path, model)
    held = [[1, 30 + i, 7, 9] for i in range(2)]
    prompts = lambda tok: ([], held)  # noqa: E731
    part = run_eval(recipe, tmp_path, prompts, model, ks=(1, 3), log=lambda *_: None, measure_only=True)
    assert set(part["per_k"]) == {"1", "3"} and sorted(p.name for p in (tmp_path / "eval" / "per_k").iterdir()) \
        == ["k1.json", "k3.json"]
    assert not (tmp_path / "eval" / "eval.json").exists()  # measure_only stops before top-1, cost and manifest
    engines = []
    real = heldout._engine
    monkeypatch.setattr(heldout, "_engine", lambda *a: engines.append(a[-1]) or real(*a))
    ev = run_eval(recipe, tmp_path, prompts, model, ks=(1, 2, 3), log=lambda *_: None)
    assert engines[0] == 2 and 1 not in engines  # only k = 2 was generated again (then the cost runs, at k = 3)
    assert ev["per_k"]["1"] == part["per_k"]["1"] and ev["per_k"]["3"] == part["per_k"]["3"]
    assert "token_ids" not in ev["per_k"]["1"] and 0 <= ev["heldout_top1"] <= 1
    # a measurement kept under another key (another head's files, prompts, temperature, length or seed) is redone
    f = tmp_path / "eval" / "per_k" / "k1.json"
    rec = json.loads(f.read_text())
    f.write_text(json.dumps({**rec, "key": {**rec["key"], "files": {"model.safetensors": "0" * 64}}}))
    engines.clear()
    run_eval(recipe, tmp_path, prompts, model, ks=(1,), log=lambda *_: None, measure_only=True)
    assert engines == [1] and json.loads(f.read_text())["key"] == rec["key"]
    assert heldout._cached((tmp_path / "eval" / "per_k", {"other": "key"}), 1) is None
    (tmp_path / "eval" / "per_k" / "k1.json").write_text("{not json")
    assert heldout._cached((tmp_path / "eval" / "per_k", {}), 1) is None  # a damaged file is measured again


def test_a_shipped_drafter_refuses_a_tampered_file_or_a_manifest_that_disagrees(tmp_path):
    import shutil

    from specrl.drafters.storage.shipped import MANIFEST, check_shipped, load_shipped
    from specrl.drafters.training.build.release import run_package
    from specrl.drafters.training.build.stages import run_train

    model, recipe = tiny_build(tmp_path)
    run_train(recipe, tmp_path, model, progress=False)
    good = run_package(recipe, tmp_path, model)

    def copy(name):
        d = tmp_path / "root" / name
        shutil.copytree(good, d)
        return d

    d = copy("tampered")
    raw = bytearray((d / "model.safetensors").read_bytes())
    raw[-1] ^= 1
    (d / "model.safetensors").write_bytes(bytes(raw))
    with pytest.raises(SpecRLError, match=r"sha256.*model\.safetensors.*manifest"):
        load_shipped("eagle", "tampered", model, root=tmp_path / "root")

    def edit(name, **fields):
        d = copy(name)
        m = json.loads((d / MANIFEST).read_text())
        for k, v in fields.items():
            m[k] = v(m[k]) if callable(v) else v
        (d / MANIFEST).write_text(json.dumps(m))
        return d

    with pytest.raises(SpecRLError, match=r"vocab_size 999.*vocab_size 64"):
        check_shipped(edit("vocab", target=lambda t: {**t, "vocab_size": 999}), model)
    with pytest.raises(SpecRLError, match=r"dtype is 'float32'.*'bfloat16'"):
        check_shipped(edit("dtype", dtype="float32"), model)
    with pytest.raises(SpecRLError, match=r"target_model is 'other-model'.*'smollm2-135m'"):
        check_shipped(edit("model", target_model="other-model"), model, target_model="smollm2-135m")
    with pytest.raises(SpecRLError, match=r"draft_vocab_size is 8192.*\b24\b"):
        check_shipped(edit("dvocab", draft_vocab_size=8192), model)
    with pytest.raises(SpecRLError, match=r"kind is 'mtp'.*'eagle'"):
        load_shipped("eagle", "kind", model, root=tmp_path / "root") if edit("kind", kind="mtp") else None
    other = tiny_model("llama", vocab_size=64, seed=0, num_layers=5, hidden_size=48, head_dim=12)
    with pytest.raises(SpecRLError, match=r"hidden_size 32\b.*hidden_size 48"):
        check_shipped(good, other)


def test_the_separate_scaling_curve_trains_on_the_first_n_shards_resumes_and_reads_back_finished_points(tmp_path):
    from specrl.drafters.storage.io import load_drafter
    from specrl.drafters.training.build.curve import curve_dir, run_separate_curve
    from specrl.drafters.training.build.fit import CHECKPOINT_FILE
    from specrl.drafters.training.build.stages import run_train

    model, recipe = tiny_build(tmp_path)
    held = [[1, 30 + i, 7, 9] for i in range(2)]
    source = lambda tok: ([], held)  # noqa: E731
    with pytest.raises(SpecRLError, match="not trained yet"):
        run_separate_curve(recipe, tmp_path, source, model, k=2, progress=False, log=lambda *_: None)
    full = run_train(recipe, tmp_path, model, progress=False)
    # killed inside the one-shard training: nothing is evaluated, the checkpoint is there, the next call resumes
    logged = []
    part = run_separate_curve(recipe, tmp_path, source, model, k=2, progress=False, stop_after=1, log=logged.append)
    assert part == [] and (curve_dir(tmp_path, 1) / CHECKPOINT_FILE).exists() and "continue" in logged[-1]
    rows = run_separate_curve(recipe, tmp_path, source, model, k=2, progress=False, log=logged.append)
    assert [r["shards"] for r in rows] == [1, 2]
    one, two = rows
    shard0 = sum(len(r["response_ids"]) for r in read_shard(shard_path(tmp_path / "rollouts", 0)))
    assert one["train"]["response_tokens"] == shard0 < two["train"]["response_tokens"] == full["response_tokens"]
    assert one["train"]["sequences"] == 3 and two["train"]["sequences"] == 6
    assert one["train"]["steps"] == 4 and two["train"]["steps"] == full["steps"] == 6  # 2 epochs of 2 vs 3 batches
    assert all(1 <= r["acceptance_length"] <= 3 for r in rows)
    a = load_drafter(curve_dir(tmp_path, 1) / "drafter", model)
    b = load_drafter(tmp_path / "train" / "drafter", model)
    assert any(not torch_equal(x, y) for x, y in zip(a.state_dict().values(), b.state_dict().values(), strict=False))
    # a second call reads both points back; another k is evaluated anew
    logged.clear()
    again = run_separate_curve(recipe, tmp_path, source, model, k=2, progress=False, log=logged.append)
    assert again == rows and sum("already evaluated" in m for m in logged) == 2
    other = run_separate_curve(recipe, tmp_path, source, model, k=1, progress=False, log=lambda *_: None)
    assert [r["setting"]["k"] for r in other] == [1, 1]
    assert run_separate_curve(recipe, tmp_path, source, model, k=2, progress=False, log=lambda *_: None) == rows
    with pytest.raises(SpecRLError, match="no shard count below"):
        run_separate_curve(Recipe(**{**recipe.as_dict(), "curve": (2,)}), tmp_path, source, model, progress=False)


def test_a_partial_separate_curve_uses_only_the_shards_with_features_and_needs_no_built_head(tmp_path):
    """While the data is still being made (`draft curve --separate --partial`): only the counts whose first N
    shards have rollouts and current features are trained and evaluated, nothing is extracted, and the build's own
    head is neither needed nor evaluated; with no count within the present shards it says how many there are."""
    from specrl.drafters.training.build.curve import run_separate_curve
    from specrl.drafters.training.build.features import feature_path
    from specrl.drafters.training.build.stages import run_features

    model, recipe = tiny_build(tmp_path)
    source = lambda tok: ([], [[1, 30, 7, 9]])  # noqa: E731
    with pytest.raises(SpecRLError, match=r"first 0 shards.*rollouts"):
        run_separate_curve(recipe, tmp_path, source, model, k=2, progress=False, log=lambda *_: None, partial=True)
    run_features(recipe, tmp_path, model, progress=False)
    feature_path(tmp_path / "features", 1).unlink()  # shard 1's features not made yet
    rows = run_separate_curve(recipe, tmp_path, source, model, k=2, progress=False, log=lambda *_: None,
                              partial=True)
    assert [r["shards"] for r in rows] == [1] and rows[0]["train"]["sequences"] == 3
    assert not feature_path(tmp_path / "features", 1).exists()  # nothing was extracted
    assert 1 <= rows[0]["acceptance_length"] <= 3


def torch_equal(x, y):
    import torch

    return x.shape == y.shape and torch.equal(x, y)


def test_a_planted_training_checkpoint_is_refused_before_it_runs_code(tmp_path):
    """`specrl draft build` resumes `WORK/train/checkpoint.pt`: it is read with `weights_only=True`, so a crafted
    file whose unpickling would call `os.system` is refused naming the global, and the command never runs."""
    import torch

    from specrl.drafters.training.build.fit import CHECKPOINT_FILE
    from specrl.drafters.training.build.stages import run_train
    from tests.test_rl_checkpoint import _RunsCode

    model, recipe = tiny_build(tmp_path)
    part = run_train(recipe, tmp_path, model, progress=False, stop_after=1)
    assert part["steps"] == 1 and not part["finished"]
    ck = tmp_path / "train" / CHECKPOINT_FILE
    state = torch.load(ck, weights_only=True)  # what fit writes is plain data
    assert state["step"] == 1 and isinstance(state["opt"]["state"], dict)
    marker = tmp_path / "ran"
    torch.save({**state, "losses": [_RunsCode(marker)]}, ck)
    with pytest.raises(SpecRLError, match=r"\.pt.*`posix\.system`.*refused"):
        run_train(recipe, tmp_path, model, progress=False)
    assert not marker.exists()
    torch.save(["not", "a", "checkpoint"], ck)
    with pytest.raises(SpecRLError, match=r"not a specrl drafter"):
        run_train(recipe, tmp_path, model, progress=False)


def test_draft_build_measures_chosen_k_only_in_the_eval_stage(tmp_path):
    from typer.testing import CliRunner

    from specrl.cli import app

    r = CliRunner().invoke(app, ["draft", "build", "--recipe", "think", "--work", str(tmp_path / "w"), "--stage",
                                 "train", "--k", "2,4"])
    assert r.exit_code == 2 and "--stage eval" in r.output and "'train'" in r.output, r.output
    r = CliRunner().invoke(app, ["draft", "build", "--recipe", "think", "--work", str(tmp_path / "w"), "--stage",
                                 "eval", "--k", "2,x"])
    assert r.exit_code == 2 and "--k" in r.output, r.output
    assert not (tmp_path / "w").exists()  # refused before any work
