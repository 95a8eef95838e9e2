"""Bad input: each case raises SpecRLError naming what was wrong and what would be right; the CLI exits 2."""

import json
from dataclasses import replace

import pytest
from typer.testing import CliRunner

from specrl.errors import SpecRLError
from specrl.sim.commands import app
from specrl.sim.pipeline import SimConfig, simulate
from specrl.sim.scenarios import get_preset

runner = CliRunner()


def _cli_error(args: list[str], match: str) -> None:
    res = runner.invoke(app, args)
    assert res.exit_code == 2, res.output
    assert match in res.output


def test_unknown_model_hardware_preset_list_valid_ones():
    with pytest.raises(SpecRLError, match="unknown model 'gpt-9'.*qwen3-8b"):
        simulate(SimConfig(model="gpt-9"))
    with pytest.raises(SpecRLError, match="unknown hardware 'tpu'.*gb200"):
        simulate(SimConfig(hardware="tpu"))
    with pytest.raises(SpecRLError, match="unknown preset 'x'.*paper-235b"):
        get_preset("x")
    _cli_error(["--model", "gpt-9"], "valid:")
    _cli_error(["--hardware", "tpu"], "valid:")
    _cli_error(["--preset", "x"], "paper-8b-rl-zero")
    _cli_error(["--drafter", "medusa"], "valid: none, eagle3, mtp, draft-model, ngram")


@pytest.mark.parametrize("al", [0.5, 4.5])
def test_acceptance_length_outside_range(al):
    with pytest.raises(SpecRLError, match=r"acceptance length.*\[1, 4\]"):
        simulate(replace(get_preset("paper-8b-rl-think"), acceptance_length=al))
    _cli_error(["--k", "3", "--acceptance-length", str(al)], "outside [1, k+1]")


def test_rates_outside_unit_interval():
    with pytest.raises(SpecRLError, match=r"acceptance rates.*\[0, 1\]") as e:
        simulate(replace(get_preset("paper-8b-rl-think"), acceptance_rates=(0.9, 1.2), k=2))
    assert "got [1.2]" in str(e.value)
    _cli_error(["--acceptance-rates", "0.8,-0.1"], "[0, 1]")
    _cli_error(["--acceptance-rates", "0.8,abc"], "comma-separated")
    _cli_error(["--acceptance-rates", "0.8,0.7", "--k", "3"], "exceeds the 2 per-position")


def test_k_below_one_with_a_drafter():
    with pytest.raises(SpecRLError, match="k=0 must be >= 1"):
        simulate(replace(get_preset("paper-8b-rl-think"), k=0))
    _cli_error(["--k", "0", "--acceptance-length", "1.0"], "must be >= 1")
    _cli_error(["--k", "three"], "integer >= 1 or 'auto'")


def test_gpu_count_not_divisible_by_layout():
    with pytest.raises(SpecRLError, match=r"515.*divisible.*\b4 GPUs"):
        simulate(get_preset("paper-235b").with_(gpus=1030, gen_gpu_fraction=0.5))
    _cli_error(["--model", "qwen3-8b", "--gpus", "6", "--gpus-per-engine", "4"], "use a multiple of 4")


def test_model_that_does_not_fit_says_how_much_it_needs():
    with pytest.raises(SpecRLError, match=r"deepseek-v3.*\b1342\b.*>= 32 GPUs"):
        simulate(SimConfig(model="deepseek-v3", hardware="h100", gpus=64, gpus_per_engine=8, drafter="none"))
    _cli_error(["--model", "llama-3.1-70b", "--hardware", "h100", "--gpus", "8", "--gpus-per-engine", "1",
                "--drafter", "none"], "GB")


def test_malformed_config_json(tmp_path):
    bad = tmp_path / "bad" / "config.json"
    bad.parent.mkdir()
    bad.write_text("{not json")
    _cli_error(["--model", str(bad)], "malformed config.json")
    missing = tmp_path / "missing" / "config.json"
    missing.parent.mkdir()
    missing.write_text(json.dumps({"hidden_size": 64}))
    _cli_error(["--model", str(missing)], "no 'num_hidden_layers'")
    typed = tmp_path / "typed" / "config.json"
    typed.parent.mkdir()
    typed.write_text(json.dumps({"hidden_size": "big", "num_hidden_layers": 2, "num_attention_heads": 2,
                                 "vocab_size": 10, "intermediate_size": 8}))
    _cli_error(["--model", str(typed)], "not an integer")


def test_mtp_drafter_on_model_without_mtp():
    _cli_error(["--drafter", "mtp"], "no MTP layers")


def test_bad_mode_and_fraction():
    _cli_error(["--mode", "pipelined"], "sync or async")
    _cli_error(["--mode", "async", "--gen-gpu-fraction", "1.0"], "(0, 1)")


def test_config_errors_name_the_field_and_the_valid_range():
    from dataclasses import replace

    from specrl.sim.costs.roofline import Efficiency
    from specrl.sim.pipeline import SimConfig, simulate
    from specrl.sim.workload import Workload

    base = SimConfig(model="qwen3-8b", hardware="h100", gpus=8, workload=Workload(prompts_per_step=2))
    with pytest.raises(SpecRLError, match="train_micro_batch=-1 must be 0"):
        simulate(replace(base, train_micro_batch=-1))
    with pytest.raises(SpecRLError, match=r"vocabulary 0.*\[1, 151936\]"):
        simulate(replace(base, draft_vocab=0))
    with pytest.raises(SpecRLError, match=r"length_sample.*non-empty"):
        Workload(length_sample=())
    with pytest.raises(SpecRLError, match=r"mfu_attention=2\.0\b.*\[0, 1\]"):
        Efficiency(mfu_attention=2.0)
    with pytest.raises(SpecRLError, match="drafter_train_passes=-1"):
        simulate(replace(base, drafter_trained_online=True, drafter_train_passes=-1))
