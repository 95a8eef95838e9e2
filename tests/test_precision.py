"""Device and precision resolved from the hardware: `auto` rules, explicit values, warnings, records."""

import re
import warnings

import pytest
import torch

from specrl import device as dv
from specrl.config.hardware import hardware_fields, resolve_hardware
from specrl.errors import SpecRLError
from specrl.trainer.config_check import validate_config

FLAGS = {
    "AVX2": "fpu sse2 avx avx2 fma",
    "AVX512": "fpu sse2 avx avx2 fma avx512f avx512bw avx512vl",
    "AVX512-BF16": "fpu avx2 avx512f avx512bw avx512_bf16",
    "AMX": "fpu avx2 avx512f avx512_bf16 amx_bf16 amx_tile",
}


@pytest.fixture
def cpu_as(monkeypatch):
    """Pretend /proc/cpuinfo lists the flags of a processor class."""
    for var in dv.ISA_LIMIT_VARS:
        monkeypatch.delenv(var, raising=False)

    def set_class(name: str) -> None:
        text = f"processor\t: 0\nvendor_id\t: AuthenticAMD\nflags\t\t: {FLAGS[name]}\n"
        monkeypatch.setattr(dv, "_read_cpuinfo", lambda: text)
        dv.cpu_flags.cache_clear()
    yield set_class
    dv.cpu_flags.cache_clear()


@pytest.mark.parametrize("cls,dtype,precision", [("AVX2", "float32", "fp32"), ("AVX512", "float32", "fp32"),
                                                 ("AVX512-BF16", "bfloat16", "bf16-mixed"),
                                                 ("AMX", "bfloat16", "bf16-mixed")])
def test_auto_follows_the_processor(cpu_as, cls, dtype, precision):
    cpu_as(cls)
    assert dv.processor_class() == cls
    assert dv.resolve_dtype("auto", "cpu") == dtype
    assert dv.resolve_precision("auto", "cpu") == precision
    cfg = resolve_hardware(validate_config({}))
    assert (cfg.run.device, cfg.model.rollout_dtype, cfg.policy.precision, cfg.rollout.vllm.dtype) == \
        ("cpu", dtype, precision, dtype)
    assert hardware_fields(cfg) == {"device": "cpu", "processor_class": cls, "rollout_dtype": dtype,
                                    "precision": precision}


@pytest.mark.parametrize("var,value,cls", [
    ("ONEDNN_MAX_CPU_ISA", "AVX2", "AVX2"), ("ONEDNN_MAX_CPU_ISA", "avx512_core", "AVX512"),
    ("ONEDNN_MAX_CPU_ISA", "AVX512_CORE_BF16", "AVX512-BF16"), ("ONEDNN_MAX_CPU_ISA", "AVX512_CORE_AMX", "AMX"),
    ("ONEDNN_MAX_CPU_ISA", "ALL", "AMX"), ("ATEN_CPU_CAPABILITY", "avx2", "AVX2"),
    ("ATEN_CPU_CAPABILITY", "avx512", "AMX"), ("MKL_ENABLE_INSTRUCTIONS", "AVX2", "AVX2"),
    ("MKL_ENABLE_INSTRUCTIONS", "AVX512", "AMX")])
def test_an_isa_limit_in_the_environment_lowers_the_class(cpu_as, monkeypatch, var, value, cls):
    cpu_as("AMX")
    monkeypatch.setenv(var, value)
    assert dv.processor_class() == cls
    rec = dv.hardware_record()
    assert rec["processor_class"] == cls and rec["cpu_flags_class"] == "AMX" and rec["isa_limit"] == {var: value}
    desc = dv.describe_class()
    assert desc.split()[0] == cls and f"{var}={value}" in desc and re.search(r"\bAMX\)$", desc)
    fast = cls in ("AMX", "AVX512-BF16")
    cfg = resolve_hardware(validate_config({}))
    assert (cfg.model.rollout_dtype, cfg.policy.precision) == \
        (("bfloat16", "bf16-mixed") if fast else ("float32", "fp32"))


def test_an_unknown_onednn_isa_is_a_clear_error(cpu_as, monkeypatch):
    cpu_as("AMX")
    monkeypatch.setenv("ONEDNN_MAX_CPU_ISA", "AVX3")
    with pytest.raises(SpecRLError, match=r"ONEDNN_MAX_CPU_ISA='AVX3'.*AVX2.*AVX512_CORE_BF16"):
        dv.processor_class()


def test_a_limit_never_raises_the_class(cpu_as, monkeypatch):
    cpu_as("AVX2")
    monkeypatch.setenv("ONEDNN_MAX_CPU_ISA", "AVX512_CORE_AMX")
    assert dv.processor_class() == "AVX2" and dv.resolve_dtype("auto", "cpu") == "float32"
    monkeypatch.setenv("ONEDNN_MAX_CPU_ISA", "")
    assert dv.isa_limit() == {} and dv.describe_class() == "AVX2"


