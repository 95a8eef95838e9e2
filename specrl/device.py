"""Which device a run uses and which precision that device computes fast, resolved once at start.

`run.device` (auto | cpu | cuda | cuda:N) names where the policy, its rollout copy, the reference model, the
drafter and their training live; `auto` is CUDA when a CUDA device is visible, else the CPU. Precision settings
(`model.rollout_dtype`, `policy.precision`, the vLLM backend's `rollout.vllm.dtype`, the CLI's `--dtype`) accept
`auto`, resolved here from what the hardware does fast: bfloat16 on a CUDA device that supports it and on CPUs
with bf16 matrix units (the `avx512_bf16` or `amx_bf16` flags of /proc/cpuinfo), float32 everywhere else. On an
AVX2-only CPU a bf16 matrix product is emulated and runs ~6.6x slower than fp32 (measured: F.linear at the
decode shape [32, 576] x [576, 1536], one thread, fp32 0.98 ms vs bf16 6.5 ms), so an explicit bf16 there is
honoured with a warning that says so. `processor_class()` names the CPU class every benchmark records (torch's
`get_cpu_capability()` reports AVX512 for CPUs with and without bf16 units alike); an instruction-set limit in the
environment (`ONEDNN_MAX_CPU_ISA=AVX2` and the like) lowers the class to what the kernels may use. The tests fake
the CPU flags with `cpu_flags.cache_clear()` and a monkeypatched `/proc/cpuinfo` reader.
"""

from __future__ import annotations

import functools
import os
import platform
import re
import warnings
from typing import Any

import torch

from specrl.errors import SpecRLError

DEVICE_RE = re.compile(r"auto|cpu|cuda(:\d+)?")
ROLLOUT_DTYPES = ("auto", "float32", "bfloat16")
PRECISIONS = ("auto", "fp32", "bf16-mixed")
# The measured slowdown and its processor are in docs/benchmarks.md ("bf16 on AVX2-only CPUs").
# Processor classes, least capable first, and the environment variables that limit the instruction set torch's
# kernels (ATen), oneDNN and MKL use.
CLASS_RANK = {"AVX2": 0, "AVX512": 1, "AVX512-BF16": 2, "AMX": 3}
ISA_LIMIT_VARS = ("ONEDNN_MAX_CPU_ISA", "ATEN_CPU_CAPABILITY", "MKL_ENABLE_INSTRUCTIONS")
ONEDNN_ISAS = ("SSE41", "AVX", "AVX2", "AVX2_VNNI", "AVX2_VNNI_2", "AVX512_CORE", "AVX512_CORE_VNNI",
               "AVX512_CORE_BF16", "AVX512_CORE_FP16", "AVX10_1_512", "AVX512_CORE_AMX", "AVX512_CORE_AMX_FP16",
               "AVX10_1_512_AMX", "AVX10_1_512_AMX_FP16", "ALL", "DEFAULT")
AVX2_BF16_SLOWDOWN = "several times slower than float32 for matrix products (docs/benchmarks.md)"


class SlowPrecisionWarning(UserWarning):
    """bf16 was asked for on a device without fast bf16 matrix units."""


def _read_cpuinfo() -> str:
    try:
        with open("/proc/cpuinfo", encoding="utf-8", errors="replace") as f:
            return f.read()
    except OSError:
        return ""


@functools.lru_cache(maxsize=1)
def cpu_flags() -> frozenset[str]:
    """The CPU feature flags of /proc/cpuinfo's first processor (empty where unreadable, e.g. not Linux)."""
    for line in _read_cpuinfo().splitlines():
        if line.startswith("flags") and ":" in line:
            return frozenset(line.split(":", 1)[1].split())
    return frozenset()


def _flags_class() -> str:
    flags = cpu_flags()
    if "amx_bf16" in flags:
        return "AMX"
    if "avx512_bf16" in flags:
        return "AVX512-BF16"
    if "avx512f" in flags:
        return "AVX512"
    if "avx2" in flags:
        return "AVX2"
    cap = torch.backends.cpu.get_cpu_capability()
    return cap if cap not in ("DEFAULT", "") else platform.machine()


def isa_limit() -> dict[str, str]:
    """The instruction-set limits set in the environment for torch's kernels and its matrix libraries
    (`ISA_LIMIT_VARS` that are set, as given), empty when none is."""
    return {k: os.environ[k] for k in ISA_LIMIT_VARS if os.environ.get(k, "").strip()}


def _limit_rank(var: str, value: str) -> int | None:
    v = value.strip().upper()
    if var == "ONEDNN_MAX_CPU_ISA":
        if v not in ONEDNN_ISAS:
            raise SpecRLError(f"ONEDNN_MAX_CPU_ISA={value!r} is not an instruction set oneDNN knows; use one of "
                              f"{', '.join(ONEDNN_ISAS)} (or unset it)")
        if v in ("ALL", "DEFAULT") or "AMX" in v:
            return None
        if "BF16" in v or "FP16" in v or v.startswith("AVX10"):
            return CLASS_RANK["AVX512-BF16"]
        return CLASS_RANK["AVX512"] if v.startswith("AVX512") else CLASS_RANK["AVX2"]
    if var == "ATEN_CPU_CAPABILITY":
        return CLASS_RANK["AVX2"] if v in ("AVX2", "DEFAULT") else None
    if var == "MKL_ENABLE_INSTRUCTIONS":
        return CLASS_RANK["AVX2"] if v.startswith(("SSE", "AVX")) and not v.startswith("AVX512") else None
    return None


