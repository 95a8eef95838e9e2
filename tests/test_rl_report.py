"""metrics.jsonl / TensorBoard writing, report.md and compare outputs."""

import json
import math
import re

import pytest

from specrl.observability.metrics import STEP_FIELDS, MetricsWriter, ProgressDisplay, read_jsonl, stage_bar
from specrl.observability.run_report import LOGPROB_FOLDED, write_report
from specrl.run.compare_report import amdahl_bound, compare_summary, write_compare


def record(step, reward=0.5, gen=2.0, al=None):
    stages = {"data": 0.01, "prepare": 0.1, "gen": gen, "logprob": 0.5, "train": 1.0}
    total = sum(stages.values())
    return {
        "step": step, "reward_mean": reward, "reward_std": 0.1, "accuracy": 0.2 if step % 2 == 0 else None,
        "response_length_mean": 30.0, "stage_seconds": stages, "step_seconds": total,
        "gen_share": gen / total, "acceptance_length": al, "acceptance_rate": None if al is None else 0.5,
        "acceptance_rate_per_position": [] if al is None else [0.7, 0.5, 0.3],
        "num_draft_tokens_mean": None if al is None else 3.0, "token_mult_prob_error": 1.001,
        "draft_loss": None, "draft_updates": 0, "generated_tokens": 100, "gen_tokens_per_second": 100 / gen,
    }


def test_metrics_writer_jsonl_tensorboard_and_resume(tmp_path):
    w = MetricsWriter(tmp_path, tensorboard=True)
    for s in range(1, 4):
        w.write(record(s, al=2.5))
    w.write({**record(4), "reward_mean": math.nan})
    w.close()
    recs = read_jsonl(tmp_path / "metrics.jsonl")
    assert [r["step"] for r in recs] == [1, 2, 3, 4]
    assert recs[3]["reward_mean"] is None
    assert all(k in recs[0] for k in STEP_FIELDS)
    assert any((tmp_path / "tensorboard").glob("events.out.tfevents.*"))
    # resume from the checkpoint at step 2 forgets steps 3 and 4
    w = MetricsWriter(tmp_path, tensorboard=False, resume_step=2)
    w.write(record(3))
    w.close()
    assert [r["step"] for r in read_jsonl(tmp_path / "metrics.jsonl")] == [1, 2, 3]
    with pytest.raises(KeyError, match="reward_mean"):
        MetricsWriter(tmp_path / "x", tensorboard=False).write({"step": 1})


def test_read_metrics_ignores_torn_line(tmp_path):
    p = tmp_path / "metrics.jsonl"
    p.write_text(json.dumps(record(1)) + "\n" + '{"step": 2, "rew')
    assert len(read_jsonl(p)) == 1


def test_progress_line_and_bar(capsys):
    assert stage_bar({"gen": 1.0}, width=10) == "g" * 10
    d = ProgressDisplay(total_steps=5, enabled=True)
    d.update(record(1, al=2.0))
    d.close()
    out = capsys.readouterr().out
    assert "step 1/5" in out and "reward 0.500" in out and "AL 2.00" in out


def test_write_report(tmp_path):
    recs = [record(s, reward=0.1 * s, al=2.0 + 0.1 * s) for s in range(1, 9)]
    path = write_report(tmp_path, recs, config_text="run:\n  steps: 8\n")
    text = path.read_text()
    for png in ("reward.png", "stages.png", "acceptance.png"):
        assert (tmp_path / png).stat().st_size > 1000
        assert png in text
    assert "0.150 → 0.750" in text  # first-quarter and last-quarter mean reward


