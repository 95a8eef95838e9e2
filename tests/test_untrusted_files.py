"""Nothing a user's file holds runs code: the audit of every loader (docs/extending.md, "Files specrl reads"), kept
true by a scan of the source, and the loaders whose format could name code refusing a planted file.

The scan parses every module under `specrl/`, `tools/` and `benchmarks/` and lists each call that could run code
from a file: `torch.load` without `weights_only=True`, `pickle` / `marshal` / `dill` loads (outside the checkpoint
reader's allow-listing unpickler), `yaml.load` or an unsafe YAML loader, `np.load(allow_pickle=True)`, a
`from_pretrained` without `trust_remote_code=False`, `trust_remote_code=True` anywhere, and the `eval` / `exec`
built-ins. It is self-tested on a synthetic module so it cannot pass vacuously.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from specrl.errors import SpecRLError

ROOT = Path(__file__).resolve().parents[1]
SCANNED = ("specrl", "tools", "benchmarks")
# (file, what): the only places allowed to do what the scan otherwise refuses, each with its reason
ALLOWED = {
    # an Unpickler subclass whose find_class admits only named DCP metadata classes (tests/test_rl_checkpoint.py)
    ("specrl/checkpoint/sharded_state.py", "pickle.Unpickler"),
}
_UNSAFE_YAML = {"Loader", "UnsafeLoader", "FullLoader", "unsafe_load", "full_load", "load", "load_all",
                "unsafe_load_all", "full_load_all"}


def _kw(call: ast.Call, name: str):
    for k in call.keywords:
        if k.arg == name:
            return k.value
    return None


def _is_const(node, value) -> bool:
    return isinstance(node, ast.Constant) and node.value is value


def unsafe_loads(source: str) -> list[tuple[int, str]]:
    """(line, what) of every construct in `source` that could run code from a file."""
    out = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name):
            mod, attr = node.value.id, node.attr
            if mod in ("pickle", "cPickle", "dill", "marshal", "cloudpickle") and attr in (
                    "load", "loads", "Unpickler"):
                out.append((node.lineno, f"{mod}.{attr}"))
            if mod == "yaml" and attr in _UNSAFE_YAML:
                out.append((node.lineno, f"yaml.{attr}"))
        if not isinstance(node, ast.Call):
            continue
        f = node.func
        if isinstance(f, ast.Name) and f.id in ("eval", "exec"):
            out.append((node.lineno, f"{f.id}()"))
        name = f.attr if isinstance(f, ast.Attribute) else f.id if isinstance(f, ast.Name) else ""
        owner = f.value.id if isinstance(f, ast.Attribute) and isinstance(f.value, ast.Name) else ""
        if owner == "torch" and name == "load" and not _is_const(_kw(node, "weights_only"), True):
            out.append((node.lineno, "torch.load without weights_only=True"))
        if owner in ("np", "numpy") and name == "load" and not _is_const(_kw(node, "allow_pickle"), False) \
                and _kw(node, "allow_pickle") is not None:
            out.append((node.lineno, "np.load(allow_pickle=...)"))
        if name == "from_pretrained" and not _is_const(_kw(node, "trust_remote_code"), False):
            out.append((node.lineno, "from_pretrained without trust_remote_code=False"))
        if _kw(node, "trust_remote_code") is not None and not _is_const(_kw(node, "trust_remote_code"), False):
            out.append((node.lineno, "trust_remote_code not False"))
    return sorted(set(out))


def test_the_scan_finds_each_kind_of_unsafe_load():
    src = ("import torch, pickle, yaml, numpy as np\n"
           "torch.load('a')\n"
           "torch.load('a', weights_only=False)\n"
           "pickle.loads(b'')\n"
           "yaml.load('a', Loader=yaml.Loader)\n"
           "np.load('a', allow_pickle=True)\n"
           "AutoTokenizer.from_pretrained('d')\n"
           "AutoModel.from_pretrained('d', trust_remote_code=True)\n"
           "eval('1')\n"
           "torch.load('a', weights_only=True)\n"
           "yaml.safe_load('a')\n"
           "np.load('a')\n"
           "model.eval()\n"
           "AutoTokenizer.from_pretrained('d', trust_remote_code=False)\n")
    assert [ln for ln, _ in unsafe_loads(src)] == [2, 3, 4, 5, 5, 6, 7, 8, 8, 9]


def test_no_module_loads_a_file_in_a_way_that_could_run_code():
    found = []
    for top in SCANNED:
        for p in sorted((ROOT / top).rglob("*.py")):
            rel = p.relative_to(ROOT).as_posix()
            found += [(rel, ln, what) for ln, what in unsafe_loads(p.read_text(encoding="utf-8"))
                      if (rel, what) not in ALLOWED]
    assert found == []
    assert ALLOWED <= {(rel, what) for top in SCANNED for p in (ROOT / top).rglob("*.py")
                       for rel in [p.relative_to(ROOT).as_posix()]
                       for _, what in unsafe_loads(p.read_text(encoding="utf-8"))}  # no stale allowance


def test_a_tokenizer_that_names_its_own_code_is_refused_without_running_it(tmp_path):
    from specrl.model.hf_checkpoint import load_tokenizer

    marker = tmp_path / "ran"
    (tmp_path / "tokenization_planted.py").write_text(
        f"import pathlib\npathlib.Path({str(marker)!r}).write_text('x')\n"
        "from transformers import PreTrainedTokenizerFast\n"
        "class PlantedTokenizer(PreTrainedTokenizerFast):\n    pass\n")
    (tmp_path / "tokenizer_config.json").write_text(
        '{"auto_map": {"AutoTokenizer": ["tokenization_planted.PlantedTokenizer", '
        '"tokenization_planted.PlantedTokenizer"]}, "tokenizer_class": "PlantedTokenizer"}')
    (tmp_path / "config.json").write_text('{"model_type": "llama"}')
    with pytest.raises(SpecRLError, match=r"tokenizer names Python code"):
        load_tokenizer(tmp_path)
    assert not marker.exists()
