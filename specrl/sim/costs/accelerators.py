"""Accelerator catalog and the measured `cpu` profile.

A `Hardware` is a handful of vendor datasheet numbers: peak dense bf16/fp8 FLOP/s, HBM bandwidth and
capacity, per-GPU NVLink and scale-out network bandwidth, the NVLink domain size and a collective latency.
Nothing here is fitted; how much of these peaks an engine achieves lives in `roofline.Efficiency`. GPUs also carry
what decides CUDA-graph coverage in vLLM (`cuda_graphs`, the default largest captured forward, the host cost of
one eager kernel launch: see `roofline.eager_launch_seconds`); a CPU has no CUDA graphs. The `cpu`
entry is not a datasheet: `specrl simulate profile-hardware` measures matmul FLOP/s and memory bandwidth on the
machine it runs on and saves them to a JSON file that `get_hardware("cpu")` reads back.
"""

from __future__ import annotations

import json
import os
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path

from specrl.errors import SpecRLError

GB = 1e9
TB = 1e12


@dataclass(frozen=True)
class Hardware:
    """One accelerator. Bandwidths are per device, one direction, in bytes/s."""

    name: str
    peak_flops: dict[str, float]  # precision -> dense FLOP/s
    hbm_bandwidth: float
    hbm_bytes: float
    nvlink_bandwidth: float
    network_bandwidth: float
    nvlink_domain: int
    collective_latency_s: float = 10e-6
    measured: bool = False
    threads: int = 0  # measured profiles: the torch threads the peaks were measured with (0: unknown)
    bandwidth_1thread: float = 0.0  # measured profiles: GEMV bandwidth of one thread (0: unknown, scale linearly)
    bandwidth_scale: float = 1.0  # with_threads: this device's share of the profile's bandwidth
    flops_scale: float = 1.0  # with_threads: this device's share of the profile's FLOP/s
    # CUDA graphs (vLLM): forwards up to a captured size replay a graph (one launch); larger ones launch every
    # kernel from the host. False (cpu): no graphs, and no separate launch cost — the fitted per-forward host
    # overheads already hold it, so the mechanism is off by construction.
    cuda_graphs: bool = False
    # vLLM's cap on the largest captured forward (tokens) before max_num_seqs scaling: 512, or 1024 on data-center
    # Blackwell (vllm/config/vllm.py `_set_cudagraph_sizes`: default_max_graph_size = 1024 if
    # is_device_capability_family(100) else 512)
    cudagraph_default_max: int = 0
    # host seconds per kernel outside a graph (Python, dispatcher, launch): a Llama-3.1-8B decode step on an H100
    # SXM measured 8.4 ms eager vs 5.1 ms as a CUDA graph (cloudai.pt, "CUDA Graphs + torch.compile: 1.65x LLM
    # decode speedup"); eager is host-bound there, so 8.4 ms / (32 layers x 15 kernels) = 17.5 us per kernel. The
    # driver launch alone is 4-6 us (pegainfer part 3, measured with cudaLaunchKernel): 17.5 us is the upper end
    kernel_launch_s: float = 0.0

    def flops(self, precision: str) -> float:
        if precision not in self.peak_flops:
            raise SpecRLError(
                f"hardware {self.name!r} has no {precision!r} peak; it has {sorted(self.peak_flops)}"
            )
        return self.peak_flops[precision]

    def link_bandwidth(self, group_size: int) -> float:
        """Bandwidth a collective over `group_size` devices sees: NVLink inside the domain, else network."""
        return self.nvlink_bandwidth if group_size <= self.nvlink_domain else self.network_bandwidth


