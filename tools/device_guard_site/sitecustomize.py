"""Installs the placement guard (`tests.device_guard.HostAllocationGuard`) in every Python process that a command
run by `tools/device_guard_run.py` starts: the runner puts this directory and the repository on PYTHONPATH and
sets SPECRL_DEVICE_GUARD to its log directory, and every child (multiprocessing / torch.distributed ranks, Ray's
workers) inherits both. Nothing happens until the process imports torch: then the guard is entered on the main
thread (and on every thread started afterwards), in record mode unless SPECRL_DEVICE_GUARD_MODE=raise, and each
violation is appended to LOG/violations.jsonl as it happens (a killed worker loses nothing). On a CPU machine the
policy's device is the guard's cpu:0 marker: `specrl.device.resolve_device` answers it for cpu (and auto), so the
models specrl loads for a device, and what follows their `.device`, are placed; anything else on the CPU is the
host, as on a CUDA machine. Each guarded process appends its pid and argv to LOG/processes.jsonl. No guard code
is in the specrl package.
"""

import os
import sys

if os.environ.get("SPECRL_DEVICE_GUARD"):
    import importlib.abc
    import importlib.util
    import json

    LOG = os.environ["SPECRL_DEVICE_GUARD"]
    _state = {}

    def _append(name: str, record: dict) -> None:
        with open(os.path.join(LOG, name), "a") as f:
            f.write(json.dumps(record) + "\n")

    def _install_guard(_torch_module) -> None:
        import threading

        import torch

        from tests.device_guard import HostAllocationGuard

        class LoggingGuard(HostAllocationGuard):
            def _fail(self, msg: str) -> None:
                try:
                    super()._fail(msg)
                finally:
                    import traceback

                    stack = [f"{f.filename.rsplit('/', 2)[-1]}:{f.lineno}" for f in traceback.extract_stack()[-12:-2]]
                    _append("violations.jsonl", {"pid": os.getpid(), "argv": sys.argv[:3], "msg": msg,
                                                 "site": self.sites[-1] if self.sites else "?", "stack": stack})

        cuda = os.environ.get("SPECRL_DEVICE_GUARD_DEVICE", "")
        guard = LoggingGuard(device=cuda or None, record=os.environ.get("SPECRL_DEVICE_GUARD_MODE") != "raise")
        guard.__enter__()
        _state["guard"] = guard
        run = threading.Thread.run

        def guarded_run(self):
            torch._C._push_on_torch_function_stack(guard)
            try:
                run(self)
            finally:
                torch._C._pop_torch_function_stack()

        threading.Thread.run = guarded_run
        _append("processes.jsonl", {"pid": os.getpid(), "argv": sys.argv[:3]})

    def _patch_resolve_device(module) -> None:
        real = module.resolve_device

        def resolve_device(spec="auto"):
            guard = _state.get("guard")
            if guard is not None and not guard.real and str(spec) in ("cpu:0",):
                spec = "cpu"
            dev = real(spec)
            # a named device (cpu, auto) is the policy's; a torch.device object is already where it says (a host
            # tensor's .device stays the host)
            if guard is not None and not guard.real and dev.type == "cpu" and isinstance(spec, str):
                return guard.device  # the policy's device on this CPU
            return dev

        resolve_device.__doc__ = real.__doc__
        module.resolve_device = resolve_device

    def _patch_resolve_hardware(module) -> None:
        real = module.resolve_hardware

        def resolve_hardware(cfg):  # the config keeps saying cpu (it validates device names); code resolves it
            out = real(cfg)
            if out.run.device == "cpu:0":
                out = out.model_copy(update={"run": out.run.model_copy(update={"device": "cpu"})})
            return out

        module.resolve_hardware = resolve_hardware

    def _patch_load_model(module) -> None:
        real = module.load_model

        def load_model(name_or_path, dtype="auto", device=None):  # on CUDA it moves the model: here, places it
            if device is None:  # the default: the host (a CPU pipeline such as `specrl draft build`)
                return real(name_or_path, dtype)
            model, tokenizer = real(name_or_path, dtype, device)
            guard = _state.get("guard")
            if guard is not None and not guard.real and module.resolve_device(device) == guard.device:
                guard.place(model)
            return model, tokenizer

        load_model.__doc__ = real.__doc__
        module.load_model = load_model

    def _patch_engine(module) -> None:
        real = module.RolloutEngine._on_device

        def _on_device(self):  # off CPU the engine runs in a default-device context: so it does on the marker
            guard = _state.get("guard")
            if guard is not None and not guard.real and self.device == guard.device:
                import torch

                return torch.device(self.device)
            return real(self)

        module.RolloutEngine._on_device = _on_device

    HOOKS = {"torch": _install_guard, "specrl.rollout.engine": _patch_engine,
             "specrl.model.loader": _patch_load_model, "specrl.device": _patch_resolve_device,
             "specrl.config.hardware": _patch_resolve_hardware}

    class _AfterImport(importlib.abc.MetaPathFinder):
        """Runs HOOKS[name](module) right after `name` is first imported, before anyone else sees it."""

        def find_spec(self, name, path, target=None):
            if name not in HOOKS:
                return None
            sys.meta_path.remove(self)
            try:
                spec = importlib.util.find_spec(name)
            finally:
                sys.meta_path.insert(0, self)
            if spec is None or spec.loader is None:
                return spec
            real_exec = spec.loader.exec_module

            def exec_module(module):
                real_exec(module)
                HOOKS[name](module)

            spec.loader.exec_module = exec_module
            return spec

    sys.meta_path.insert(0, _AfterImport())
