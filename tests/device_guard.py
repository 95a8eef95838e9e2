"""A guard that catches host allocations beside device tensors on a CPU-only machine (the CUDA bug class).

On a GPU, `torch.zeros(b)` inside the learner makes a host tensor while the model's tensors live on the device, and
the first op that mixes them raises. Here everything is on the CPU, so `HostAllocationGuard` tells the two apart
itself: a tensor made by a factory function (zeros, arange, full, tensor, ...) with no `device=` argument is
*host-born*, as it would be on a CUDA machine; what a host-born tensor computes stays host-born; `.to(device)` /
`.to(other)` and a factory that names its device give a placed tensor. An op that mixes a host-born tensor of one
or more dimensions with a placed one, or writes placed values into a host-born tensor, raises
`HostAllocationError` naming the op (0-dim host tensors and host index tensors mix with CUDA ones, as CUDA allows).
Inputs a test hands in count as placed (`place`), as they would be after the caller's `.to(device)`.
"""

from __future__ import annotations

import weakref

import torch
from torch.overrides import TorchFunctionMode

FACTORIES = {torch.zeros, torch.ones, torch.empty, torch.full, torch.arange, torch.tensor, torch.as_tensor,
             torch.randint, torch.rand, torch.randn, torch.eye, torch.linspace, torch.randperm, torch.scalar_tensor}
MOVES = {torch.Tensor.to, torch.Tensor.cuda}
INDEXING = {torch.Tensor.__getitem__, torch.Tensor.index_select, torch.index_select}
WRITES = {torch.Tensor.__setitem__, torch.Tensor.copy_, torch.Tensor.index_put_, torch.Tensor.masked_scatter_,
          torch.Tensor.scatter_}


class HostAllocationError(RuntimeError):
    pass


def _tensors(obj, out: list) -> list:
    if isinstance(obj, torch.Tensor):
        out.append(obj)
    elif isinstance(obj, (list, tuple)):
        for o in obj:
            _tensors(o, out)
    elif isinstance(obj, dict):
        for o in obj.values():
            _tensors(o, out)
    return out


class HostAllocationGuard(TorchFunctionMode):
    def __init__(self):
        super().__init__()
        self._host: dict[int, weakref.ref] = {}  # id -> weakref (tensors compare elementwise: no WeakSet)
        self.violations: list[str] = []

    def is_host(self, t: torch.Tensor) -> bool:
        ref = self._host.get(id(t))
        return ref is not None and ref() is t

    def _mark(self, result) -> None:
        for t in _tensors(result, []):
            self._host[id(t)] = weakref.ref(t, lambda _, key=id(t): self._host.pop(key, None))

    def _unmark(self, result) -> None:
        for t in _tensors(result, []):
            if self.is_host(t):
                del self._host[id(t)]

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = getattr(func, "__qualname__", getattr(func, "__name__", str(func)))
        if func in FACTORIES:
            result = func(*args, **kwargs)
            (self._mark if kwargs.get("device") is None else self._unmark)(result)
            return result
        if func in MOVES:
            result = func(*args, **kwargs)
            moved = func is torch.Tensor.cuda or any(isinstance(a, (torch.device, str, torch.Tensor))
                                                     for a in list(args[1:]) + [kwargs.get("device")])
            if moved:
                self._unmark(result)
            elif self.is_host(args[0]):
                self._mark(result)
            return result
        ts = _tensors(list(args) + list(kwargs.values()), [])
        host = [t for t in ts if self.is_host(t)]
        placed = [t for t in ts if not self.is_host(t)]
        if func in WRITES and args and isinstance(args[0], torch.Tensor):
            target = args[0]
            values = _tensors(list(args[2:] if func is torch.Tensor.__setitem__ else args[1:]), [])
            if self.is_host(target) and any(not self.is_host(v) and v.dim() > 0 for v in values):
                self._fail(f"{name}: writes device values into a host-born tensor {tuple(target.shape)}")
            return func(*args, **kwargs)
        if func in INDEXING and args and not self.is_host(args[0]):
            result = func(*args, **kwargs)  # a device tensor indexed with host indices: CUDA allows it
            self._unmark(result)
            return result
        if host and placed and any(t.dim() > 0 for t in host):
            shapes = [tuple(t.shape) for t in host if t.dim() > 0]
            self._fail(f"{name}: mixes host-born tensor(s) {shapes} with device tensor(s) "
                       f"{[tuple(t.shape) for t in placed]}")
        result = func(*args, **kwargs)
        if host and not placed:
            self._mark(result)
        return result

    def _fail(self, msg: str) -> None:
        self.violations.append(msg)
        raise HostAllocationError(msg + " (on a CUDA device this raises; create it with device=...)")