def test_report_shows_the_rollout_shape(tmp_path):
    # a long tail: most replies stop early, two hit the limit; the batch drains over the rollout
    recs = [{**record(s, al=2.0), "response_lengths": [40, 60, 80, 120, 200, 300, 512, 512],
             "batch_trace": [[0.1 * i, 8 - i // 10, 3 if i % 2 else 0, 9] for i in range(70)]} for s in (1, 2)]
    text = write_report(tmp_path, recs, max_new_tokens=512).read_text()
    assert "rollout_shape.png" in text and (tmp_path / "rollout_shape.png").stat().st_size > 1000
    w = MetricsWriter(tmp_path / "tb", tensorboard=True)  # traces stay in metrics.jsonl, not as 500 scalars
    w.write(recs[0])
    w.close()
    assert read_jsonl(tmp_path / "tb" / "metrics.jsonl")[0]["response_lengths"][-1] == 512


def test_report_without_drafter(tmp_path):
    text = write_report(tmp_path, [record(1), record(2)]).read_text()
    assert (tmp_path / "acceptance.png").exists()
    assert "rollout_shape" not in text  # records without lengths (older runs): no empty picture


def test_report_says_why_logprob_reads_zero(tmp_path):
    import io

    from rich.console import Console

    folded = [{**record(s), "stage_seconds": {**record(s)["stage_seconds"], "logprob": 0.001},
               "logprob_skipped": True} for s in (1, 2)]
    assert LOGPROB_FOLDED in write_report(tmp_path, folded).read_text().splitlines()
    assert "folded into train" not in write_report(tmp_path / "b", [record(1), record(2)]).read_text()
    buf = io.StringIO()
    Console(file=buf, width=120).print(ProgressDisplay(total_steps=5, enabled=True, live=False)._renderable(folded[0]))
    assert "logprob in train" in buf.getvalue()


def test_amdahl_bound():
    assert amdahl_bound(0.5, 2.0) == pytest.approx(1 / 0.75)
    assert amdahl_bound(1.0, 3.0) == pytest.approx(3.0)
    assert amdahl_bound(None, 3.0) is None


def test_compare_outputs(tmp_path):
    ar = [record(s, gen=4.0) for s in range(1, 4)]
    sd = [record(s, gen=2.0, al=2.5) for s in range(1, 4)]
    s = compare_summary(ar, sd, {"rollouts_identical": True})
    assert s["gen_speedup"] == pytest.approx(2.0)
    assert s["gen_throughput_speedup"] == pytest.approx(2.0)  # the same tokens in both arms
    assert s["step_speedup"] == pytest.approx(5.61 / 3.61)
    assert s["bound"] == pytest.approx(amdahl_bound(4.0 / 5.61, 2.5))
    j, m = write_compare(tmp_path, ar, sd, {"rollouts_identical": True, "weights_identical": True})
    data = json.loads(j.read_text())
    for k in ("gen_speedup", "step_speedup", "bound", "gen_share", "rollouts_identical", "weights_identical"):
        assert k in data
    assert "rollouts_identical | True" in m.read_text()
    assert (tmp_path / "compare_reward.png").exists()


def test_compare_phase_speedups_by_active_batch():
    # AR: 1 token per sequence per step; speculative: twice the tokens per step while 2 are active, but slower
    # per token once one sequence is left (a phase where speculation loses must show, not average away)
    ar_trace = [[0.1, 2, 0, 2], [0.2, 2, 0, 2], [0.3, 1, 0, 1], [0.4, 1, 0, 1]]
    sd_trace = [[0.1, 2, 3, 4], [0.3, 1, 3, 1]]
    ar = [{**record(1), "batch_trace": ar_trace}]
    sd = [{**record(1, al=2.0), "batch_trace": sd_trace}]
    s = compare_summary(ar, sd)
    assert s["phase_speedups"] == {2: pytest.approx(2.0), 1: pytest.approx(0.5)}
    assert s["phase_speedup_min"] == pytest.approx(0.5)
    assert compare_summary([record(1)], [record(1, al=2.0)])["phase_speedup_min"] is None  # no traces


def test_speedup_on_the_autoregressive_arms_work():
    from specrl.run.compare_report import headline
    # AR decodes 2 s with 2 sequences active and 1 s with 1; speculative decodes twice as fast at n=2 and at the
    # same speed at n=1, with replies three times as long (its tokens/s favour it: the batch stays full)
    ar_trace = [[0.5 * (i + 1), 2, 0, 2] for i in range(4)] + [[2.0 + 0.5 * (i + 1), 1, 0, 1] for i in range(2)]
    sd_trace = [[0.25 * (i + 1), 2, 3, 2] for i in range(24)] + [[6.0 + 0.5 * (i + 1), 1, 3, 1] for i in range(2)]
    ar = [{**record(1, gen=3.2), "batch_trace": ar_trace, "generated_tokens": 10}]
    sd = [{**record(1, gen=7.2, al=2.0), "batch_trace": sd_trace, "generated_tokens": 50}]
    s = compare_summary(ar, sd)
    assert s["phase_speedups"] == {2: pytest.approx(2.0), 1: pytest.approx(1.0)}
    # the AR arm's 2 s at n=2 would take 1 s: gen 3.2 -> 2.2 s, step 4.81 -> 3.81 s
    assert s["gen_speedup_ar_work"] == pytest.approx(3.2 / 2.2)
    assert s["step_speedup_ar_work"] == pytest.approx(4.81 / 3.81)
    assert s["gen_speedup"] == pytest.approx(3.2 / 7.2) and s["gen_throughput_speedup"] == pytest.approx(
        (50 / 7.2) / (10 / 3.2))
    lines = headline({**s, "verify": "rejection"})
    assert figures(lead(lines, "generation speed-up: "))[-1] == f"{3.2 / 2.2:.2f}"
    step = lead(lines, "RL step speed-up: ")
    assert figures(step)[-1] == f"{4.81 / 3.81:.2f}" and "arm's work" in step
    assert "autoregressive arm's work" not in " ".join(headline({**s, "verify": "seed_exact"}))  # same tokens
    no_trace = compare_summary([record(1)], [record(1, al=2.0)])
    assert no_trace["gen_speedup_ar_work"] is None and no_trace["step_speedup_ar_work"] is None
    assert "autoregressive arm's work" not in " ".join(headline({**no_trace, "verify": "rejection"}))


def test_progress_rich_panel_renders():
    import io

    from rich.console import Console

    d = ProgressDisplay(total_steps=5, enabled=True, live=False)
    buf = io.StringIO()
    Console(file=buf, width=120).print(d._renderable(record(2, al=2.5)))
    out = buf.getvalue()
    assert "2/5" in out and "2.50" in out and "gen" in out


def test_acceptance_compare(tmp_path):
    from specrl.observability.acceptance_compare import acceptance_compare_table, write_acceptance_compare

    frozen = [record(s, al=2.0 - 0.1 * s) for s in range(1, 7)]
    online = [{**record(s, al=1.8 + 0.05 * s), "draft_updates": 1 + 4 * (s == 3), "draft_refreshed": s == 3}
              for s in range(1, 7)]
    table = acceptance_compare_table({"frozen": frozen, "online": online, "ar": [record(1)]})
    assert table["frozen"]["acceptance_length_first_third"] == pytest.approx((1.9 + 1.8) / 2)
    assert table["frozen"]["acceptance_length_last_third"] == pytest.approx((1.5 + 1.4) / 2)
    assert table["online"]["draft_updates"] == 10 and table["online"]["refreshes"] == 1
    assert table["ar"]["acceptance_length_mean"] is None and table["frozen"]["draft_updates"] == 0
    png, jpath, mpath = write_acceptance_compare(tmp_path, {"frozen": frozen, "online": online})
    assert png.name == "acceptance_frozen_vs_online.png" and png.stat().st_size > 5000
    assert json.loads(jpath.read_text())["online"]["steps"] == 6
    md = mpath.read_text()
    assert table_row(md, "frozen") == ["6", "1.850", "1.450", "1.650", "0", "0"] and table_row(md, "online")[0] == "6"


HW = {"device": "cpu", "processor_class": "AVX512-BF16", "rollout_dtype": "bfloat16", "precision": "bf16-mixed",
      "torch_threads": 2}
VAL = {"speculative": [{"step": 0, "accuracy": 0.125}, {"step": 8, "accuracy": 0.25}, {"step": 16, "accuracy": 0.5}],
       "autoregressive": [{"step": 0, "accuracy": 0.125}, {"step": 16, "accuracy": 0.375}]}


def _arms(n=4, ar_gen=4.0, sd_gen=2.0):
    return ([{**record(s, gen=ar_gen), **HW} for s in range(1, n + 1)],
            [{**record(s, gen=sd_gen, al=2.5), **HW} for s in range(1, n + 1)])


def table_row(md, label):
    """The cells after the label of the one markdown table row whose first cell is `label`."""
    found = [x for x in md.splitlines() if x.startswith(f"| {label} |")]
    assert len(found) == 1, f"{label!r}: {len(found)} rows"
    return [c.strip() for c in found[0].strip().strip("|").split("|")][1:]


def lead(lines, label):
    """The one headline line that starts with `label`: a line is found by its label, not by its position."""
    found = [x for x in lines if x.startswith(label)]
    assert len(found) == 1, f"{label!r}: {len(found)} lines in {lines}"
    return found[0]


def figures(line):
    """The figures a headline line shows, in order: decimals (2.00, 0.125) and counts (3/4); the words around them
    are free to change."""
    return re.findall(r"\d+\.\d+|\d+/\d+", line)


def test_headline_leads_report_and_terminal(tmp_path):
    from specrl.run.compare_report import identity_checks, write_compare_report

    ar, sd = _arms()
    path, lines = write_compare_report(tmp_path, ar, sd, identity_checks("seed_exact", [True] * 4, [True] * 4), VAL)
    # compare.json: the numbers the headline shows (step = 0.01 + 0.1 + gen + 0.5 + 1.0 s)
    s = json.loads((tmp_path / "compare.json").read_text())
    assert s["steps"] == 4 and s["gen_speedup"] == pytest.approx(2.0)
    assert s["step_speedup"] == pytest.approx(5.61 / 3.61) == s["step_per_token_speedup"]
    assert s["acceptance_length"] == 2.5 and s["gen_share"] == pytest.approx(4.0 / 5.61)
    bound = amdahl_bound(4.0 / 5.61, 2.5)
    assert s["bound"] == pytest.approx(bound)
    assert s["parted_at_step"] is None and s["rollouts_identical_per_step"] == s["weights_identical_per_step"] == \
        [True] * 4
    # report.md: the run's name heads it; its bullets, in order, each carry the summary's figures as shown
    text = path.read_text().splitlines()
    assert text[0].startswith("# ") and f"`{tmp_path.name}`" in text[0] and figures(text[2]) == []
    bullets = [x[2:] for x in text if x.startswith("- ")]
    assert [b.split(":")[0] for b in bullets] == ["generation speed-up", "RL step speed-up", "acceptance length AL",
                                                 "generation share R", "lossless (seed_exact)",
                                                 "learning", "hardware", "per-arm reports"]
    assert figures(lead(bullets, "generation speed-up: ")) == ["2.00", "4.00", "2.00"]
    assert figures(lead(bullets, "RL step speed-up: ")) == ["1.55", "5.61", "3.61", "1.55"]
    assert "speculation is slower" not in lead(bullets, "RL step speed-up: ")
    assert figures(lead(bullets, "acceptance length AL: ")) == ["2.50"]
    assert figures(lead(bullets, "generation share R: ")) == ["0.71", f"{bound:.2f}"]
    assert figures(lead(bullets, "lossless (seed_exact): ")) == ["4/4", "4/4"]
    assert figures(lead(bullets, "learning: ")) == ["0.125", "0.500", "0.125", "0.375"]
    assert "same weights" in lead(bullets, "learning: ")  # the final policies: identical after every step
    hw = lead(bullets, "hardware: ")
    assert all(HW[k] in hw for k in ("device", "processor_class", "rollout_dtype", "precision"))
    assert re.findall(r"\]\(([^)]+)\)", lead(bullets, "per-arm reports: ")) == [
        "speculative/report.md", "speculative/final", "autoregressive/report.md", "compare.md"]
    assert lines[1:8] == bullets[:7]  # the terminal's lines: the same, links as paths
    assert lead(lines, "per-arm reports: ").startswith(f"per-arm reports: {tmp_path / 'speculative' / 'report.md'} ")


def test_headline_says_plainly_when_speculation_is_slower():
    from specrl.run.compare_report import compare_summary, headline

    ar, sd = _arms(ar_gen=2.0, sd_gen=2.5)
    summary = compare_summary(ar, sd, {"verify": "seed_exact", "rollouts_identical_per_step": [True] * 4,
                                       "weights_identical_per_step": [True] * 4})
    assert summary["gen_speedup"] == pytest.approx(0.8) and summary["step_speedup"] == pytest.approx(3.61 / 4.11)
    lines = headline(summary)
    assert figures(lead(lines, "generation speed-up: ")) == ["0.80", "2.00", "2.50"]
    step = lead(lines, "RL step speed-up: ")
    assert figures(step) == ["0.88", "3.61", "4.11", "0.88"] and "slower" in step
    assert figures(lead(lines, "learning: ")) == []  # no validation records: n/a, no figure


def test_headline_of_a_parted_run_says_where():
    from specrl.run.compare_report import compare_summary, headline, identity_checks, learning_summary

    checks = identity_checks("seed_exact", [True, True, False, False], [True, False, False, False])
    assert checks["parted_at_step"] == 2 and checks["rollouts_identical"] is False
    assert checks["weights_parted_at_step"] == 2
    ar, sd = _arms()
    summary = compare_summary(ar, sd, checks)
    summary["learning"] = learning_summary(VAL, default_n=16)
    assert summary["gen_throughput_speedup"] == pytest.approx(2.0)
    lines = headline(summary, VAL)
    # once the arms differ the generation line adds the tokens-per-generation-second figure
    assert figures(lead(lines, "generation speed-up: ")) == ["2.00", "4.00", "2.00", "2.00"]
    identity = lead(lines, "lossless (seed_exact): ")
    assert figures(identity) == ["2/4", "1/4"] and "step 2" in identity
    learned = lead(lines, "learning: ")  # parted: two policies, compared by their accuracies (TOST)
    assert "same weights" not in learned and "TOST" in learned


def test_headline_of_a_run_whose_rollouts_differed_but_weights_did_not():
    """A token that differs without changing the update (as in a zero-advantage group) is not a parting: the
    headline lists the steps whose rollouts differed and says the training stayed the same."""
    from specrl.run.compare_report import compare_summary, headline, identity_checks

    checks = identity_checks("seed_exact", [True, False, True, True], [True, True, True, True])
    assert checks["parted_at_step"] == 2 and checks["weights_parted_at_step"] is None
    ar, sd = _arms()
    lines = headline(compare_summary(ar, sd, checks), VAL)
    identity = lead(lines, "lossless (seed_exact): ")
    assert figures(identity) == ["3/4", "4/4"] and "step(s) 2 " in identity and "parted" not in identity


def test_headline_under_rejection_sampling_and_bad_checks():
    from specrl.run.compare_report import compare_summary, headline, identity_checks

    checks = identity_checks("rejection", [], [])
    assert checks["rollouts_identical"] is None and checks["parted_at_step"] is None
    ar, sd = _arms()
    lines = headline(compare_summary(ar, sd, checks))
    assert figures(lead(lines, "lossless (verify=rejection): ")) == []  # nothing compared, so no counts
    with pytest.raises(ValueError, match=r"identity check.*\b2\b.*\b1\b"):
        identity_checks("seed_exact", [True, True], [True])


def test_report_names_the_hardware(tmp_path):
    recs = [{**record(1), **HW}, {**record(2), **HW, "torch_threads": 1}]
    text = write_report(tmp_path, recs).read_text()
    (hw,) = table_row(text, "hardware")
    assert all(f in hw for f in ("cpu", "AVX512-BF16", "1–2 torch threads", "rollouts bfloat16", "training bf16-mixed"))
    (one,) = table_row(write_report(tmp_path / "one", [{**record(1), **HW, "torch_threads": 1}]).read_text(),
                       "hardware")
    assert re.search(r"\b1 torch thread\b(?!s)", one) and "AVX512-BF16" in one
    (old,) = table_row(write_report(tmp_path / "old", [record(1)]).read_text(), "hardware")
    assert old.count("not recorded") == 4 and "torch thread" not in old


def test_headline_of_a_rejection_run_gives_the_per_token_figure_and_a_budget_stop():
    """verify=rejection: the arms sample different tokens from the first step, so the generation line carries the
    tokens-per-generation-second ratio; a run its time budget stopped says so in the first line."""
    from specrl.run.compare_report import compare_summary, headline, identity_checks

    ar, sd = _arms()
    checks = {**identity_checks("rejection", [], []), "stopped_early": "stopped by run.time_budget_minutes=7 after "
              "step 4 of 12"}
    lines = headline(compare_summary(ar, sd, checks), VAL)
    assert lead(lines, "speculative vs autoregressive rollouts: ").endswith(f"; {checks['stopped_early']}")
    assert figures(lead(lines, "generation speed-up: ")) == ["2.00", "4.00", "2.00", "2.00"]
    lead(lines, "lossless (verify=rejection): ")
    plain = headline(compare_summary(ar, sd, identity_checks("rejection", [], [])), VAL)
    assert "stopped" not in plain[0] and plain[1:] == lines[1:]