# Dense (non-sparse) peaks from the vendor datasheets; NVLink is per GPU, one direction.
# CUDA graphs: vLLM caps captured forwards at 512 tokens on Hopper, 1024 on data-center Blackwell; 17.5 us/kernel.
_HOPPER = dict(cuda_graphs=True, cudagraph_default_max=512, kernel_launch_s=17.5e-6)
_BLACKWELL = dict(cuda_graphs=True, cudagraph_default_max=1024, kernel_launch_s=17.5e-6)
CATALOG: dict[str, Hardware] = {
    "h100": Hardware("h100", {"bf16": 989e12, "fp8": 1979e12}, 3.35 * TB, 80 * GB, 450 * GB, 50 * GB, 8, **_HOPPER),
    "h200": Hardware("h200", {"bf16": 989e12, "fp8": 1979e12}, 4.8 * TB, 141 * GB, 450 * GB, 50 * GB, 8, **_HOPPER),
    "b200": Hardware("b200", {"bf16": 2250e12, "fp8": 4500e12}, 8.0 * TB, 180 * GB, 900 * GB, 50 * GB, 8,
                     **_BLACKWELL),
    "gb200": Hardware("gb200", {"bf16": 2500e12, "fp8": 5000e12}, 8.0 * TB, 186 * GB, 900 * GB, 50 * GB, 72,
                      **_BLACKWELL),
}


def default_cpu_profile_path() -> Path:
    root = os.environ.get("SPECRL_CACHE", str(Path.home() / ".cache" / "specrl"))
    return Path(root) / "hardware" / "cpu.json"


def hardware_names() -> list[str]:
    return sorted(CATALOG) + ["cpu"]


def get_hardware(name: str, cpu_profile: str | Path | None = None) -> Hardware:
    """Catalog lookup; `cpu` (or a path to a profile JSON) loads a measured profile."""
    if name in CATALOG:
        return CATALOG[name]
    if name == "cpu" or name.endswith(".json"):
        path = Path(cpu_profile or (name if name.endswith(".json") else default_cpu_profile_path()))
        if not path.exists():
            raise SpecRLError(
                f"no cpu hardware profile at {path}; run `specrl simulate profile-hardware` first "
                f"(or pass --hardware one of {sorted(CATALOG)})"
            )
        return load_profile(path)
    raise SpecRLError(f"unknown hardware {name!r}; valid: {', '.join(hardware_names())} (or a profile .json)")


def load_profile(path: str | Path) -> Hardware:
    try:
        data = json.loads(Path(path).read_text())
        return Hardware(
            name=str(data["name"]),
            peak_flops={k: float(v) for k, v in data["peak_flops"].items()},
            hbm_bandwidth=float(data["hbm_bandwidth"]),
            hbm_bytes=float(data["hbm_bytes"]),
            nvlink_bandwidth=float(data["nvlink_bandwidth"]),
            network_bandwidth=float(data["network_bandwidth"]),
            nvlink_domain=int(data["nvlink_domain"]),
            collective_latency_s=float(data.get("collective_latency_s", 10e-6)),
            measured=True,
            threads=int(data.get("threads", 0)),
            bandwidth_1thread=float(data.get("hbm_bandwidth_1thread", 0.0)),
        )
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as exc:
        raise SpecRLError(
            f"hardware profile {path} is malformed ({exc!r}); regenerate it with "
            "`specrl simulate profile-hardware --out PATH`"
        ) from exc


def with_threads(hw: Hardware, threads: int) -> Hardware:
    """A measured CPU profile re-expressed for a device of `threads` cores (an async run's rollout worker or
    learner owns only its share of the machine): peak FLOP/s scales with the cores; memory bandwidth with the
    cores too, unless the profile measured one thread's bandwidth (`hbm_bandwidth_1thread`) — one core streams
    more than its 1/n share of the memory bandwidth — then min(all threads, one thread x cores). The per-forward
    host overheads (in `Efficiency`) do not scale."""
    if threads < 1:
        raise SpecRLError(f"a cpu device needs >= 1 thread, got {threads}")
    if not hw.measured or hw.threads < 1:
        raise SpecRLError(f"hardware {hw.name!r} has no measured thread count, so it cannot be split into "
                          f"{threads}-thread devices; re-measure it with `specrl simulate profile-hardware`")
    f = threads / hw.threads
    bw = min(hw.hbm_bandwidth, hw.bandwidth_1thread * threads) if hw.bandwidth_1thread > 0 else hw.hbm_bandwidth * f
    g = bw / hw.hbm_bandwidth
    return replace(hw, peak_flops={k: v * f for k, v in hw.peak_flops.items()}, hbm_bandwidth=bw,
                   nvlink_bandwidth=hw.nvlink_bandwidth * g, threads=threads, bandwidth_scale=hw.bandwidth_scale * g,
                   flops_scale=hw.flops_scale * f)


