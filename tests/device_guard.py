"""A guard that catches host allocations beside device tensors on a CPU-only machine (the CUDA bug class).

On a GPU, `torch.zeros(b)` inside the learner makes a host tensor while the model's tensors live on the device, and
the first op that mixes them raises. Here everything is on the CPU, so `HostAllocationGuard` tells the two apart
itself. The policy's device is a marker, `cpu:0` (`guard.device`): a placed tensor reports it as its `.device`, a
host-born one reports plain `cpu`, so `torch.zeros(n, device=x.device)` follows `x`. A tensor is *host-born* when
a CUDA machine would put it on the host: made by a factory with no `device=` or with the host named explicitly
(`device="cpu"`, `torch.device("cpu")`, a CPU generator's `.device`), by `torch.from_numpy` / `torch.frombuffer`,
by `.cpu()` / `.to("cpu")`, as a module's parameter from host data (`nn.Linear(a, b)`), or before the guard
started and not declared placed (`place=`: modules, tensors, optimizers, or objects holding them). What a
host-born tensor computes stays host-born; `.to(guard.device)`, `.to(other)`, `.cuda()` and factories naming the
policy's device (or any non-CPU device) give placed tensors. An op that mixes a host-born tensor of one or more
dimensions with a placed one, writes placed values into a host-born tensor or indexes one with placed indices, or
draws from a CPU generator onto the policy's device raises `HostAllocationError` naming the op and the first
specrl frame (0-dim host tensors and host index tensors mix with CUDA ones, as CUDA allows). With `record=True` it
records each violation and lets the op run (one run lists every site). torch.distributed's own ops are not
checked on the CPU (a gloo mesh's device is named cpu there). On a real CUDA run (`device=cuda`), CPU tensors are
host whatever made them.
"""

from __future__ import annotations

import gc
import sys
import traceback
import warnings
import weakref

import torch
from torch.overrides import TorchFunctionMode

FACTORIES = {torch.zeros, torch.ones, torch.empty, torch.full, torch.arange, torch.tensor, torch.as_tensor,
             torch.randint, torch.rand, torch.randn, torch.eye, torch.linspace, torch.logspace, torch.randperm,
             torch.scalar_tensor, torch.empty_strided, torch.tril_indices, torch.triu_indices}
MOVES = {torch.Tensor.to, torch.Tensor.cuda, torch.Tensor.cpu}
INDEXING = {torch.Tensor.__getitem__, torch.Tensor.index_select, torch.index_select}
WRITES = {torch.Tensor.__setitem__, torch.Tensor.copy_, torch.Tensor.index_put_, torch.Tensor.masked_scatter_,
          torch.Tensor.scatter_, torch.Tensor.index_copy_}
DEVICE_GETTER = torch._C.TensorBase.device
DATA = torch._C.TensorBase.data
METADATA = {torch._has_compatible_shallow_copy_type}  # asks about tensors, computes nothing
HOST = torch.device("cpu")


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


def held_tensors(obj, depth: int = 4, seen: set | None = None) -> list[torch.Tensor]:
    """The tensors `obj` holds: a module's parameters and buffers, an optimizer's state, a tensor, or (to `depth`)
    those of the attributes, list items and dict values of any other object."""
    seen = set() if seen is None else seen
    if id(obj) in seen or depth < 0:
        return []
    seen.add(id(obj))
    if isinstance(obj, torch.Tensor):
        return [obj]
    if isinstance(obj, torch.nn.Module):
        return list(obj.parameters()) + list(obj.buffers()) + [
            t for v in vars(obj).values() if not isinstance(v, dict) for t in held_tensors(v, depth - 1, seen)]
    if isinstance(obj, torch.optim.Optimizer):
        return [t for s in obj.state.values() for t in _tensors(s, [])] + held_tensors(obj.param_groups, 1, seen)
    if isinstance(obj, (list, tuple, set)):
        return [t for o in obj for t in held_tensors(o, depth - 1, seen)]
    if isinstance(obj, dict):
        return [t for o in obj.values() for t in held_tensors(o, depth - 1, seen)]
    if hasattr(obj, "__dict__") and not isinstance(obj, type) and type(obj).__module__ != "builtins":
        return [t for o in vars(obj).values() for t in held_tensors(o, depth - 1, seen)]
    return []


def _where() -> str:
    """The innermost frame in specrl (else the innermost outside torch and this file), as file:line."""
    frames = [f for f in traceback.extract_stack()[:-3] if "device_guard" not in f.filename]
    ours = [f for f in frames if "/specrl/" in f.filename]
    pick = ours[-1] if ours else next((f for f in reversed(frames) if "/torch/" not in f.filename), None)
    return f"{pick.filename}:{pick.lineno}" if pick else "?"


def _torch_internal() -> bool:
    """Whether the op being handled was called by torch.distributed (the first frame outside torch's core and this
    file is in it): on a gloo mesh it names cpu for its device and moves its own buffers there, which on this CPU is
    the policy's device; its own code is trusted, specrl's tensors handed to it are checked where specrl made them."""
    f = sys._getframe(2)
    while f is not None:
        name = f.f_code.co_filename
        if "/torch/distributed/" in name:
            return True
        if name != __file__ and "/torch/" not in name:
            return False
        f = f.f_back
    return False


