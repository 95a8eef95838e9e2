"""Every benchmark records where it ran: `benchmarks/common.py`'s `run_header` (processor class, cores, threads,
dtypes), and a static check that each script in benchmarks/ calls it once and stores it under "hardware" in the
JSON it writes."""

import ast
import json
import re

import pytest

from specrl import device as dv
from tests.bench import BENCH, load_benchmark

# scripts that measure nothing: they analyse another script's JSON and print the hardware record it carries
ANALYSES = {"k_decision.py"}
SCRIPTS = sorted(p for p in BENCH.glob("*.py") if p.name != "common.py" and p.name not in ANALYSES)
# scripts that write (or print) a JSON result document: each puts run_header's record under "hardware"
JSON_WRITERS = {"backend_overlay.py", "drafter_budget.py", "drafter_frozen_vs_online.py", "drafter_online_cost.py",
                "drafter_generic_vs_indomain.py", "engine_speed.py", "memory.py", "packed_fp32.py", "pipelines.py",
                "seq_k.py", "sim_fidelity.py", "sim_pipelines.py", "spec_vs_ar.py", "learner_scaling.py",
                "history_memory.py", "draft_vocab_cost.py", "drafter_train_step.py", "task_difficulty.py",
                "trl_rollouts.py", "sequence_law.py", "rollout_stage.py"}
KEYS = {"processor_class", "cpu_flags_class", "isa_limit", "cpu_cores", "torch_cpu_capability", "device", "torch",
        "threads", "dtypes"}


@pytest.fixture(scope="module")
def common():
    return load_benchmark("common", "bench_common")


def test_run_header_records_processor_cores_threads_and_dtypes(common, capsys):
    rec = common.run_header({"rollout": "bfloat16", "train": "fp32"}, threads=1)
    assert KEYS <= rec.keys()
    assert rec["processor_class"] == dv.processor_class() and rec["cpu_cores"] >= 1
    assert rec["threads"] == 1 and rec["dtypes"] == {"rollout": "bfloat16", "train": "fp32"}
    assert json.loads(json.dumps(rec)) == rec  # goes into the scripts' JSON as is
    out = capsys.readouterr().out
    line = common.hardware_line(rec)
    assert out == f"[bench] hardware: {line}\n"
    assert re.search(rf"processor {re.escape(rec['processor_class'])}\b", line)
    assert re.search(rf"\b{rec['cpu_cores']} cores\b", line) and re.search(r"\bthreads 1\b", line)
    assert re.search(r"\bdtypes rollout=bfloat16 train=fp32$", line)


def test_run_header_names_the_class_from_the_cpu_flags(common, monkeypatch, capsys):
    text = "processor\t: 0\nflags\t\t: fpu avx2 avx512f avx512bw avx512_bf16\n"
    monkeypatch.setattr(dv, "_read_cpuinfo", lambda: text)
    for var in dv.ISA_LIMIT_VARS:
        monkeypatch.delenv(var, raising=False)
    dv.cpu_flags.cache_clear()
    try:
        rec = common.run_header({})
        assert rec["processor_class"] == "AVX512-BF16" and rec["dtypes"] == {}
        assert isinstance(rec["threads"], int)  # None -> this process's torch threads
        assert "processor AVX512-BF16," in capsys.readouterr().out and "dtypes none" in common.hardware_line(rec)
        assert common.dtype_name("auto") == "bfloat16"
        monkeypatch.setenv("ONEDNN_MAX_CPU_ISA", "AVX2")
        rec = common.run_header({})
        assert common.hardware_line(rec).startswith(
            "processor AVX2 (ONEDNN_MAX_CPU_ISA=AVX2; the CPU's flags say AVX512-BF16), ")
        assert common.dtype_name("auto") == "float32"
    finally:
        dv.cpu_flags.cache_clear()


def _calls(tree: ast.AST, name: str) -> list[ast.Call]:
    return [n for n in ast.walk(tree) if isinstance(n, ast.Call)
            and (getattr(n.func, "id", None) == name or getattr(n.func, "attr", None) == name)]


@pytest.mark.parametrize("name", sorted(ANALYSES))
def test_an_analysis_script_reports_the_hardware_of_its_input(name):
    src = (BENCH / name).read_text()
    assert 'data.get("hardware"' in src or 'data["hardware"]' in src, f"{name} does not print its input's hardware"
    assert not _calls(ast.parse(src), "run_header"), f"{name} measures nothing, so it records no hardware of its own"


@pytest.mark.parametrize("path", SCRIPTS, ids=lambda p: p.name)
def test_every_benchmark_records_its_hardware(path):
    src = path.read_text()
    tree = ast.parse(src)
    imported = {a.name for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) and n.module == "common"
                for a in n.names}
    assert "run_header" in imported, f"{path.name} does not import run_header from common"
    calls = _calls(tree, "run_header")
    assert len(calls) == 1, f"{path.name} calls run_header {len(calls)} times (once at start)"
    assert calls[0].args or any(k.arg == "dtypes" for k in calls[0].keywords), f"{path.name}: no dtypes given"
    if path.name in JSON_WRITERS:
        assert '"hardware"' in src, f"{path.name} writes JSON without the hardware record"


def test_the_json_writer_list_is_current():
    """A script that starts writing a JSON document joins JSON_WRITERS (workers' `RESULT {...}` lines are not)."""
    marks = ("json.dump(", "write_text(json.dumps(", "print(json.dumps({")
    assert {p.name for p in SCRIPTS if any(m in p.read_text() for m in marks)} == JSON_WRITERS