def _best_time(fn, repeats: int) -> float:
    fn()  # warm up
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return best


def profile_cpu(matmul_size: int = 1024, bandwidth_mb: int = 256, repeats: int = 5) -> dict:
    """Measure this machine: GEMM FLOP/s (bf16, fp32) and streaming memory bandwidth.

    Bandwidth is measured two ways and the GEMV one is kept as `hbm_bandwidth`, because a decode forward is
    a matrix-vector product over the weights: y = x @ W.T with one row of x and W of `bandwidth_mb` in bf16, run
    as the engine runs it (prepacked oneDNN weights, `specrl.model.packed`, where this CPU supports them).
    """
    import torch

    from specrl.model.packed import pack_for_inference

    n = matmul_size
    peaks: dict[str, float] = {}
    for prec, dtype in (("bf16", torch.bfloat16), ("fp32", torch.float32)):
        a = torch.randn(n, n, dtype=dtype)
        b = torch.randn(n, n, dtype=dtype)
        t = _best_time(lambda a=a, b=b: a @ b, repeats)
        peaks[prec] = 2.0 * n**3 / t
    peaks["fp8"] = peaks["bf16"]  # no fp8 GEMM on CPU: fp8 runs at bf16 speed
    cols = 4096
    rows = max(1, int(bandwidth_mb * 1e6 / 2 / cols))
    # the GEMV the native engine runs at decode: its linear layers on prepacked oneDNN weights where supported
    lin = torch.nn.Linear(cols, rows, bias=False, dtype=torch.bfloat16)
    pack_for_inference(lin)
    x = torch.randn(1, cols, dtype=torch.bfloat16)
    w = lin.weight
    gemv = torch.no_grad()(lambda: lin(x))
    t_gemv = _best_time(gemv, repeats)
    src = torch.empty(int(bandwidth_mb * 1e6 / 4), dtype=torch.float32).fill_(1.0)
    dst = torch.empty_like(src)
    t_copy = _best_time(lambda: dst.copy_(src), repeats)
    try:
        mem = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        mem = 16e9
    gemv_bw = w.numel() * 2 / t_gemv
    threads = torch.get_num_threads()
    gemv_bw_1t = gemv_bw
    if threads > 1:  # one core's share: async workers and learners each own a few cores
        torch.set_num_threads(1)
        try:
            gemv_bw_1t = w.numel() * 2 / _best_time(gemv, repeats)
        finally:
            torch.set_num_threads(threads)
    return {
        "name": "cpu",
        "peak_flops": peaks,
        "hbm_bandwidth": gemv_bw,
        "copy_bandwidth": 2 * src.numel() * 4 / t_copy,
        "hbm_bytes": float(mem),
        "nvlink_bandwidth": gemv_bw,
        "network_bandwidth": 1e9,
        "nvlink_domain": 1,
        "collective_latency_s": 0.0,
        "hbm_bandwidth_1thread": gemv_bw_1t,
        "threads": threads,
        "matmul_size": n,
        "bandwidth_mb": bandwidth_mb,
    }


def save_profile(profile: dict, path: str | Path) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(profile, indent=2) + "\n")
    return path


def describe(hw: Hardware) -> dict:
    return asdict(hw)
