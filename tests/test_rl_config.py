"""Config loading, overrides and the error messages for bad input."""

from pathlib import Path

import pytest
import yaml

from specrl.config.schema import TrainConfig, apply_override, valid_keys
from specrl.errors import SpecRLError
from specrl.trainer.config_check import check_config, load_config, validate_config

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"


def test_defaults_and_roundtrip(tmp_path):
    cfg = check_config(TrainConfig())  # the loss's clip defaults filled in, as every loaded config has them
    p = tmp_path / "c.yaml"
    p.write_text(cfg.to_yaml())
    assert load_config(p) == cfg


@pytest.mark.parametrize("name", sorted(p.name for p in EXAMPLES.glob("*.yaml")))
def test_examples_validate(name):
    load_config(EXAMPLES / name)


def test_set_overrides(tmp_path):
    p = tmp_path / "c.yaml"
    p.write_text("grpo:\n  num_generations: 4\n")
    cfg = load_config(p, ["policy.learning_rate=3e-6", "speculative.num_draft_tokens=auto",
                          "speculative.drafter=eagle:default", "task.options={max_terms: 3}",
                          "run.tensorboard=false", "drafter.learning_rate=1e-3"])
    assert cfg.drafter.learning_rate == 1e-3  # YAML reads 1e-3 as a string; it is still a number here
    assert cfg.grpo.num_generations == 4
    assert cfg.policy.learning_rate == 3e-6
    assert cfg.speculative.num_draft_tokens == "auto"
    assert cfg.speculative.drafter == "eagle:default"
    assert cfg.task.options == {"max_terms": 3}
    assert cfg.run.tensorboard is False


@pytest.mark.parametrize(
    "data, pattern",
    [
        ({"grpo": {"num_generation": 4}},
         r"grpo\.num_generation: unknown key; did you mean 'grpo\.num_generations'"),
        ({"policy": {"lr": 1e-6}}, r"did you mean 'policy\.learning_rate'"),
        ({"gen": {}}, r"gen: unknown key; did you mean 'generation'"),
        ({"grpo": {"num_generations": 1}}, r"grpo\.num_generations: must be >= 2"),
        ({"policy": {"learning_rate": 0}}, r"policy\.learning_rate: must be > 0"),
        ({"policy": {"learning_rate": -1e-5}}, r"policy\.learning_rate: must be > 0"),
        ({"grpo": {"num_prompts_per_step": 3, "num_generations": 3}, "policy": {"train_micro_batch_size": 2}},
         r"train_micro_batch_size \(2\) must divide .* = 9; valid values: \[1, 3, 9\]"),
        ({"generation": {"max_new_tokens": 4096}}, r"max_new_tokens \(4096\) leaves no room .*max_seq_len"),
        ({"speculative": {"verify": "exact"}},
         r"speculative\.verify: Input should be 'rejection' or 'seed_exact'"),
        ({"speculative": {"drafter": "medusa"}}, r"unknown drafter kind 'medusa'; allowed: none, ngram"),
        ({"speculative": {"drafter": "draft-model"}}, r"needs a path"),
        ({"speculative": {"drafter": "hybrid:suffix"}}, r"hybrid:suffix needs a learned drafter spec after 'hybrid:'"),
        ({"speculative": {"drafter": "hybrid:eagle:think"}, "drafter": {"online": True}},
         r"drafter\.online trains a learned drafter, but speculative\.drafter is 'hybrid:eagle:think'"),
        ({"speculative": {"num_draft_tokens": -1}}, r"int >= 0 or 'auto'"),
        ({"speculative": {"num_draft_tokens": "many"}}, r"int >= 0 or 'auto', got 'many'"),
        ({"generation": {"temperature": 0}}, r"generation\.temperature: Input should be greater than 0"),
        ({"policy": {"lr_schedule": "step"}}, r"'constant', 'linear' or 'cosine'"),
        ({"drafter": {"online": True}}, r"drafter\.online trains a learned drafter"),
        ({"drafter": {"staleness_fraction": 0}}, r"drafter\.staleness_fraction: must be in \(0, 1\].*got 0"),
        ({"drafter": {"staleness_fraction": 1.2}}, r"drafter\.staleness_fraction: must be in \(0, 1\].*got 1.2"),
        ({"drafter": {"refresh_steps": -1}}, r"drafter\.refresh_steps: must be >= 0 .*0 disables it.*got -1"),
        ({"drafter": {"collapse_threshold": 0.9}}, r"drafter\.collapse_threshold: must be a finite number >= 1.0"),
        ({"drafter": {"collapse_patience": 0}}, r"drafter\.collapse_patience: must be >= 1"),
        ({"drafter": {"loss_weight": -0.1}}, r"drafter\.loss_weight: Input should be greater than or equal to 0, "
                                             r"got -0.1"),
        ({"run": {"name": "a/b"}}, r"run\.name: must be letters"),
        ({"model": 5}, r"model: must be a mapping"),
    ],
)
def test_bad_values(data, pattern):
    with pytest.raises(SpecRLError, match=pattern):
        validate_config(data)


def test_several_errors_reported_together():
    with pytest.raises(SpecRLError) as e:
        validate_config({"grpo": {"num_generations": 1, "foo": 2}})
    assert "grpo.num_generations" in str(e.value) and "grpo.foo" in str(e.value)


def test_bad_overrides_and_files(tmp_path):
    with pytest.raises(SpecRLError, match="key=value"):
        apply_override({}, "grpo.num_generations")
    with pytest.raises(SpecRLError, match="is a section"):
        apply_override({}, "grpo=3")
    with pytest.raises(SpecRLError, match=r"'run\.seed'.*value.*section"):
        apply_override({"run": {"seed": 1}}, "run.seed.x=1")
    with pytest.raises(SpecRLError, match="does not exist"):
        load_config(tmp_path / "missing.yaml")
    bad = tmp_path / "bad.yaml"
    bad.write_text("- 1\n- 2\n")
    with pytest.raises(SpecRLError, match=r"top level.*mapping"):
        load_config(bad)
    bad.write_text("grpo: {num_generations: 4\n")
    with pytest.raises(SpecRLError, match="not valid YAML"):
        load_config(bad)
    with pytest.raises(SpecRLError, match=r"with --set grpo\.num_generations=1"):
        load_config(None, ["grpo.num_generations=1"])


def test_valid_keys_lists_contract_names():
    keys = set(valid_keys())
    for k in ["grpo.num_prompts_per_step", "grpo.num_generations", "policy.learning_rate",
              "generation.temperature", "generation.max_new_tokens", "speculative.drafter",
              "speculative.num_draft_tokens", "speculative.verify", "drafter.online", "drafter.loss_weight"]:
        assert k in keys


def test_resolved_yaml_is_plain():
    data = yaml.safe_load(TrainConfig().to_yaml())
    assert data["policy"]["adam_betas"] == [0.9, 0.999]
