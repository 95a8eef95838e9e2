"""Bad input at each door (CLI verbs, config keys, prompt files, drafter directories, ...) is a clear error naming
what was wrong and what would be right: malformed drafter config values, a --resume that never mentions a --config
nobody passed, empty prompts, and the sweep's cases (empty, wrong-typed, non-finite, huge, non-UTF-8, truncated)."""

from __future__ import annotations

import json
import re

import pytest
import torch
from typer.testing import CliRunner

from specrl.cli import app
from specrl.errors import SpecRLError
from tests.tiny import make_tiny_checkpoint

runner = CliRunner()


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return make_tiny_checkpoint(tmp_path_factory.mktemp("tiny") / "ck", seed=0)


# ----------------------------------------------------------------------------- drafter config.json values


@pytest.fixture(scope="module")
def drafter_dirs(tmp_path_factory):
    from specrl.drafters.kinds.eagle import EagleDrafter
    from specrl.drafters.kinds.mtp import MTPDrafter
    from specrl.drafters.storage.io import save_drafter
    from specrl.model.transformer import tiny_model

    target = tiny_model("llama", vocab_size=64, seed=1)
    root = tmp_path_factory.mktemp("drafters")
    return target, {"eagle": save_drafter(EagleDrafter(target), root / "eagle"),
                    "mtp": save_drafter(MTPDrafter(target), root / "mtp")}


def _with_config(src, dst, **changes):
    import shutil

    shutil.copytree(src, dst)
    cfg = json.loads((dst / "config.json").read_text())
    for k, v in changes.items():
        if v is KeyError:
            cfg.pop(k)
        else:
            cfg[k] = v
    (dst / "config.json").write_text(json.dumps(cfg))
    return dst


@pytest.mark.parametrize("kind,key,value,match", [
    ("eagle", "hidden_size", "wide", r"hidden_size is 'wide'; it must be a positive integer"),
    ("eagle", "vocab_size", 64.5, r"vocab_size is 64.5; it must be a positive integer"),
    ("eagle", "intermediate_size", -3, r"intermediate_size is -3; it must be a positive integer"),
    ("eagle", "draft_vocab_size", None, r"draft_vocab_size is None; it must be a positive integer"),
    ("eagle", "layers", "0,1", r"layers is '0,1'; it must be a non-empty list of target layer indices"),
    ("eagle", "layers", [0, "x"], r"layers is \[0, 'x'\]; it must be a non-empty list"),
    ("eagle", "layers", [], r"layers is \[\]; it must be a non-empty list"),
    ("eagle", "dtype", "float99", r"dtype is 'float99'; it must be one of float32, float16, bfloat16"),
    ("eagle", "intermediate_size", KeyError, r"lacks the field 'intermediate_size'"),
    ("mtp", "num_modules", True, r"num_modules is True; it must be a positive integer"),
    ("mtp", "num_modules", KeyError, r"lacks the field 'num_modules'"),
    ("mtp", "num_heads", [4], r"num_heads is \[4\]; it must be a positive integer"),
])
def test_malformed_drafter_config_value_names_the_file_and_key(drafter_dirs, tmp_path, kind, key, value, match):
    from specrl.drafters.storage.io import load_drafter

    target, dirs = drafter_dirs
    d = _with_config(dirs[kind], tmp_path / "d", **{key: value})
    with pytest.raises(SpecRLError, match=rf"{d / 'config.json'}:? .*{match}"):
        load_drafter(d, target)


