"""Your data, your reward: examples/custom_task trains on a tiny model; datasets and reward functions fail clearly."""

import json
from pathlib import Path

import pytest
import yaml

from specrl.data.datasets import make_dataset_task, read_rows
from specrl.data.rewards import load_reward_fn, user_rewards
from specrl.data.tasks import ANSWER_FORMATS
from specrl.errors import SpecRLError
from specrl.observability.metrics import read_jsonl
from specrl.run.loop import train_main
from specrl.trainer.config_check import load_config, validate_config
from specrl.trainer.sync_trainer import GRPOTrainer
from tests.tiny import make_tiny_checkpoint

ROOT = Path(__file__).resolve().parents[1]
EXAMPLE = ROOT / "examples" / "custom_task"


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> Path:
    return make_tiny_checkpoint(tmp_path_factory.mktemp("tiny") / "ckpt", seed=0)


def example_cfg(tiny, tmp_path, **sets) -> Path:
    d = yaml.safe_load((EXAMPLE / "config.yaml").read_text())
    d["model"].update(name=str(tiny), rollout_dtype="float32")
    d["task"]["path"] = str(EXAMPLE / "data.jsonl")
    d["reward"]["functions"] = [f"{EXAMPLE / 'reward.py'}:exact_match", f"{EXAMPLE / 'reward.py'}:brevity"]
    d["grpo"].update(num_prompts_per_step=2, num_generations=4, val_every=2)
    d["policy"]["train_micro_batch_size"] = 4
    d["generation"].update(max_new_tokens=8, max_batch_size=8)
    d["run"].update(steps=2, checkpoint_every=0, tensorboard=False, progress=False)
    for k, v in sets.items():
        section, _, key = k.partition("__")
        d[section][key] = v
    p = tmp_path / "c.yaml"
    p.write_text(yaml.safe_dump(d))
    return p


def test_example_config_is_valid_as_shipped():
    cfg = load_config(EXAMPLE / "config.yaml")
    assert cfg.task.name == "dataset" and len(cfg.reward.functions) == 2 and cfg.speculative.enabled


def test_custom_task_trains_two_steps(tiny, tmp_path):
    run = train_main(str(example_cfg(tiny, tmp_path)), [], None, str(tmp_path / "run"), False)
    recs = read_jsonl(run / "metrics.jsonl")
    assert [r["step"] for r in recs] == [1, 2]
    names = {f"{EXAMPLE / 'reward.py'}:exact_match", f"{EXAMPLE / 'reward.py'}:brevity"}
    for r in recs:
        assert set(r["reward_components"]) == names and r["format_rate"] is None
        comp = r["reward_components"]
        expected = comp[f"{EXAMPLE / 'reward.py'}:exact_match"] + 0.1 * comp[f"{EXAMPLE / 'reward.py'}:brevity"]
        assert r["reward_mean"] == pytest.approx(expected, abs=1e-6)
        assert r["acceptance_length"] is not None  # speculation (suffix drafter) was on
    val = read_jsonl(run / "validation.jsonl")
    assert [v["step"] for v in val] == [0, 2] and val[0]["val_format_rate"] is None


def test_chat_and_string_prompts_render(tiny, tmp_path):
    t = GRPOTrainer.from_config(load_config(example_cfg(tiny, tmp_path)))
    data = t.producer.train_data
    kinds = {type(p.question) for p in data.problems}
    assert kinds == {str, list}
    chat = next(i for i, p in enumerate(data.problems) if isinstance(p.question, list))
    text = t.producer._prompt("train", chat)[1]
    turns = data.problems[chat].question
    assert {m["role"] for m in turns} >= {"system", "user"} and all(m["content"] in text for m in turns)
    plain = next(i for i, p in enumerate(data.problems) if isinstance(p.question, str))
    text = t.producer._prompt("train", plain)[1]
    assert data.problems[plain].question in text  # used as written: no answer instruction appended
    assert not any(instruction in text for instruction in ANSWER_FORMATS.values())
    assert len(data) + len(t.producer.val_data) == 50 and len(t.producer.val_data) == 10


def _task(**over):
    base = {"name": "dataset", "path": None, "validation_path": None, "validation_fraction": 0.2, "split": "train",
            "prompt_column": "prompt", "answer_column": "answer", "seed": 0}
    return type("T", (), {**base, **over})


