"""A drafter directory's `manifest.json`: what it records and the one check every load of such a directory runs.

A manifest (written by `shipped.package`, the build's `package` stage) records the drafter's kind, dtype and draft
vocabulary, the sha256 of each of its files, and the target it was trained for: that model's shape (hidden size,
layers, vocabulary) and, when the target's tokenizer was known, the sha256 of its vocabulary (token id -> string,
`vocab_sha256`), the model's identity as far as a drafter depends on it. `verify_manifest` is the check: every
file's sha256, the manifest against config.json and the weights, and the manifest's target against the actual
target (a loaded model, or an HF checkpoint directory for the vLLM export). `io.load_drafter` and
`export.export_vllm_eagle3` run it on any directory holding a manifest, whatever spec named it, and a directory
inside the package's shipped drafters (`SHIPPED_DIR`) without a manifest is refused, never loaded unchecked.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

from specrl.errors import SpecRLError

SHIPPED_DIR = Path(__file__).parents[1] / "shipped"  # the data folder specrl/drafters/shipped/
MANIFEST = "manifest.json"
MANIFEST_FORMAT = "specrl-shipped-drafter"
FILES = ("config.json", "model.safetensors")
_ST_DTYPES = {"bfloat16": "BF16", "float16": "F16", "float32": "F32"}


def sha256_of(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def vocab_sha256(ckpt_dir) -> str | None:
    """sha256 of a checkpoint directory's vocabulary (token id -> string), or None without tokenizer files."""
    from specrl.model.loader import _vocab

    if ckpt_dir is None:
        return None
    vocab = _vocab(Path(ckpt_dir))
    if not vocab:
        return None
    return hashlib.sha256(json.dumps(sorted(vocab.items())).encode()).hexdigest()


def target_record(target) -> dict:
    """The manifest's record of `target` (a loaded specrl model): its shape and its vocabulary's sha256."""
    a = target.args
    rec = {"target": {"hidden_size": a.hidden_size, "num_layers": a.num_layers, "vocab_size": a.vocab_size}}
    vs = vocab_sha256(getattr(target, "checkpoint_dir", None))
    return {**rec, "target_vocab_sha256": vs} if vs else rec


def in_shipped_dir(d: Path) -> bool:
    try:
        return Path(d).resolve().is_relative_to(SHIPPED_DIR.resolve())
    except OSError:
        return False


def _fail(d: Path, field: str, got, want, fix: str) -> SpecRLError:
    return SpecRLError(f"drafter {d}: {field} is {got!r}, but {want}; {fix}")


def _target_shape(target, target_dir) -> tuple[dict, str | None, str]:
    """(shape fields, vocabulary sha256 or None, a name for errors) of the actual target."""
    if target is not None:
        a = target.args
        where = getattr(target, "checkpoint_dir", None)
        return ({"hidden_size": a.hidden_size, "num_layers": a.num_layers, "vocab_size": a.vocab_size},
                vocab_sha256(where), str(where) if where else "this target")
    from specrl.model.hf_checkpoint import args_from_hf_config

    cfg_path = Path(target_dir) / "config.json"
    try:
        a = args_from_hf_config(json.loads(cfg_path.read_text()), str(cfg_path))
    except (OSError, json.JSONDecodeError) as e:
        raise SpecRLError(f"{cfg_path}: cannot read the target's config ({e})") from None
    return ({"hidden_size": a.hidden_size, "num_layers": a.num_layers, "vocab_size": a.vocab_size},
            vocab_sha256(target_dir), str(target_dir))


