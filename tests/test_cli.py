"""The CLI verbs on a tiny checkpoint: generate (AR and speculative), and bad input exits 2 with a message."""

import json
import re

import pytest
from typer.testing import CliRunner

from specrl.cli import app
from specrl.model.hf_checkpoint import save_hf_checkpoint
from specrl.model.transformer import tiny_model

runner = CliRunner()


def _setup(tmp_path):
    ck = save_hf_checkpoint(tiny_model("qwen2", vocab_size=64), tmp_path / "ck")
    prompts = tmp_path / "p.jsonl"
    prompts.write_text("\n".join(json.dumps({"prompt_token_ids": p}) for p in ([1, 2, 3], [4, 5])) + "\n")
    return ck, prompts


def test_generate_writes_jsonl(tmp_path):
    ck, prompts = _setup(tmp_path)
    outs = {}
    for drafter in ("none", "ngram"):
        out = tmp_path / f"{drafter}.jsonl"
        r = runner.invoke(app, ["generate", "--model", str(ck), "--prompts", str(prompts), "--out", str(out),
                                "--temperature", "0", "--max-new-tokens", "8", "--num-samples", "2",
                                "--drafter", drafter, "--k", "auto", "--dtype", "fp32", "--max-seq-len", "64"])
        assert r.exit_code == 0, r.output
        assert "tokens/s" in r.output
        rows = [json.loads(x) for x in out.read_text().splitlines()]
        assert [(x["prompt_index"], x["sample_index"]) for x in rows] == [(0, 0), (0, 1), (1, 0), (1, 1)]
        assert all(len(x["token_ids"]) == len(x["logprobs"]) == 8 and x["finish_reason"] == "length" for x in rows)
        outs[drafter] = [x["token_ids"] for x in rows]
    assert "acceptance length" in r.output
    assert outs["none"] == outs["ngram"]  # greedy: speculative == autoregressive


def test_generate_bad_input(tmp_path):
    ck, prompts = _setup(tmp_path)
    base = ["generate", "--model", str(ck), "--out", str(tmp_path / "o.jsonl"), "--max-seq-len", "64",
            "--max-new-tokens", "4"]
    r = runner.invoke(app, base + ["--prompts", str(tmp_path / "missing.jsonl")])
    assert r.exit_code == 2 and "does not exist" in r.output
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"text": "hi"}\n')
    r = runner.invoke(app, base + ["--prompts", str(bad)])
    assert r.exit_code == 2 and "bad.jsonl:1: expected" in r.output
    r = runner.invoke(app, base + ["--prompts", str(prompts), "--k", "lots", "--drafter", "ngram"])
    assert r.exit_code == 2 and re.search(r"--k\b.*integer.*'auto'", r.output)
    r = runner.invoke(app, base + ["--prompts", str(prompts), "--top-p", "0"])
    assert r.exit_code == 2 and re.search(r"top_p.*\(0, 1\]", r.output)
    r = runner.invoke(app, ["generate", "--model", "no-such-model", "--prompts", str(prompts), "--out", "x"])
    assert r.exit_code == 2 and "presets are ['smollm2-135m']" in r.output


def test_prepare_bad_drafter_is_rejected_before_any_work():
    r = runner.invoke(app, ["prepare", "--drafter", "ngram"])
    assert r.exit_code == 2 and re.search(r"eagle, eagle:think, mtp, mtp:think", r.output)
    r = runner.invoke(app, ["prepare", "--model", "qwen3-8b", "--drafter", "eagle"])
    assert r.exit_code == 2 and re.search(r"smollm2-135m.*'qwen3-8b'", r.output)


