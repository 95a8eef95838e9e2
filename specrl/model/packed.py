"""Inference weights laid out once for the CPU's decode kernels: oneDNN's prepacked format, or float32 column-major.

`torch.nn.functional.linear` on a bf16 CPU tensor re-lays its weight out for oneDNN on every call; at decode
(1..32 rows) that reorder costs as much as the product itself. A float32 weight stored row by row ([out, in], as
`nn.Linear` keeps it) sends the decode product `x @ W.T` to a transposed-operand GEMM whose speed depends on the
kernels torch runs (`benchmarks/packed_fp32.py`, per processor class in docs/benchmarks.md): with AVX512 kernels it
ran about 2x slower at 4-32 rows than the same product on the weight stored column-major (at 1-3 rows level, so those
products stay plain: `FLOAT32_MIN_ROWS`); with AVX2 kernels column-major was level or slower, and oneDNN's prepacked
float32 product 1.2-2.9x faster on the LM head and the MLP at 1-32 rows. So `FLOAT32_LAYOUT` names the layout per
kernel class, and a class it does not name runs plain.
`pack_for_inference(module)` marks a module tree so that, under `torch.no_grad()`, every linear layer runs on a
weight laid out once (bf16 and AVX2 float32: oneDNN's packed format and matmul; AVX512 float32: a column-major copy
through `F.linear`), and the q/k/v and gate/up projections of each decoder layer run as one product each
(`fused_linear`). Copies are rebuilt lazily whenever a source tensor changes in place (weight sync, optimizer steps:
the tensor's version counter moves) or is replaced (its storage moves), so a module is never run on stale weights.
With gradients enabled, another dtype or another device, the plain `F.linear` path runs, so training is untouched.
The bf16 product was measured bitwise equal to `F.linear` (fused or not; `tests/test_packed.py` checks it per
shape, and `check_bitwise` at pack time refuses a torch whose kernels differ). A float32 product is the same sum in
another order: within float32 rounding of `F.linear`, not always bitwise (`tests/test_packed_fp32.py` bounds it),
and every forward of an engine (plain steps, verify forwards, the certificate's probes) runs the same layout, so
both arms of a compare sample from the same model. Packing is a CPU kernel: on other devices nothing is packed.
Copies live in a weak side table, not on the modules, so `state_dict`, `deepcopy` and pickling see plain modules; a
packed float32 model holds a second copy of its linear weights.
"""

from __future__ import annotations

import logging
import weakref

import torch
import torch.nn.functional as F
from torch import Tensor, nn

log = logging.getLogger(__name__)
_FLAG = "_specrl_packed"
# Fewer rows than this run column-major float32 products on the plain weight: the row-major F.linear kernels at
# 1-3 rows ran level with or faster than the column-major product, from 4 rows on about 3x slower
# (benchmarks/packed_fp32.py).
FLOAT32_MIN_ROWS = 4
# torch's CPU kernel class (`torch.backends.cpu.get_cpu_capability()`) -> the float32 layout that measured fastest there
FLOAT32_LAYOUT = {"AVX512": "column_major", "AVX2": "onednn"}
_CACHE: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # owner module -> {name: (key, weight, bias)}


def float32_layout() -> str | None:
    """The float32 layout for this CPU's kernels (`FLOAT32_LAYOUT`), or None (run plain)."""
    layout = FLOAT32_LAYOUT.get(torch.backends.cpu.get_cpu_capability())
    return None if layout == "onednn" and not torch.backends.mkldnn.is_available() else layout


def supported(dtype: torch.dtype, device: torch.device | str) -> bool:
    """Whether packing applies to weights of this dtype on this device: float32 on a CPU whose kernel class has a
    layout (`FLOAT32_LAYOUT`), and bf16 on a CPU with oneDNN bf16."""
    if torch.device(device).type != "cpu":
        return False
    if dtype == torch.float32:
        return float32_layout() is not None
    return (dtype == torch.bfloat16 and torch.backends.mkldnn.is_available()
            and bool(torch.ops.mkldnn._is_mkldnn_bf16_supported()))


def _key(tensors: list[Tensor | None]) -> tuple:
    return tuple((t.data_ptr(), t._version, tuple(t.shape)) if t is not None else None for t in tensors)


