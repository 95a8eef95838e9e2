"""Nothing checked is skippable: every directory holding a manifest is verified against it and the actual target.

Each test copies a shipped drafter (or the whole shipped folder, standing in for the package's) into tmp, tampers
with one thing, and expects a refusal naming it: a shipped name whose manifest is missing or whose kind was edited
(before: a new head was trained silently), `eagle:<the shipped directory>` (before: loaded unverified), a target of
the right shape but another vocabulary (before: a constant was compared), and the vLLM export of a shipped head.
"""

import json
import shutil

import pytest

from specrl.drafters.storage import manifest as manifest_mod
from specrl.drafters.storage import shipped
from specrl.errors import SpecRLError

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def target():
    from specrl import load_model

    model, _ = load_model("smollm2-135m", dtype="float32")
    return model


@pytest.fixture
def package(tmp_path, monkeypatch):
    """A copy of the package's shipped drafters that the loaders take for the package's own; no build may run."""
    from specrl.drafters.storage import default as default_drafter

    root = tmp_path / "shipped"
    shutil.copytree(shipped.SHIPPED_DIR, root)
    monkeypatch.setattr(manifest_mod, "SHIPPED_DIR", root)
    monkeypatch.setattr(shipped, "SHIPPED_DIR", root)

    def no_build(*a, **k):
        raise AssertionError("a shipped name must never be built")

    monkeypatch.setattr(default_drafter.drafter_build, "train_drafter_offline", no_build)
    return root


def edit_manifest(d, **fields):
    m = json.loads((d / "manifest.json").read_text())
    m.update(fields)
    (d / "manifest.json").write_text(json.dumps(m))


def test_the_shipped_table_names_exactly_the_shipped_directories():
    found = {d.name: json.loads((d / "manifest.json").read_text())["kind"]
             for d in shipped.SHIPPED_DIR.iterdir() if d.is_dir()}
    assert found == shipped.SHIPPED


def test_a_shipped_name_whose_manifest_is_missing_is_an_error_not_a_build(package, target):
    from specrl.drafters.storage.default import ensure_default_drafter, resolve_drafter

    (package / "think" / "manifest.json").unlink()
    with pytest.raises(SpecRLError, match=r"think.*no manifest\.json"):
        resolve_drafter("eagle:think", target)
    with pytest.raises(SpecRLError, match="has no manifest.json"):
        ensure_default_drafter("eagle", "think", progress=False)
    with pytest.raises(SpecRLError, match="has no manifest.json"):  # the directory itself, named by path
        resolve_drafter(f"eagle:{package / 'think'}", target)


def test_a_shipped_name_whose_kind_was_edited_is_an_error_not_a_build(package, target):
    from specrl.drafters.storage.default import ensure_default_drafter, resolve_drafter

    edit_manifest(package / "default", kind="mtp")
    with pytest.raises(SpecRLError, match=r"kind is 'mtp'.*'eagle'"):
        resolve_drafter("eagle:default", target)
    with pytest.raises(SpecRLError, match="manifest kind is 'mtp'"):
        ensure_default_drafter("eagle", "default", progress=False)


def test_a_shipped_name_asked_for_as_another_kind_is_refused_naming_its_kind(target):
    from specrl.drafters.storage.default import resolve_drafter

    with pytest.raises(SpecRLError, match=r"use parallel:think-parallel-markov$"):
        resolve_drafter("eagle:think-parallel-markov", target)
    with pytest.raises(SpecRLError, match=r"use eagle:think$"):
        resolve_drafter("parallel:think", target)
    assert resolve_drafter("parallel:think-parallel-markov", target).kind == "parallel"


def test_a_shipped_directory_named_by_path_is_verified(tmp_path, target):
    from specrl.drafters.storage.default import resolve_drafter

    d = tmp_path / "think"
    shutil.copytree(shipped.SHIPPED_DIR / "think", d)
    assert resolve_drafter(f"eagle:{d}", target).kind == "eagle"  # intact: it loads
    raw = bytearray((d / "model.safetensors").read_bytes())
    raw[-1] ^= 1
    (d / "model.safetensors").write_bytes(bytes(raw))
    with pytest.raises(SpecRLError, match=r"sha256.*safetensors.*'[0-9a-f]{64}'"):
        resolve_drafter(f"eagle:{d}", target)
    with pytest.raises(SpecRLError, match="sha256 of model.safetensors"):
        resolve_drafter(f"hybrid:eagle:{d}", target)
    shutil.copy(shipped.SHIPPED_DIR / "think" / "model.safetensors", d)
    (d / "extra.bin").write_bytes(b"x")  # a file the manifest lists must match; one it lists must exist
    edit_manifest(d, files={**json.loads((d / "manifest.json").read_text())["files"], "extra.bin": "0" * 64})
    with pytest.raises(SpecRLError, match=r"sha256 of extra\.bin"):
        resolve_drafter(f"eagle:{d}", target)
    edit_manifest(d, files={"config.json": shipped.sha256_of(d / "config.json")})
    with pytest.raises(SpecRLError, match=r"sha256.*safetensors is None"):
        resolve_drafter(f"eagle:{d}", target)


def _other_vocabulary(tmp_path, target):
    """A checkpoint directory whose tokenizer swaps two of the target's tokens (same shape, another model)."""
    d = tmp_path / "other-model"
    d.mkdir()
    tok = json.loads((target.checkpoint_dir / "tokenizer.json").read_text())
    vocab = tok["model"]["vocab"]
    a, b = sorted(vocab, key=vocab.get)[1000:1002]
    vocab[a], vocab[b] = vocab[b], vocab[a]
    (d / "tokenizer.json").write_text(json.dumps(tok))
    shutil.copy(target.checkpoint_dir / "config.json", d)
    return d


def test_the_target_is_checked_against_the_actual_model_not_a_constant(tmp_path, target, monkeypatch):
    from specrl.drafters.storage.shipped import load_shipped

    other = _other_vocabulary(tmp_path, target)
    monkeypatch.setattr(target, "checkpoint_dir", other)
    with pytest.raises(SpecRLError, match=r"smollm2-135m.*other-model.*vocabulary"):
        load_shipped("eagle", "think", target)
    monkeypatch.setattr(target, "checkpoint_dir", tmp_path / "no-tokenizer")
    with pytest.raises(SpecRLError, match=r"no tokenizer files.*confirmed"):
        load_shipped("eagle", "think", target)
    monkeypatch.setattr(target.args, "num_layers", 24)
    with pytest.raises(SpecRLError, match=r"num_layers 30\b.*num_layers 24"):
        load_shipped("eagle", "think", target)


def test_the_vllm_export_of_a_shipped_head_checks_the_target_directory(tmp_path, target):
    from specrl.drafters.storage.export import export_vllm_eagle3

    other = _other_vocabulary(tmp_path, target)
    with pytest.raises(SpecRLError, match="has another vocabulary"):
        export_vllm_eagle3(shipped.SHIPPED_DIR / "think", other, tmp_path / "out")
    cfg = json.loads((other / "config.json").read_text())
    (other / "config.json").write_text(json.dumps({**cfg, "hidden_size": 640}))
    with pytest.raises(SpecRLError, match=r"hidden_size 576\b.*hidden_size 640"):
        export_vllm_eagle3(shipped.SHIPPED_DIR / "think", other, tmp_path / "out")
    out = export_vllm_eagle3(shipped.SHIPPED_DIR / "think", target.checkpoint_dir, tmp_path / "out")
    assert (out / "model.safetensors").is_file()
