"""The drafters shipped inside the package: verified files, a manifest that matches the target, a held-out AL floor.

The floors are behavioural, far below the measured figures (each manifest's eval), so they are not flaky: an
untrained or mis-loaded head accepts ~1.0 tokens per verify step. Each shipped drafter is checked at its own
workload: `think` and `think-parallel-markov` (reasoning replies, T=0.7) and `default` (short number answers, T=1).
"""

import json

import pytest

from specrl.drafters.storage.shipped import MANIFEST, check_shipped, is_shipped, shipped_dir
from specrl.errors import SpecRLError

pytestmark = pytest.mark.slow
# name -> (kind, answer format, temperature, max new tokens, held-out prompts, AL floor at k=3)
SHIPPED = {"think": ("eagle", "reasoning", 0.7, 96, 4, 1.5), "default": ("eagle", "number", 1.0, 32, 16, 1.2),
           "think-parallel-markov": ("parallel", "reasoning", 0.7, 96, 4, 1.5)}


@pytest.fixture(scope="module")
def target():
    from specrl import load_model

    model, tok = load_model("smollm2-135m", dtype="auto")
    return model, tok


@pytest.mark.parametrize("name", sorted(SHIPPED))
def test_each_shipped_drafter_s_manifest_matches_its_files_and_recipe(name):
    from specrl.drafters.training.build.recipe import Recipe

    kind = SHIPPED[name][0]
    assert is_shipped(kind, name)
    m = check_shipped(shipped_dir(name), target_model="smollm2-135m")
    assert m["kind"] == kind and m["dtype"] == "bfloat16" and m["target"]["vocab_size"] == 49152
    recipe = Recipe.load(name)
    assert m["recipe"]["temperature"] == recipe.temperature and m["recipe"]["task"] == recipe.task
    assert len(m["data_hash"]) == 64 and m["commit"]
    per_k = m["eval"]["per_k"]
    assert sorted(int(k) for k in per_k) == list(range(1, 8))
    assert len(per_k["7"]["accepted_at_least"]) == 7


@pytest.mark.parametrize("name", sorted(SHIPPED))
def test_each_shipped_drafter_loads_without_a_build_and_beats_its_al_floor_on_heldout_prompts(name, target,
                                                                                              monkeypatch):
    from specrl.drafters.storage import default as default_drafter
    from specrl.drafters.storage.default import resolve_drafter, task_prompts
    from specrl.drafters.training.offline import heldout_acceptance
    from specrl.model.tokenizer import stop_token_ids

    def no_build(*a, **k):
        raise AssertionError("a shipped drafter must not be built")

    monkeypatch.setattr(default_drafter.drafter_build, "train_drafter_offline", no_build)
    model, tok = target
    kind, fmt, temperature, new_tokens, prompts, floor = SHIPPED[name]
    d = resolve_drafter(f"{kind}:{name}", model)
    assert d.dtype == model.dtype  # a learned drafter runs in its target's dtype (its file stays bf16)
    _, held = task_prompts("chain_sum", 8, heldout=prompts, answer_format=fmt)(tok)
    al = heldout_acceptance(model, d, held, k=3, temperature=temperature, max_new_tokens=new_tokens,
                            stop_token_ids=stop_token_ids(tok, model.args), seed=0)
    assert al >= floor, f"{kind}:{name} accepts {al:.2f} tokens per verify step (floor {floor})"
    if kind in default_drafter.DEFAULT_KINDS:
        assert default_drafter.ensure_default_drafter(kind, name) == shipped_dir(name)


def test_a_tampered_shipped_file_is_refused_by_name(tmp_path, target):
    import shutil

    from specrl.drafters.storage.shipped import load_shipped

    shutil.copytree(shipped_dir("think"), tmp_path / "think")
    cfg = tmp_path / "think" / "config.json"
    cfg.write_text(cfg.read_text().replace('"draft_vocab_size"', '"draft_vocab_size" ', 1))
    with pytest.raises(SpecRLError, match="sha256 of config.json"):
        load_shipped("eagle", "think", target[0], root=tmp_path)
    shutil.copy(shipped_dir("think") / "config.json", cfg)
    m = json.loads((tmp_path / "think" / MANIFEST).read_text())
    m["target"]["num_layers"] = 24
    (tmp_path / "think" / MANIFEST).write_text(json.dumps(m))
    with pytest.raises(SpecRLError, match=r"num_layers 24\b.*num_layers 30"):
        load_shipped("eagle", "think", target[0], root=tmp_path)