def fused_linear(owner: nn.Module, name: str, layers: list[nn.Linear], x: Tensor) -> Tensor | None:
    """x through `layers` (same input width) as one packed product [..., sum of out widths], or None when the
    packed path does not apply (owner not packed, gradients on, dtype or device differs from what was packed): then
    run the layers. The layout is the one `pack_for_inference` chose for the owner's dtype."""
    packed = getattr(owner, _FLAG, None)  # {dtype: layout}, chosen once by pack_for_inference
    if not packed or torch.is_grad_enabled():
        return None
    w0 = layers[0].weight
    layout = packed.get(w0.dtype)
    if layout is None or x.dtype != w0.dtype or x.device.type != "cpu":
        return None
    if layout == "column_major" and x.numel() < FLOAT32_MIN_ROWS * x.shape[-1]:
        return None  # few rows, where the plain row-major product is the faster kernel
    weights = [m.weight for m in layers]
    biases = [m.bias for m in layers]
    key = (layout, _key(weights + biases))
    table = _CACHE.setdefault(owner, {})
    hit = table.get(name)
    if hit is None or hit[0] != key:
        w = weights[0].detach() if len(weights) == 1 else torch.cat([t.detach() for t in weights])
        b = None
        if any(t is not None for t in biases):
            b = torch.cat([(t.detach() if t is not None else torch.zeros(m.out_features, dtype=w.dtype))
                           for t, m in zip(biases, layers, strict=True)])
        if layout == "column_major":  # the same [out, in] matrix, stored column by column
            hit = (key, w.t().contiguous().t(), b)
        else:
            hit = (key, torch.ops.mkldnn._reorder_linear_weight(w.contiguous(), 1), b)
        table[name] = hit
    shape = x.shape
    if layout == "column_major":
        return F.linear(x, hit[1], hit[2])
    y = torch.ops.mkldnn._linear_pointwise(x.reshape(-1, shape[-1]), hit[1], hit[2], "none", [], "")
    return y.view(*shape[:-1], y.shape[-1])


class PackedLinear(nn.Linear):
    """An `nn.Linear` whose inference forward uses a packed weight (`pack_for_inference` swaps the class)."""

    def forward(self, x: Tensor) -> Tensor:
        y = fused_linear(self, "w", [self], x)
        return F.linear(x, self.weight, self.bias) if y is None else y


def pack_for_inference(module: nn.Module) -> int:
    """Mark `module` and its submodules for packed inference forwards; return how many linear layers now run
    packed (0 when the module's dtype/device is not `supported`, or, in bf16, this torch's packed product is not
    bitwise `F.linear`'s: then nothing changes). Idempotent."""
    params = [p for p in module.parameters()]
    if not params or not supported(params[0].dtype, params[0].device):
        return 0
    dtype = params[0].dtype
    layout = float32_layout() if dtype == torch.float32 else "onednn"  # once: not looked up per product
    n = 0
    for m in module.modules():
        if type(m) is nn.Linear and m.weight.dtype == dtype:
            m.__class__ = PackedLinear
        if isinstance(m, PackedLinear):
            n += 1
        setattr(m, _FLAG, {**(getattr(m, _FLAG, None) or {}), dtype: layout})  # a module shared by two trees
    if dtype == torch.bfloat16 and not check_bitwise(module):
        unpack(module)
        log.warning("packed bf16 linear layers differ from F.linear on torch %s: running unpacked", torch.__version__)
        return 0
    return n


def unpack(module: nn.Module) -> None:
    """Undo `pack_for_inference` (plain `F.linear` everywhere again) and drop the packed copies."""
    for m in module.modules():
        if isinstance(m, PackedLinear):
            m.__class__ = nn.Linear
        if getattr(m, _FLAG, None):
            setattr(m, _FLAG, None)
        _CACHE.pop(m, None)


_CHECKED: set[tuple] = set()


def _groups(module: nn.Module) -> list[list[nn.Linear]]:
    """Every packed product the tree runs: each PackedLinear alone, and each module's PACKED_GROUPS fused."""
    out = [[m] for m in module.modules() if isinstance(m, PackedLinear)]
    for m in module.modules():
        for names in getattr(type(m), "PACKED_GROUPS", {}).values():
            out.append([getattr(m, n) for n in names])
    return out


def check_bitwise(module: nn.Module) -> bool:
    """Whether this torch's packed bf16 product equals `F.linear` bitwise for every product shape the tree runs
    (fused groups included; random weights and inputs at 1 and 9 rows; once per shape and process)."""
    for layers in _groups(module):
        sig = tuple((m.in_features, m.out_features, m.bias is not None) for m in layers)
        if sig in _CHECKED:
            continue
        g = torch.Generator().manual_seed(0)
        probes = []
        for m in layers:
            p = nn.Linear(m.in_features, m.out_features, bias=m.bias is not None, dtype=torch.bfloat16)
            with torch.no_grad():
                p.weight.copy_(torch.randn(p.weight.shape, generator=g))
                if p.bias is not None:
                    p.bias.copy_(torch.randn(p.bias.shape, generator=g))
            probes.append(p)
        owner = nn.Module()
        setattr(owner, _FLAG, {torch.bfloat16: "onednn"})
        with torch.no_grad():
            for rows in (1, 9):
                x = torch.randn(rows, layers[0].in_features, generator=g).to(torch.bfloat16)
                want = torch.cat([F.linear(x, p.weight, p.bias) for p in probes], dim=-1)
                if not torch.equal(fused_linear(owner, "probe", probes, x), want):
                    return False
        _CHECKED.add(sig)
    return True