def test_dataset_errors(tmp_path):
    with pytest.raises(SpecRLError, match=r"path.*missing\.jsonl.*exist"):
        read_rows(tmp_path / "missing.jsonl")
    bad = tmp_path / "bad.jsonl"
    bad.write_bytes(b'{"prompt": "a", "answer": "1"}\n{"prompt": "\xff\xfe"}\n')
    with pytest.raises(SpecRLError, match=r"bad.jsonl:2: not UTF-8"):
        read_rows(bad)
    bad.write_text('{"prompt": "a"}\nnot json\n')
    with pytest.raises(SpecRLError, match=r"bad\.jsonl:2:.*valid JSON"):
        read_rows(bad)
    bad.write_text('["a list"]\n')
    with pytest.raises(SpecRLError, match=r"bad\.jsonl:1:.*JSON object"):
        read_rows(bad)
    cols = tmp_path / "cols.jsonl"
    cols.write_text(json.dumps({"question": "q", "answer": "1"}) + "\n")
    with pytest.raises(SpecRLError, match=r"'prompt'.*prompt_column.*\['answer', 'question'\]"):
        make_dataset_task(_task(path=str(cols)))
    empty = tmp_path / "empty.jsonl"
    empty.write_text("\n")
    with pytest.raises(SpecRLError, match="has no rows"):
        make_dataset_task(_task(path=str(empty)))
    chat = tmp_path / "chat.jsonl"
    chat.write_text(json.dumps({"prompt": [{"role": "user"}], "answer": "1"}) + "\n")
    with pytest.raises(SpecRLError, match=r"row 0: .*string.*chat"):
        make_dataset_task(_task(path=str(chat)))
    with pytest.raises(SpecRLError, match="unsupported file type '.csv'"):
        (tmp_path / "x.csv").write_text("a,b\n")
        read_rows(tmp_path / "x.csv")
    one = tmp_path / "one.jsonl"
    one.write_text(json.dumps({"prompt": "q", "answer": "1"}) + "\n")
    with pytest.raises(SpecRLError, match="leaves no train rows"):
        make_dataset_task(_task(path=str(one), validation_fraction=0.5))


def test_parquet_and_save_to_disk(tmp_path):
    import datasets

    rows = [{"prompt": f"q{i}", "answer": str(i)} for i in range(10)]
    ds = datasets.Dataset.from_list(rows)
    ds.to_parquet(str(tmp_path / "d.parquet"))
    assert read_rows(tmp_path / "d.parquet") == rows
    datasets.DatasetDict({"train": ds, "test": ds}).save_to_disk(str(tmp_path / "hf"))
    assert read_rows(tmp_path / "hf", "test") == rows
    with pytest.raises(SpecRLError, match=r"\['test', 'train'\].*split"):
        read_rows(tmp_path / "hf", "validation")
    train, val = make_dataset_task(_task(path=str(tmp_path / "d.parquet"), validation_path=str(tmp_path / "hf"),
                                         split="test"))
    assert len(train) == 10 and len(val) == 10


def test_long_prompt_names_its_row(tiny, tmp_path):
    data = tmp_path / "long.jsonl"
    data.write_text("".join(json.dumps({"prompt": "x" * (300 if i == 3 else 5), "answer": "1"}) + "\n"
                            for i in range(8)))
    cfg = load_config(example_cfg(tiny, tmp_path, task__path=str(data), task__validation_fraction=0.0))
    t = GRPOTrainer.from_config(cfg)
    with pytest.raises(SpecRLError, match=r"row 3\b.*jsonl.*max_seq_len"):
        for _ in range(4):
            t.stage_data()


def test_reward_function_errors(tmp_path):
    with pytest.raises(SpecRLError, match="expected 'package.module:function'"):
        load_reward_fn("nocolon")
    with pytest.raises(SpecRLError, match="module 'not_a_module_xyz' not found"):
        load_reward_fn("not_a_module_xyz:fn")
    with pytest.raises(SpecRLError, match=r"'nope'.*\['brevity', 'exact_match'\]"):
        load_reward_fn(f"{EXAMPLE / 'reward.py'}:nope")
    mod = tmp_path / "r.py"
    mod.write_text("X = 3\ndef boom(p, c, row):\n    raise ValueError('bad row')\n"
                   "def nan(p, c, row):\n    return float('nan')\ndef text(p, c, row):\n    return 'high'\n")
    with pytest.raises(SpecRLError, match=r"\bX\b.*\bint\b.*function"):
        load_reward_fn(f"{mod}:X")
    for fn, pattern in (("boom", r"reward '.*r.py:boom' raised ValueError: bad row on train row 7"),
                        ("nan", r"reward '.*r.py:nan' returned nan on train row 7; a reward must be a finite"),
                        ("text", r"reward '.*r.py:text' returned 'high' on train row 7")):
        rs = user_rewards([f"{mod}:{fn}"], None)
        with pytest.raises(SpecRLError, match=pattern):
            rs.score("p", "c", {}, "train row 7")
    with pytest.raises(SpecRLError, match=r"weights.*\b1\b.*functions.*\b2\b"):
        user_rewards([f"{mod}:nan", f"{mod}:boom"], [1.0])


def test_a_broken_reward_stops_the_step_before_training(tiny, tmp_path):
    mod = tmp_path / "r.py"
    mod.write_text("def boom(p, c, row):\n    raise RuntimeError('scorer crashed')\n")
    cfg = load_config(example_cfg(tiny, tmp_path))
    cfg.reward.functions, cfg.reward.weights = [f"{mod}:boom"], None
    t = GRPOTrainer.from_config(cfg)
    with pytest.raises(SpecRLError, match=r"RuntimeError: scorer crashed.*row"):
        t.step()
    assert t.learner.step_count == 0


def test_config_errors_for_dataset_tasks():
    with pytest.raises(SpecRLError, match=r"name=dataset.*scorer.*reward\.functions"):
        validate_config({"task": {"name": "dataset", "path": "x.jsonl"}})
    with pytest.raises(SpecRLError, match=r"name=dataset needs task\.path"):
        validate_config({"task": {"name": "dataset"}, "reward": {"functions": ["m:f"]}})
    with pytest.raises(SpecRLError, match=r"weights.*\b2\b.*functions.*\b1\b"):
        validate_config({"reward": {"functions": ["m:f"], "weights": [1.0, 2.0]}})