def test_drafter_config_not_utf8_or_truncated(drafter_dirs, tmp_path):
    from specrl.drafters.storage.io import load_drafter

    target, dirs = drafter_dirs
    d = _with_config(dirs["eagle"], tmp_path / "d")
    (d / "config.json").write_bytes(b'{"format": "specrl-drafter", "kind": "\xff\xfe"}')
    with pytest.raises(SpecRLError, match=r"config\.json:.*JSON.*utf-8"):
        load_drafter(d, target)
    text = (dirs["eagle"] / "config.json").read_text()
    (d / "config.json").write_text(text[: len(text) // 2])
    with pytest.raises(SpecRLError, match=r"config\.json:.*valid JSON"):
        load_drafter(d, target)


def test_valid_drafter_configs_still_load(drafter_dirs):
    from specrl.drafters.storage.io import load_drafter

    target, dirs = drafter_dirs
    assert load_drafter(dirs["eagle"], target).kind == "eagle"
    assert load_drafter(dirs["mtp"], target).kind == "mtp"


# ----------------------------------------------------------------------------- --resume and --config


def test_resume_without_config_never_mentions_a_config(tiny, tmp_path):
    from tests.test_reliability import cfg_dict
    from tests.test_rl_trainer import write_cfg

    cfg = write_cfg(tmp_path / "c.yaml", cfg_dict(tiny, run__steps=1, run__progress=False))
    r = runner.invoke(app, ["train", "--config", str(cfg), "--out", str(tmp_path / "run")])
    assert r.exit_code == 0, r.output
    r = runner.invoke(app, ["train", "--resume", str(tmp_path / "run"), "--set", "run.steps=2"])
    assert r.exit_code == 0, r.output
    assert "--config" not in r.output and "default.yaml" not in r.output
    r = runner.invoke(app, ["train", "--resume", str(tmp_path / "run"), "--config", str(cfg)])
    assert f"--config {cfg} is not used" in r.output  # one the user did pass is still named


# ----------------------------------------------------------------------------- empty prompts


@pytest.mark.parametrize("line,match", [
    ({"prompt": ""}, r"p.jsonl:2: prompt 1 is empty; give each line a non-empty \"prompt\""),
    ({"prompt": "   \t"}, r"p.jsonl:2: prompt 1 is empty"),
    ({"prompt_token_ids": []}, r"p.jsonl:2: prompt 1 has no token ids; give at least one"),
])
def test_generate_refuses_an_empty_prompt_naming_its_index(tiny, tmp_path, line, match):
    prompts = tmp_path / "p.jsonl"
    prompts.write_text(json.dumps({"prompt": "hi"}) + "\n" + json.dumps(line) + "\n")
    out = tmp_path / "o.jsonl"
    r = runner.invoke(app, ["generate", "--model", str(tiny), "--prompts", str(prompts), "--out", str(out),
                            "--max-new-tokens", "2", "--max-seq-len", "64", "--dtype", "fp32"])
    assert r.exit_code == 2 and not out.exists()
    import re

    assert re.search(match, " ".join(r.output.split())), r.output


def test_python_api_refuses_an_empty_prompt_naming_its_index():
    from specrl import RolloutEngine, RolloutRequest, SamplingParams
    from specrl.model.transformer import tiny_model

    eng = RolloutEngine(tiny_model("llama", vocab_size=64), max_batch_size=2, max_seq_len=32)
    with pytest.raises(SpecRLError, match=r"prompt 1 is empty"):
        eng.generate([RolloutRequest([1, 2], 0), RolloutRequest([], 1)], SamplingParams(max_new_tokens=2))
    with pytest.raises(SpecRLError, match=r"prompt 0 is empty"):
        eng.generate([torch.tensor([], dtype=torch.long)], SamplingParams(max_new_tokens=2))


# ----------------------------------------------------------------------------- the sweep


@pytest.mark.parametrize("label,mutate,match", [
    ("an entry without its file", lambda m: m["files"]["policy"].pop("file"), r"entry 'policy' is .*expected "
                                                                              r"\{\"file\": a file name"),
    ("an entry that is a string", lambda m: m["files"].__setitem__("policy", "policy.pt"), r"entry 'policy' is "
                                                                                           r"'policy.pt'"),
    ("a file outside the directory", lambda m: m["files"]["policy"].__setitem__("file", "../x.pt"),
     r"entry 'policy' is .*\.\./x\.pt.*a file name in this directory"),
    ("a step that is not an integer", lambda m: m.__setitem__("step", "one"), r"step is 'one', expected an integer"),
    ("a manifest that is a list", lambda m: [1, 2], r"unknown manifest format 'list'"),
])
def test_malformed_checkpoint_manifest_is_a_clear_error(tmp_path, label, mutate, match):
    from specrl.checkpoint.store import CheckpointError, save_checkpoint, verify_checkpoint

    p = save_checkpoint(tmp_path, 1, {"policy": {"w": torch.zeros(2)}})
    m = json.loads((p / "manifest.json").read_text())
    out = mutate(m)
    (p / "manifest.json").write_text(json.dumps(m if out is None or not isinstance(out, list) else out))
    with pytest.raises(CheckpointError, match=match):
        verify_checkpoint(p)


@pytest.mark.parametrize("override,match", [
    ("run.seed=-1", r"run\.seed: Input should be greater than or equal to 0, got -1"),
    ("run.seed=100000000000000000000000000000", r"run\.seed: Input should be less than or equal to "
                                                r"9223372036854775807"),
    ("task.seed=-5", r"task\.seed: Input should be greater than or equal to 0"),
    ("model.name=", r"model\.name: String should have at least 1 character"),
])
def test_config_values_that_used_to_fail_late_or_silently(override, match):
    from specrl.trainer.config_check import load_config

    with pytest.raises(SpecRLError, match=match):
        load_config(None, [override])


def test_files_with_a_byte_order_mark_are_read_as_utf8(tmp_path):
    from specrl.cli.generation import _read_prompts
    from specrl.data.datasets import read_rows
    from specrl.trainer.config_check import load_config
    from tests.tiny import char_tokenizer

    p = tmp_path / "p.jsonl"
    p.write_bytes('\ufeff{"prompt_token_ids": [1, 2]}\n'.encode())
    assert _read_prompts(p, char_tokenizer(), False) == [[1, 2]]
    d = tmp_path / "d.jsonl"
    d.write_bytes('\ufeff{"prompt": "hi", "answer": "1"}\n'.encode())
    assert read_rows(d) == [{"prompt": "hi", "answer": "1"}]
    c = tmp_path / "c.yaml"
    c.write_bytes("\ufeffrun: {steps: 3}\n".encode())
    assert load_config(c).run.steps == 3


def test_generate_with_a_seed_beyond_int64_is_a_clear_error(tiny, tmp_path):
    prompts = tmp_path / "p.jsonl"
    prompts.write_text(json.dumps({"prompt_token_ids": [1, 2]}) + "\n")
    r = runner.invoke(app, ["generate", "--model", str(tiny), "--prompts", str(prompts), "--out",
                            str(tmp_path / "o.jsonl"), "--max-new-tokens", "2", "--max-seq-len", "64", "--seed",
                            str(2**64 - 1)])
    assert r.exit_code == 2, r.output
    assert re.search(r"seed\b.*0\.\.9223372036854775807\b.*\b18446744073709551615", " ".join(r.output.split()))


def test_draft_init_refuses_to_write_into_a_directory_that_is_not_a_drafter(tiny, tmp_path):
    from specrl.drafters.training.build.from_rollouts import train_drafter_offline

    busy = tmp_path / "busy"
    busy.mkdir()
    (busy / "notes.txt").write_text("mine")
    with pytest.raises(SpecRLError, match=r"non-empty directory.*config\.json"):
        train_drafter_offline(str(tiny), "eagle", prompts=[[1, 2]] * 4, out=busy, samples=2, progress=False)
    assert sorted(p.name for p in busy.iterdir()) == ["notes.txt"]
    (tmp_path / "f").write_text("x")
    with pytest.raises(SpecRLError, match=r"is a file"):
        train_drafter_offline(str(tiny), "eagle", prompts=[[1, 2]] * 4, out=tmp_path / "f", samples=2, progress=False)


# sizes beyond any 64-bit machine's virtual address space (2**47 bytes), so no overcommit setting lets them through
@pytest.mark.parametrize("kw", [{"max_batch_size": 10**12, "max_seq_len": 32},
                                {"max_batch_size": 2, "max_seq_len": 10**13}])
def test_a_kv_cache_too_large_to_allocate_is_a_clear_error(kw):
    from specrl import RolloutEngine
    from specrl.model.transformer import tiny_model

    model = tiny_model("llama", vocab_size=64, max_position_embeddings=2**50)
    with pytest.raises(SpecRLError, match=rf"max_batch_size={kw['max_batch_size']} x "
                                          rf"max_seq_len={kw['max_seq_len']}.*GiB"):
        RolloutEngine(model, **kw)