def verify_manifest(d: Path, target=None, target_dir=None, required: bool = False) -> dict | None:
    """Verify the drafter directory `d` against its manifest and the actual target (`target`, a loaded model, or
    `target_dir`, an HF checkpoint directory; neither: the files only); return the manifest, or None when `d`
    holds none and none is `required` (a directory inside `SHIPPED_DIR` always requires one). Raises a
    SpecRLError naming the first field that disagrees, what it is and what would be right."""
    from safetensors import safe_open

    d = Path(d)
    fix = (f"reinstall specrl, or rebuild it with `specrl draft build --recipe {d.name}`" if in_shipped_dir(d)
           else f"rebuild it, or delete {d / MANIFEST} to use it as an unverified drafter directory")
    if not (d / MANIFEST).exists():
        if required or in_shipped_dir(d):
            raise SpecRLError(f"shipped drafter {d} has no {MANIFEST}, so its files cannot be verified; "
                              f"reinstall specrl, or rebuild it with `specrl draft build --recipe {d.name}`")
        return None
    try:
        m = json.loads((d / MANIFEST).read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise SpecRLError(f"drafter {d}: {MANIFEST} is not valid JSON ({e}); {fix}") from None
    if not isinstance(m, dict) or m.get("format") != MANIFEST_FORMAT:
        raise _fail(d, "manifest format", m.get("format") if isinstance(m, dict) else m,
                    f"a drafter manifest has format {MANIFEST_FORMAT!r}", fix)
    files = m.get("files")
    if not isinstance(files, dict):
        raise _fail(d, "the manifest's files", files, "a map of file name -> sha256", fix)
    for f in sorted(set(FILES) | set(files)):
        if f not in files:
            raise _fail(d, f"the manifest's sha256 of {f}", None, "every drafter file has one", fix)
        if Path(f).name != f:
            raise _fail(d, "a manifest file name", f, "a file name inside the directory", fix)
        if not (d / f).is_file():
            raise SpecRLError(f"drafter {d}: {f} is missing; {fix}")
        got = sha256_of(d / f)
        if got != files[f]:
            raise _fail(d, f"the sha256 of {f}", got, f"the manifest records {files[f]}", fix)
    cfg = json.loads((d / "config.json").read_text())
    for field, want in (("kind", cfg.get("kind")), ("dtype", cfg.get("dtype")),
                        ("draft_vocab_size", cfg.get("draft_vocab_size"))):
        if m.get(field) != want:
            raise _fail(d, f"manifest {field}", m.get(field), f"its config.json says {want!r}", fix)
    with safe_open(str(d / "model.safetensors"), "pt") as f:
        dtypes = {str(f.get_slice(k).get_dtype()) for k in f.keys() if k != "d2t"}
    want_st = _ST_DTYPES.get(m["dtype"])
    if dtypes != {want_st}:
        raise _fail(d, "the weights' dtype", sorted(dtypes), f"the manifest says {m['dtype']} ({want_st})", fix)
    if target is not None or target_dir is not None:
        _verify_target(d, m, target, target_dir)
    return m


def _verify_target(d: Path, m: dict, target, target_dir) -> None:
    shape, vocab, where = _target_shape(target, target_dir)
    name = m.get("target_model")
    retrain = ("train a drafter for this model with `specrl draft build --recipe FILE` (recipe model: this "
               "model)")
    recorded = m.get("target")
    if not isinstance(recorded, dict) or set(recorded) != set(shape):
        raise _fail(d, "the manifest's target", recorded, f"a record of the fields {sorted(shape)}",
                    "rebuild it with `specrl draft build`")
    for field, value in recorded.items():
        if shape[field] != value:
            raise SpecRLError(f"drafter {d} was trained for a {name} target with {field} {value}, but this "
                              f"target has {field} {shape[field]}; use it with {name}, or {retrain}")
    want_vocab = m.get("target_vocab_sha256")
    if want_vocab is None:
        return
    if vocab is None:
        raise SpecRLError(f"drafter {d} was trained for {name}, whose vocabulary it records; {where} has no "
                          "tokenizer files (tokenizer.json or vocab.json) to compare, so it cannot be confirmed to "
                          "be that model: load the target from its checkpoint directory (`load_model(DIR)`)")
    if vocab != want_vocab:
        raise SpecRLError(f"drafter {d} was trained for {name}, but the target {where} has another vocabulary "
                          f"(sha256 {vocab[:12]}..., the manifest records {want_vocab[:12]}...): its drafts would "
                          f"be other tokens; use it with {name}, or {retrain}")
