"""benchmarks/memory.py without training: placing samples in steps and stages, the growth statistics, the
lost-step check, process roles, the CPU-load processes (killed, no orphan), and `common.run_dirs` cleanup."""

import json
import subprocess
import sys
import time

import psutil
import pytest

from tests.bench import load_benchmark

# `make test` runs this module alone, after its parallel part:
# it samples live process trees on 0.1 s intervals and kills them at short timeouts.
pytestmark = pytest.mark.serial

MB = 1e6


@pytest.fixture(scope="module")
def mem():
    return load_benchmark("memory", "bench_memory")


@pytest.fixture(scope="module")
def common():
    return load_benchmark("common", "bench_common_mem")


def _sample(mem, t, rss_mb, fds=40, roles=("driver",)):
    per = rss_mb * MB / len(roles)
    return mem.Sample(t, [mem.Proc(i + 1, r, int(per), int(per * 0.9), fds // len(roles), 5)
                          for i, r in enumerate(roles)])


def _sync_end(mem, step, end, val=0.0, arm="run"):
    # stages laid back from end - val: train (end-val-4, end-val], logprob 2 s, gen 3 s, prepare 1 s, data 0
    return mem.StepEnd(arm, step, end, {"data": 0.0, "prepare": 1.0, "gen": 3.0, "logprob": 2.0, "train": 4.0}, val)


def test_stage_at_lays_the_stage_seconds_back_from_the_end_after_validation(mem):
    e = _sync_end(mem, 1, 100.0, val=5.0)
    assert e.stage_at(99.0) == "validate"
    assert e.stage_at(94.0) == "train" and e.stage_at(91.5) == "train"
    assert e.stage_at(90.5) == "logprob"
    assert e.stage_at(88.5) == "gen" and e.stage_at(86.5) == "gen"
    assert e.stage_at(85.5) == "prepare"
    assert e.stage_at(84.0) == "between"
    assert mem.StepEnd("run", 1, 100.0).stage_at(99.0) is None  # async: no stage


def test_step_end_from_a_record_knows_sync_from_async(mem):
    sync = {"step": 2, "stage_seconds": {"data": 0.1, "prepare": 0.2, "gen": 3.0, "logprob": 1.0, "train": 2.0},
            "val_seconds": 4.0}
    e = mem.StepEnd.from_record("run", sync, 50.0)
    assert e.step == 2 and e.stage_seconds["gen"] == 3.0 and e.val_seconds == 4.0
    a = mem.StepEnd.from_record("run", {**sync, "exposed_gen_seconds": 0.5}, 50.0)
    assert a.stage_seconds == {} and a.stage_at(49.0) is None


def test_samples_are_placed_in_steps_and_stages(mem):
    ends = [_sync_end(mem, 1, 20.0), _sync_end(mem, 2, 40.0)]
    # step 1: prepare (10, 11], gen (11, 14], logprob (14, 16], train (16, 20]; before 10 the setup
    samples = [_sample(mem, t, 1000) for t in (1.0, 10.5, 12.0, 15.0, 19.5, 22.0, 33.0, 39.0, 41.0)]
    got = [(p.step, p.stage) for p in mem.place(samples, ends)]
    assert got == [(1, "setup"), (1, "prepare"), (1, "gen"), (1, "logprob"), (1, "train"), (2, "between"),
                   (2, "gen"), (2, "train"), (None, None)]


def test_compare_arms_interleave_and_are_kept_apart(mem):
    ends = [_sync_end(mem, 1, 20.0, arm="autoregressive"), _sync_end(mem, 1, 32.0, arm="speculative")]
    samples = [_sample(mem, 19.0, 1000), _sample(mem, 25.0, 1500), _sample(mem, 31.0, 1200)]
    recs = mem.step_records(samples, ends)
    assert [(r["arm"], r["step"], r["samples"]) for r in recs] == [("autoregressive", 1, 1), ("speculative", 1, 2)]
    assert recs[1]["peak_rss_mb"] == pytest.approx(1500) and recs[1]["peak_rss_mb_per_stage"] == {
        "gen": pytest.approx(1500), "train": pytest.approx(1200)}


def test_step_records_hold_peaks_per_role_and_stage_and_the_end_fds(mem):
    ends = [_sync_end(mem, 1, 20.0)]
    samples = [_sample(mem, 10.5, 1000, fds=40, roles=("driver", "raylet")),
               _sample(mem, 12.0, 3000, fds=60, roles=("driver", "raylet")),
               _sample(mem, 19.0, 2000, fds=50, roles=("driver", "raylet"))]
    (r,) = mem.step_records(samples, ends)
    assert r["peak_rss_mb"] == pytest.approx(3000) and r["peak_pss_mb"] == pytest.approx(2700, rel=1e-3)
    assert r["peak_rss_mb_per_role"] == {"driver": pytest.approx(1500), "raylet": pytest.approx(1500)}
    assert r["peak_rss_mb_per_stage"] == {"prepare": pytest.approx(1000), "gen": pytest.approx(3000),
                                          "train": pytest.approx(2000)}
    assert r["fds_end"] == 50 and r["threads_end"] == 10


def _series(mem, peaks, fds):
    ends, samples = [], []
    for i, (p, f) in enumerate(zip(peaks, fds, strict=True)):
        end = 10.0 * (i + 1)
        ends.append(mem.StepEnd("run", i + 1, end))
        samples += [_sample(mem, end - 5, p * 0.5, fds=f), _sample(mem, end - 1, p, fds=f)]
    return samples, ends


def test_a_flat_series_has_no_growth(mem):
    samples, ends = _series(mem, [2000.0] * 30, [120] * 30)
    s = mem.summarize(samples, ends, warmup=10, expected=30, arms=["run"])
    g = s["growth_after_warmup"]["run"]
    assert g["steps"] == [11, 30] and g["rss_mb"]["n"] == 20
    assert g["rss_mb"]["slope_per_step"] == pytest.approx(0.0, abs=1e-9) and g["rss_mb"]["spread"] == 0.0
    assert g["fds"]["slope_per_step"] == pytest.approx(0.0, abs=1e-9)
    assert s["steps"]["run"]["complete"]


def test_a_leaking_series_shows_the_planted_slope_after_warm_up(mem):
    # warm-up steps jump around; after it: +7.5 MB and +2 fds per step
    peaks = [500.0, 3000.0, 1200.0, 2500.0] + [2000.0 + 7.5 * i for i in range(16)]
    fds = [10, 300, 50, 200] + [100 + 2 * i for i in range(16)]
    samples, ends = _series(mem, peaks, fds)
    g = mem.summarize(samples, ends, warmup=4, expected=20, arms=["run"])["growth_after_warmup"]["run"]
    assert g["rss_mb"]["slope_per_step"] == pytest.approx(7.5, rel=1e-6)
    assert g["rss_mb"]["spread"] == pytest.approx(7.5 * 15)
    assert g["fds"]["slope_per_step"] == pytest.approx(2.0) and g["fds"]["spread"] == 30


def test_growth_needs_two_points(mem):
    assert mem.growth([1.0]) == {"n": 1, "slope_per_step": None, "spread": None}
    assert mem.growth([1.0, 3.0, 5.0])["slope_per_step"] == pytest.approx(2.0)


def test_a_gap_in_the_step_numbers_is_a_lost_step(mem):
    c = mem.step_check([1, 2, 4, 5], expected=5)
    assert not c["complete"] and c["missing"] == [3] and c["recorded"] == 4
    c = mem.step_check([1, 2, 2, 3], expected=3)
    assert not c["complete"] and c["repeated"] == [2] and c["missing"] == []
    c = mem.step_check([1, 2, 3], expected=4)
    assert not c["complete"] and c["missing"] == [4]
    assert mem.step_check([1, 2, 3], expected=3)["complete"]


def test_the_summary_names_the_step_and_stage_of_the_peak(mem):
    ends = [_sync_end(mem, 1, 20.0), _sync_end(mem, 2, 40.0)]
    samples = [_sample(mem, 15.0, 1000, roles=("driver", "ray::RolloutWorker")),
               _sample(mem, 33.0, 4000, roles=("driver", "ray::RolloutWorker")),
               _sample(mem, 39.0, 1000)]
    s = mem.summarize(samples, ends, warmup=0, expected=3, arms=["run"])
    assert s["peak"]["step"] == 2 and s["peak"]["stage"] == "gen" and s["peak"]["rss_mb"] == pytest.approx(4000)
    assert s["peak"]["rss_mb_per_role"] == {"driver": pytest.approx(2000), "ray::RolloutWorker": pytest.approx(2000)}
    assert s["steps"]["run"]["missing"] == [3]


def test_metrics_tail_reads_complete_lines_only(mem, tmp_path):
    path = tmp_path / "metrics.jsonl"
    tail = mem.MetricsTail(path, "run")
    assert tail.poll() == []  # not written yet
    rec = {"step": 1, "stage_seconds": {"data": 0, "prepare": 0, "gen": 1.0, "logprob": 0.5, "train": 1.0}}
    path.write_text(json.dumps(rec) + "\n" + json.dumps({**rec, "step": 2})[:20])
    (e,) = tail.poll()
    assert e.step == 1 and e.arm == "run" and e.stage_seconds["gen"] == 1.0
    with path.open("a") as f:
        f.write(json.dumps({**rec, "step": 2})[20:] + "\n")
    assert [x.step for x in tail.poll()] == [2]
    assert tail.poll() == []


@pytest.mark.parametrize("cmdline, root, role", [
    (["python", "-m", "specrl.cli", "train"], True, "driver"),
    (["ray::RolloutWorker.generate"], False, "ray::RolloutWorker"),
    (["ray::LearnerActor"], False, "ray::LearnerActor"),
    (["ray::IDLE"], False, "ray::IDLE"),
    (["/venv/lib/python3.11/site-packages/ray/core/src/ray/raylet/raylet", "--node_ip_address=1"], False, "raylet"),
    (["/venv/lib/python3.11/site-packages/ray/core/src/ray/gcs/gcs_server", "--port=1"], False, "gcs_server"),
    (["/venv/bin/python", "-u", "/venv/lib/ray/dashboard/dashboard.py"], False, "other"),
    ([], False, "other"),
])
def test_roles_from_the_command_line(mem, cmdline, root, role):
    assert mem.role_of(cmdline, root) == role


def test_load_processes_are_started_and_killed(mem):
    with mem.cpu_load(2) as procs:
        pids = [p.pid for p in procs]
        assert len(pids) == 2
        for pid in pids:
            p = psutil.Process(pid)
            # Popen returns once exec has begun; the kernel fills /proc/<pid>/cmdline a moment later, so an
            # empty list is "not yet", not a wrong command
            for _ in range(500):
                cmd = p.cmdline()
                if cmd:
                    break
                time.sleep(0.01)
            assert p.is_running() and cmd[-1] == mem.LOAD_CODE, cmd
    assert not [pid for pid in pids if psutil.pid_exists(pid) and psutil.Process(pid).status() != "zombie"]


def test_load_processes_are_killed_on_an_exception(mem):
    pids = []
    with pytest.raises(KeyboardInterrupt), mem.cpu_load(1) as procs:
        pids = [p.pid for p in procs]
        raise KeyboardInterrupt
    assert pids and not any(psutil.pid_exists(pid) for pid in pids)


def test_the_tree_sampler_sees_children_and_kill_tree_ends_them(mem):
    code = "import subprocess, sys, time; subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)']); " \
           "time.sleep(60)"
    root = subprocess.Popen([sys.executable, "-c", code])
    try:
        sampler = mem.TreeSampler(root.pid)
        for _ in range(50):
            s = sampler.sample()
            if s is not None and len(s.procs) == 2:
                break
            time.sleep(0.1)
        assert len(s.procs) == 2 and s.procs[0].role == "driver" and s.procs[1].role == "other"
        assert s.rss > 1e6 and s.fds >= 3 and s.threads >= 2
        assert {p["pid"] for p in sampler.peaks.values()} == {p.pid for p in s.procs}
        mem.kill_tree(sampler.alive(), timeout=5)
        root.wait(timeout=5)
        assert sampler.alive() == []
    finally:
        if root.poll() is None:
            root.kill()


def test_run_dirs_removes_what_it_collected(common, tmp_path, capsys):
    keep_me = tmp_path / "results.json"
    keep_me.write_text("{}")
    with common.run_dirs(keep=False) as dirs:
        a = dirs.add(tmp_path / "arm-a")
        (a / "checkpoints").mkdir(parents=True)
        (a / "metrics.jsonl").write_text("{}\n")
        dirs.add(tmp_path / "never-created")
    assert not a.exists() and keep_me.exists()
    assert "removed run directories" in capsys.readouterr().out


def test_run_dirs_removes_on_an_exception_too(common, tmp_path):
    with pytest.raises(RuntimeError), common.run_dirs(keep=False) as dirs:
        dirs.add(tmp_path / "arm").mkdir()
        raise RuntimeError("arm failed")
    assert not (tmp_path / "arm").exists()


def test_run_dirs_keeps_them_with_keep(common, tmp_path, capsys):
    with common.run_dirs(keep=True) as dirs:
        a = dirs.add(tmp_path / "arm")
        a.mkdir()
    assert a.is_dir() and "kept run directories" in capsys.readouterr().out


def _script(tmp_path, body: str) -> list[str]:
    path = tmp_path / "fake_train.py"
    path.write_text(body)
    return [sys.executable, str(path)]


def test_measure_tails_a_real_process_and_reports_the_lost_step(mem, tmp_path):
    metrics = tmp_path / "metrics.jsonl"
    cmd = _script(tmp_path, f"""
import json, time
x = bytearray(50_000_000)  # memory the sampler should see
for step in (1, 2, 4):
    time.sleep(0.4)
    with open({str(metrics)!r}, "a") as f:
        f.write(json.dumps({{"step": step, "stage_seconds": {{"gen": 0.1, "train": 0.1}}}}) + "\\n")
time.sleep(0.4)
""")
    m = mem.measure(cmd, [mem.MetricsTail(metrics, "run")], interval=0.1, timeout=60)
    assert m["returncode"] == 0 and not m["hang"] and not m["interrupted"] and m["leftover"] == []
    assert [e.step for e in m["ends"]] == [1, 2, 4] and len(m["samples"]) >= 5
    s = mem.summarize(m["samples"], m["ends"], warmup=0, expected=4, arms=["run"])
    assert s["steps"]["run"]["missing"] == [3] and not s["steps"]["run"]["complete"]
    assert s["peak"]["rss_mb"] > 50 and s["peak"]["rss_mb_per_role"].keys() == {"driver"}


def test_measure_kills_a_hung_tree_at_the_timeout(mem, tmp_path):
    pidfile = tmp_path / "child.pid"
    cmd = _script(tmp_path, f"""
import subprocess, sys, time
p = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
open({str(pidfile)!r}, "w").write(str(p.pid))
time.sleep(60)
""")
    m = mem.measure(cmd, [], interval=0.1, timeout=1.5)
    assert m["hang"] and m["returncode"] != 0 and m["ends"] == []
    child = int(pidfile.read_text())
    assert not psutil.pid_exists(child) or psutil.Process(child).status() == psutil.STATUS_ZOMBIE


def test_measure_reports_and_kills_a_process_left_behind(mem, tmp_path):
    cmd = _script(tmp_path, """
import subprocess, sys, time
subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"], start_new_session=True)
time.sleep(1.0)
""")
    m = mem.measure(cmd, [], interval=0.1, timeout=60)
    assert m["returncode"] == 0 and len(m["leftover"]) == 1 and "time.sleep(60)" in m["leftover"][0]["cmdline"]
    pid = m["leftover"][0]["pid"]
    assert not psutil.pid_exists(pid) or psutil.Process(pid).status() == psutil.STATUS_ZOMBIE


def test_each_step_carries_the_run_directory_size_and_its_growth(mem, tmp_path):
    run = tmp_path / "run"
    run.mkdir()
    path = run / "metrics.jsonl"
    tail = mem.MetricsTail(path, "run")
    rec = {"step": 1, "stage_seconds": {"data": 0, "prepare": 0, "gen": 1.0, "logprob": 0.5, "train": 1.0}}
    path.write_text(json.dumps(rec) + "\n")
    (run / "ckpt").mkdir()
    (run / "ckpt" / "a.bin").write_bytes(b"x" * 3_000_000)
    (e,) = tail.poll()
    assert e.disk_mb == pytest.approx(3.0 + path.stat().st_size / MB)
    assert mem.dir_mb(tmp_path / "missing") is None
    # a run directory that grows 5 MB per step shows it after warm-up; a steady one does not
    samples, ends = _series(mem, [2000.0] * 6, [40] * 6)
    for i, x in enumerate(ends):
        x.disk_mb = 100.0 + 5.0 * i
    g = mem.summarize(samples, ends, warmup=1, expected=6, arms=["run"])["growth_after_warmup"]["run"]
    assert g["disk_mb"]["slope_per_step"] == pytest.approx(5.0) and g["disk_mb"]["spread"] == pytest.approx(20.0)