def processor_class() -> str:
    """AMX | AVX512-BF16 | AVX512 | AVX2 | the machine name: what bf16 and fp32 matrix products can use.

    The CPU's flags give the class; an instruction-set limit in the environment (`isa_limit()`:
    `ONEDNN_MAX_CPU_ISA=AVX2`, `ATEN_CPU_CAPABILITY=avx2`, `MKL_ENABLE_INSTRUCTIONS=AVX2`) lowers it to what the
    kernels may use, so a newer CPU told to use AVX2 only is run, and named, as the AVX2 class."""
    cls = _flags_class()
    if cls not in CLASS_RANK:
        return cls
    ranks = [r for r in (_limit_rank(k, v) for k, v in isa_limit().items()) if r is not None]
    rank = min([CLASS_RANK[cls], *ranks])
    return next(name for name, r in CLASS_RANK.items() if r == rank)


def class_label(cls: str, limit: dict[str, str] | None, flags_class: str | None) -> str:
    """A processor class for a log line: with an instruction-set limit, the variables and the CPU's own class."""
    if not limit:
        return cls
    given = ", ".join(f"{k}={v}" for k, v in limit.items())
    return f"{cls} ({given}; the CPU's flags say {flags_class})"


def describe_class() -> str:
    """`processor_class()` of this process for a log line (`class_label`)."""
    return class_label(processor_class(), isa_limit(), _flags_class())


def cpu_has_fast_bf16() -> bool:
    """Whether this CPU has bf16 matrix units (AVX512-BF16 or AMX)."""
    return processor_class() in ("AMX", "AVX512-BF16")


def resolve_device(spec: str | torch.device = "auto") -> torch.device:
    """`auto` -> cuda when a CUDA device is visible, else cpu; `cuda[:N]` must exist; `cpu` always does."""
    if isinstance(spec, torch.device):
        spec = str(spec)
    if not isinstance(spec, str) or not DEVICE_RE.fullmatch(spec):
        raise SpecRLError(f"device must be auto, cpu, cuda or cuda:N, got {spec!r}")
    if spec == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dev = torch.device(spec)
    if dev.type == "cuda":
        if not torch.cuda.is_available():
            raise SpecRLError(f"device {spec!r}: no CUDA device is visible to this process (torch "
                              f"{torch.__version__}, CUDA build: {torch.version.cuda or 'no'}); use device=cpu or "
                              "auto")
        n = torch.cuda.device_count()
        if dev.index is not None and dev.index >= n:
            raise SpecRLError(f"device {spec!r}: this process sees {n} CUDA device(s) (cuda:0..cuda:{n - 1})")
    return dev


def fast_bf16(device: torch.device | str) -> bool:
    """Whether bf16 matrix products are fast on `device` (CUDA with bf16 support; a CPU with bf16 units)."""
    dev = torch.device(device)
    if dev.type == "cuda":
        return bool(torch.cuda.is_bf16_supported())
    if dev.type == "cpu":
        return cpu_has_fast_bf16()
    return False


def _where(device: torch.device) -> str:
    return f"this CPU ({processor_class()}, no bf16 matrix units)" if device.type == "cpu" else f"{device}"


def _warn_slow(key: str, value: str, device: torch.device) -> None:
    msg = (f"{key}={value} on {_where(device)}: bf16 runs {AVX2_BF16_SLOWDOWN} here; "
           f"{key}=auto picks float32 on this machine")
    warnings.warn(msg, SlowPrecisionWarning, stacklevel=3)


def resolve_dtype(spec: str, device: torch.device | str, key: str = "dtype") -> str:
    """`auto` -> "bfloat16" where bf16 is fast on `device`, else "float32"; an explicit dtype is returned as
    given (bfloat16 on a device without fast bf16 warns once per call with the measured slowdown class)."""
    dev = torch.device(device)
    if spec == "auto":
        return "bfloat16" if fast_bf16(dev) else "float32"
    if spec in ("bfloat16", "bf16") and dev.type == "cpu" and not fast_bf16(dev):
        _warn_slow(key, spec, dev)
    return spec


def resolve_precision(spec: str, device: torch.device | str, key: str = "policy.precision") -> str:
    """Training precision: `auto` -> "bf16-mixed" where bf16 is fast on `device`, else "fp32"."""
    dev = torch.device(device)
    if spec == "auto":
        return "bf16-mixed" if fast_bf16(dev) else "fp32"
    if spec == "bf16-mixed" and dev.type == "cpu" and not fast_bf16(dev):
        _warn_slow(key, spec, dev)
    return spec


def hardware_record(device: torch.device | str = "cpu") -> dict[str, Any]:
    """What a benchmark or run records about where it ran: processor class, cores, device (and GPU name)."""
    dev = torch.device(device)
    rec: dict[str, Any] = {"processor_class": processor_class(), "cpu_flags_class": _flags_class(),
                           "isa_limit": isa_limit(), "cpu_cores": os.cpu_count(),
                           "torch_cpu_capability": torch.backends.cpu.get_cpu_capability(), "device": str(dev),
                           "torch": torch.__version__}
    if dev.type == "cuda":
        rec["gpu"] = torch.cuda.get_device_name(dev)
    return rec
