"""The resumable drafter build: checked rollout shards, resume after a kill, recipes that name what is wrong."""

import json

import pytest

from specrl.drafters.recipe import Recipe
from specrl.drafters.shards import CorruptShard, check_shard, collect_rollouts, read_shard, shard_path, write_shard
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
    bad.write_text(json.dumps({"name": "x", "temperature": 0}))
    with pytest.raises(SpecRLError, match="temperature must be > 0"):
        Recipe.load(bad)
    with pytest.raises(SpecRLError, match="no recipe file"):
        Recipe.load(tmp_path / "missing.json")
    assert Recipe(name="a").hash() != Recipe(name="a", temperature=0.5).hash()
    assert Recipe(name="a").hash() == Recipe(name="a", epochs=9).hash()  # training settings keep the data