def test_an_explicit_bf16_is_honoured_with_a_warning_on_avx2(cpu_as):
    cpu_as("AVX2")
    with pytest.warns(dv.SlowPrecisionWarning,
                      match=r"rollout_dtype=bfloat16.*AVX2.*auto.*float32"):
        assert dv.resolve_dtype("bfloat16", "cpu", "model.rollout_dtype") == "bfloat16"
    with pytest.warns(dv.SlowPrecisionWarning, match="policy.precision=bf16-mixed"):
        cfg = resolve_hardware(validate_config({"policy": {"precision": "bf16-mixed"},
                                                "model": {"rollout_dtype": "float32"}}))
    assert cfg.policy.precision == "bf16-mixed" and cfg.model.rollout_dtype == "float32"


def test_no_warning_where_bf16_is_fast(cpu_as):
    cpu_as("AVX512-BF16")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert dv.resolve_dtype("bfloat16", "cpu") == "bfloat16"
        assert dv.resolve_dtype("float32", "cpu") == "float32"


def test_resolution_is_idempotent_and_recorded_in_config_yaml(cpu_as, tmp_path):
    from specrl.run.loop import release_run, setup_run

    cpu_as("AVX2")
    cfg, run_dir = setup_run(None, ["run.steps=1"], None, str(tmp_path / "r"))
    release_run(run_dir)
    saved = (run_dir / "config.yaml").read_text()
    assert "rollout_dtype: float32" in saved and "precision: fp32" in saved and "device: cpu" in saved
    assert "auto" not in [cfg.run.device, cfg.model.rollout_dtype, cfg.policy.precision]
    assert resolve_hardware(cfg) == cfg


def test_device_settings_are_checked():
    with pytest.raises(SpecRLError, match=r"device.*cuda:N.*'gpu'"):
        validate_config({"run": {"device": "gpu"}})
    with pytest.raises(SpecRLError, match=r"device.*cuda:N, got 'tpu'"):
        dv.resolve_device("tpu")
    assert dv.resolve_device("cpu") == torch.device("cpu")
    if not torch.cuda.is_available():
        assert dv.resolve_device("auto") == torch.device("cpu")
        with pytest.raises(SpecRLError, match=r"no CUDA device.*visible"):
            dv.resolve_device("cuda:0")
        with pytest.raises(SpecRLError, match=r"no CUDA device.*visible"):
            resolve_hardware(validate_config({"run": {"device": "cuda"}}))


def test_load_model_defaults_to_the_processors_dtype(cpu_as):
    from specrl.model.loader import load_model

    cpu_as("AVX2")
    model, _ = load_model("smollm2-135m")
    assert model.embed_tokens.weight.dtype == torch.float32
    cpu_as("AVX512-BF16")
    model, _ = load_model("smollm2-135m")
    assert model.embed_tokens.weight.dtype == torch.bfloat16


def test_the_cli_dtype_option(cpu_as):
    from specrl.cli.common import dtype_option as _dtype

    cpu_as("AVX2")
    assert _dtype("auto") == torch.float32
    assert _dtype("fp32") == torch.float32
    with pytest.warns(dv.SlowPrecisionWarning):
        assert _dtype("bf16") == torch.bfloat16
    with pytest.raises(SpecRLError, match=r"--dtype.*bf16.*fp32.*'half'"):
        _dtype("half")


def test_the_hardware_record_names_the_processor(cpu_as):
    cpu_as("AVX512")
    rec = dv.hardware_record()
    assert rec["processor_class"] == "AVX512" and rec["cpu_cores"] >= 1 and rec["device"] == "cpu"


def test_a_run_saved_with_the_vllm_settings_under_rollout_resumes(tmp_path, capsys):
    """A run directory whose config.yaml predates the rollout.vllm section resumes with its own settings."""
    import yaml

    from specrl.run.loop import release_run, setup_run

    cfg, run_dir = setup_run(None, ["run.steps=1"], None, str(tmp_path / "r"))
    release_run(run_dir)
    data = yaml.safe_load((run_dir / "config.yaml").read_text())
    vllm = data["rollout"].pop("vllm")
    data["rollout"].update({"dtype": "float32", "probe_samples": 64, "sampling_fix": vllm["sampling_fix"]})
    (run_dir / "config.yaml").write_text(yaml.safe_dump(data))
    cfg, _ = setup_run(None, [], str(run_dir), None)
    release_run(run_dir)
    moved = re.search(r"moved (.+) to rollout\.vllm", capsys.readouterr().err)
    assert moved and moved[1].split(", ") == ["rollout.dtype", "rollout.sampling_fix", "rollout.probe_samples"]
    assert cfg.rollout.vllm.dtype == "float32" and cfg.rollout.vllm.probe_samples == 64
    assert "vllm" in yaml.safe_load((run_dir / "config.yaml").read_text())["rollout"]
    with pytest.raises(SpecRLError, match=r"rollout\.vllm\.dtype"):  # a user's own file: the error, not a move
        validate_config({"rollout": {"dtype": "float32"}})
