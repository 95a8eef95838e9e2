"""Our transformer against transformers' own implementation, and checkpoint round trips."""

import json

import pytest
import torch

from specrl.errors import SpecRLError
from specrl.model.hf_checkpoint import load_hf_checkpoint, save_hf_checkpoint
from specrl.model.loader import load_model
from specrl.model.transformer import tiny_model
from tests.conftest import specrl_twin, tiny_hf


def test_prefill_logits_match_transformers(family_pair):
    _, hf, ours = family_pair
    x = torch.randint(0, 96, (3, 40))
    with torch.no_grad():
        ref = hf(x).logits
        got, _ = ours(x)
    assert (ref - got).abs().max().item() < 1e-4


def test_incremental_decoding_with_cache_matches(family_pair):
    _, hf, ours = family_pair
    x = torch.randint(0, 96, (2, 30))
    with torch.no_grad():
        ref = hf(x).logits
        cache = ours.new_cache(2, 64)
        parts = [ours(x[:, :20], torch.arange(20).expand(2, 20), cache)[0]]
        for t in range(20, 30):  # one token at a time
            parts.append(ours(x[:, t:t + 1], torch.full((2, 1), t), cache)[0])
    got = torch.cat(parts, dim=1)
    assert (ref - got).abs().max().item() < 1e-4


def test_greedy_generation_token_identical(family_pair):
    from specrl import RolloutEngine, SamplingParams

    _, hf, ours = family_pair
    prompt = [5, 17, 33, 2, 81]
    ref = hf.generate(torch.tensor([prompt]), max_new_tokens=24, do_sample=False, min_new_tokens=24,
                      pad_token_id=0)[0, len(prompt):].tolist()
    out = RolloutEngine(ours, max_batch_size=2, max_seq_len=64).generate(
        [prompt], SamplingParams(temperature=0, max_new_tokens=24))[0]
    assert out.token_ids == ref


def test_capture_hidden_states_match_transformers():
    hf = tiny_hf("llama")
    ours = specrl_twin(hf)
    x = torch.randint(0, 96, (2, 12))
    with torch.no_grad():
        ref = hf(x, output_hidden_states=True).hidden_states  # [embeddings, layer0, layer1, ...]
        _, cap = ours(x, capture=(0, 1))
    assert (cap[0] - ref[1]).abs().max() < 1e-5
    assert (cap[1] - ref[2]).abs().max() < 1e-5


def test_save_load_roundtrip_and_sharded(tmp_path):
    m = tiny_model("qwen3")
    save_hf_checkpoint(m, tmp_path / "ck")
    m2 = load_hf_checkpoint(tmp_path / "ck", dtype=torch.float32)
    x = torch.randint(0, 64, (1, 9))
    assert torch.equal(m(x)[0], m2(x)[0])
    # sharded: split the single file into two shards with an index
    from safetensors.torch import load_file, save_file

    state = load_file(str(tmp_path / "ck" / "model.safetensors"))
    names = sorted(state)
    half = len(names) // 2
    shard_dir = tmp_path / "sharded"
    shard_dir.mkdir()
    (shard_dir / "config.json").write_text((tmp_path / "ck" / "config.json").read_text())
    save_file({n: state[n] for n in names[:half]}, str(shard_dir / "a.safetensors"))
    save_file({n: state[n] for n in names[half:]}, str(shard_dir / "b.safetensors"))
    wm = {n: ("a.safetensors" if i < half else "b.safetensors") for i, n in enumerate(names)}
    (shard_dir / "model.safetensors.index.json").write_text(json.dumps({"weight_map": wm}))
    m3 = load_hf_checkpoint(shard_dir, dtype=torch.float32)
    assert torch.equal(m(x)[0], m3(x)[0])


def test_bf16_model_runs():
    m = tiny_model("llama").to(torch.bfloat16)
    logits, _ = m(torch.randint(0, 64, (2, 5)))
    assert logits.dtype == torch.float32 and torch.isfinite(logits).all()


# ---------------------------------------------------------------- bad input
def _ckpt(tmp_path):
    save_hf_checkpoint(tiny_model("llama"), tmp_path / "ck")
    return tmp_path / "ck"


def test_unknown_architecture_lists_supported(tmp_path):
    d = _ckpt(tmp_path)
    cfg = json.loads((d / "config.json").read_text())
    cfg["architectures"] = ["GPT2LMHeadModel"]
    (d / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(SpecRLError, match="GPT2LMHeadModel.*LlamaForCausalLM"):
        load_hf_checkpoint(d)


def test_missing_and_unexpected_tensors_are_named(tmp_path):
    from safetensors.torch import load_file, save_file

    d = _ckpt(tmp_path)
    state = load_file(str(d / "model.safetensors"))
    state.pop("model.layers.1.mlp.up_proj.weight")
    state["model.layers.9.extra.weight"] = torch.zeros(2)
    save_file(state, str(d / "model.safetensors"))
    with pytest.raises(SpecRLError, match=r"missing:.*up_proj.*9\.extra"):
        load_hf_checkpoint(d)


def test_shape_mismatch_is_named(tmp_path):
    d = _ckpt(tmp_path)
    cfg = json.loads((d / "config.json").read_text())
    cfg["intermediate_size"] = 65
    (d / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(SpecRLError, match="gate_proj.weight has shape"):
        load_hf_checkpoint(d)


@pytest.mark.parametrize("damage", ["truncate", "garbage"])
def test_corrupt_safetensors(tmp_path, damage):
    d = _ckpt(tmp_path)
    f = d / "model.safetensors"
    data = f.read_bytes()
    f.write_bytes(data[: len(data) // 2] if damage == "truncate" else b"\x07" * 64 + data[64:])
    with pytest.raises(SpecRLError, match="corrupt or truncated"):
        load_hf_checkpoint(d)


def test_missing_checkpoint_files(tmp_path):
    with pytest.raises(SpecRLError, match="no config.json"):
        load_hf_checkpoint(tmp_path)
    d = _ckpt(tmp_path)
    (d / "model.safetensors").unlink()
    with pytest.raises(SpecRLError, match="no model.safetensors"):
        load_hf_checkpoint(d)


def test_unknown_preset_lists_presets():
    with pytest.raises(SpecRLError, match="smollm2-135m"):
        load_model("smollm3-9000b")