def test_draft_init_passes_draft_model_options(tmp_path):
    """`specrl draft init --drafter draft-model --draft-layers N` reaches train_drafter_offline (checked before any
    work)."""
    tdir = save_hf_checkpoint(tiny_model("llama", vocab_size=32, seed=0), tmp_path / "t")
    r = runner.invoke(app, ["draft", "init", "--model", str(tdir), "--drafter", "draft-model", "--draft-layers", "9",
                            "--out", str(tmp_path / "d")])
    assert r.exit_code == 2 and re.search(r"draft_layers.*\[1, 3\]", r.output), r.output
    r = runner.invoke(app, ["draft", "init", "--model", str(tdir), "--drafter", "medusa"])
    assert r.exit_code == 2 and re.search(r"'eagle', 'mtp', 'draft-model'.*'parallel'", r.output), r.output


def test_bad_threads_option_exits_2_with_the_rule():
    for bad in ("two", "0", "-1"):
        r = runner.invoke(app, ["prepare", "--threads", bad])
        assert r.exit_code == 2, r.output
        assert re.search(r"--threads.*>= 1.*'auto'", r.output), r.output


def test_check_backend_builds_through_the_registry(tmp_path, monkeypatch):
    """`specrl check-backend` builds its backend with `specrl.backends.registry.build_backend` (the trainer's path)."""
    from specrl.backends import registry as backends
    from tests.tiny import make_tiny_checkpoint

    ck = make_tiny_checkpoint(tmp_path / "ck")
    built = []

    def native(cfg, policy):
        built.append(cfg)
        return backends.native_backend(cfg, policy)

    monkeypatch.setitem(backends.BACKENDS, "native", native)
    r = runner.invoke(app, ["check-backend", "--backend", "native", "--model", str(ck), "--drafter", "ngram",
                            "--k", "2", "--samples", "16", "--tokens", "2", "--dtype", "float32"])
    assert r.exit_code in (0, 1), r.output
    assert all(f in r.output for f in ("native", "drafter ngram", "k=2", "float32"))
    (cfg,) = built
    assert (cfg.speculative.drafter, cfg.speculative.num_draft_tokens, cfg.model.rollout_dtype) == ("ngram", 2,
                                                                                                   "float32")
    assert cfg.generation.max_batch_size == 16 and cfg.generation.max_new_tokens == 2
    r = runner.invoke(app, ["check-backend", "--backend", "sglang", "--model", str(ck)])
    assert r.exit_code == 2 and re.search(r"--backend.*native, vllm.*'sglang'", r.output)


def test_draft_curve_partial_needs_separate(tmp_path):
    """`draft curve --partial` applies only to --separate: refused with exit 2 naming both flags, before any work."""
    r = runner.invoke(app, ["draft", "curve", "--recipe", "think", "--work", str(tmp_path / "w"), "--partial"])
    assert r.exit_code == 2 and "--partial" in r.output and "--separate" in r.output
    assert not (tmp_path / "w").exists()


@pytest.mark.parametrize("separate", [False, True])
def test_draft_curve_draws_into_the_build_directory_by_default(tmp_path, monkeypatch, separate):
    """Without --plot the curve goes beside its JSON in WORK/eval/, never into the current directory's docs/."""
    from specrl.drafters.training.build import curve, release

    drawn = []
    rows = [{"setting": {"prompts": 2}, "prompts": 2}]
    monkeypatch.setattr(release, "run_curve", lambda *a, **k: rows)
    monkeypatch.setattr(curve, "run_separate_curve", lambda *a, **k: rows)
    monkeypatch.setattr(release, "plot_curve", lambda rows, path, title: drawn.append(path))
    monkeypatch.setattr(curve, "plot_separate_curve", lambda rows, path, title, snapshots=None: drawn.append(path))
    monkeypatch.chdir(tmp_path)
    work = tmp_path / "w"
    args = ["draft", "curve", "--recipe", "think", "--work", str(work), *(["--separate", "--partial"] if separate
                                                                           else [])]
    r = runner.invoke(app, args)
    assert r.exit_code == 0, r.output
    assert drawn == [work / "eval" / ("curve_separate.png" if separate else "curve.png")]
    assert not (tmp_path / "docs").exists()