class HostAllocationGuard(TorchFunctionMode):
    def __init__(self, place=(), device: torch.device | str | None = None, record: bool = False):
        super().__init__()
        self.device = torch.device(device) if device is not None else torch.device("cpu", 0)
        self.real = self.device.type != "cpu"  # a real accelerator: CPU tensors are host by their device
        self._host: dict[int, weakref.ref] = {}  # id -> weakref (tensors compare elementwise: no WeakSet)
        self._place = place
        self.record = record
        self.violations: list[str] = []
        self.sites: list[str] = []
        self._patched: dict = {}

    # -- what is host-born -------------------------------------------------------------------------------------
    def is_host(self, t: torch.Tensor) -> bool:
        if self.real and t.device.type == "cpu":
            return True
        ref = self._host.get(id(t))
        return ref is not None and ref() is t

    def _mark(self, result) -> None:
        for t in _tensors(result, []):
            self._host[id(t)] = weakref.ref(t, lambda _, key=id(t): self._host.pop(key, None))

    def _unmark(self, result) -> None:
        for t in _tensors(result, []):
            if self.is_host(t):
                self._host.pop(id(t), None)

    def on_host(self, device) -> bool:
        """Whether a factory or move naming `device` puts its tensor on the host (None: the default, the host)."""
        if device is None:
            return True
        if isinstance(device, torch.Tensor):
            return self.is_host(device)
        dev = torch.device(device) if not isinstance(device, int) else torch.device("cuda", device)
        return dev.type == "cpu" and (self.real or dev != self.device)

    def place(self, *objs) -> None:
        """Declare what `objs` hold (modules, tensors, optimizers, objects holding them) to be on the device."""
        for o in objs:
            self._unmark(held_tensors(o))

    def __enter__(self):
        if not self.real:  # tensors made before the guard are host-born, unless declared placed
            with warnings.catch_warnings():  # isinstance touches deprecated torch attributes
                warnings.simplefilter("ignore")
                self._mark([o for o in gc.get_objects() if isinstance(o, torch.Tensor)])
            self.place(*self._place)
        new_param = torch.nn.Parameter.__new__
        self._patched["Parameter.__new__"] = new_param

        def parameter(cls, data=None, requires_grad=True):  # a module's weights are where their data is
            p = new_param(cls, data, requires_grad)
            if data is None or self.is_host(data):
                self._mark(p)
            return p
        torch.nn.Parameter.__new__ = parameter
        for name in ("from_numpy", "frombuffer"):
            real = getattr(torch, name)
            self._patched[name] = real

            def born_on_host(*a, _real=real, **k):
                t = _real(*a, **k)
                self._mark(t)
                return t
            setattr(torch, name, born_on_host)
        return super().__enter__()

    def __exit__(self, *exc):
        for name, real in self._patched.items():
            if name == "Parameter.__new__":
                torch.nn.Parameter.__new__ = real
            else:
                setattr(torch, name, real)
        self._patched.clear()
        return super().__exit__(*exc)

    # -- the checks ------------------------------------------------------------------------------------------
    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = getattr(func, "__qualname__", getattr(func, "__name__", str(func)))
        if not self.real and _torch_internal():
            return func(*args, **kwargs)
        if getattr(func, "__self__", None) is DEVICE_GETTER:
            dev = func(*args, **kwargs)
            if self.real or dev.type != "cpu":
                return dev
            return HOST if self.is_host(args[0]) else self.device
        if func in FACTORIES or (kwargs.get("device") is not None and func not in MOVES):
            gen = kwargs.get("generator")
            dev = kwargs.get("device")
            if gen is not None and dev is not None and not self.on_host(dev) and gen.device.type == "cpu":
                self._fail(f"{name}: draws from a CPU generator onto the device {dev} (a CPU generator cannot draw "
                           "on CUDA; draw on the generator's device and .to(device))")
            result = func(*args, **kwargs)
            (self._mark if self.on_host(dev) else self._unmark)(result)
            return result
        if getattr(func, "__self__", None) is DATA and func.__name__ == "__set__":  # p.data = x: p is where x is
            result = func(*args, **kwargs)
            (self._mark if self.is_host(args[1]) else self._unmark)(args[0])
            return result
        if func in METADATA:
            return func(*args, **kwargs)
        if func in MOVES:
            result = func(*args, **kwargs)
            if func is torch.Tensor.cuda:
                self._unmark(result)
                return result
            if func is torch.Tensor.cpu:
                self._mark(result)
                return result
            target = [a for a in list(args[1:]) + [kwargs.get("device")]
                      if isinstance(a, (torch.device, str, torch.Tensor))]
            if target:
                (self._mark if self.on_host(target[0]) else self._unmark)(result)
            elif self.is_host(args[0]):
                self._mark(result)
            return result
        ts = _tensors(list(args) + list(kwargs.values()), [])
        host = [t for t in ts if self.is_host(t)]
        placed = [t for t in ts if not self.is_host(t)]
        if func in WRITES and args and isinstance(args[0], torch.Tensor):
            target = args[0]
            values = _tensors(list(args[2:] if func is torch.Tensor.__setitem__ else args[1:]), [])
            index = _tensors(list(args[1:2]), []) if func in (torch.Tensor.__setitem__, torch.Tensor.index_put_) \
                else []
            if self.is_host(target) and any(not self.is_host(v) and v.dim() > 0 for v in values):
                self._fail(f"{name}: writes device values into a host-born tensor {tuple(target.shape)}")
            elif self.is_host(target) and any(not self.is_host(i) and i.dim() > 0 for i in index):
                self._fail(f"{name}: indexes a host-born tensor {tuple(target.shape)} with device indices")
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
        where = _where()
        msg = f"{msg} at {where}"
        self.violations.append(msg)
        if where not in self.sites:
            self.sites.append(where)
        if not self.record:
            raise HostAllocationError(msg + " (on a CUDA device this raises; create it with device=...)")
