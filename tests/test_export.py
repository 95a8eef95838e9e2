"""`specrl draft export --format vllm-eagle3` (specrl.drafters.storage.export), without vLLM.

The exported tensors are run through a plain-torch transcription of vLLM 0.32's EAGLE-3 forward
(`vllm/model_executor/models/llama_eagle3.py`: fc_norm per aux chunk, fc, cat(input_layernorm(embed),
hidden_norm(h)) into q/k/v, residual h, post-attention norm, MLP, final norm, lm_head, then draft ids mapped by
`target = draft + d2t[draft]`) and must give specrl's own logits. The vLLM tests (`make test-vllm`) check the
same head inside vLLM itself.
"""

from __future__ import annotations

import json
import re

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file
from typer.testing import CliRunner

from specrl.cli import app
from specrl.drafters.kinds.eagle import EagleDrafter
from specrl.drafters.kinds.mtp import MTPDrafter
from specrl.drafters.storage.export import export_vllm_eagle3, vllm_eagle3_name, vllm_eagle3_state
from specrl.drafters.storage.io import load_drafter, read_config, save_drafter
from specrl.errors import SpecRLError
from specrl.model.hf_checkpoint import save_hf_checkpoint
from specrl.model.transformer import _rope_inv_freq, rope_cos_sin, tiny_model


def randomise(d, seed=0):
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in d.parameters():
            p.copy_(p + 0.3 * torch.randn(p.shape, generator=g) * (p.abs().mean() + 0.05))
    return d


@pytest.fixture
def setup(tmp_path):
    target = tiny_model("llama", vocab_size=64, seed=0, num_layers=6)
    tdir = save_hf_checkpoint(target, tmp_path / "target")
    vocab = [0, 1, 2, 5, 9, 11, 17, 20, 33, 40, 47, 63]
    d = randomise(EagleDrafter(target, layers=(0, 2, 4), draft_vocab=vocab)).float().eval()
    return target, tdir, d, save_drafter(d, tmp_path / "head"), vocab


def rms(x, w, eps):
    return w * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps))


def vllm_eagle3_logits(w: dict, cfg: dict, aux: torch.Tensor, emb: torch.Tensor) -> torch.Tensor:
    """vLLM's EAGLE-3 draft logits over the full vocabulary for one sequence: aux [T, 3H] (the target's aux
    hidden states), emb [T, H] (embedding of each entry's next token); causal attention over the T entries."""
    eps = cfg["rms_norm_eps"]
    nh, nkv, hd = cfg["num_attention_heads"], cfg["num_key_value_heads"], cfg["head_dim"]
    chunks = aux.chunk(3, dim=-1)
    x = torch.cat([rms(c, w[f"fc_norm.{i}.weight"], eps) for i, c in enumerate(chunks)], -1) @ w["fc.weight"].T
    m = "midlayer."
    attn_in = torch.cat([rms(emb, w[m + "input_layernorm.weight"], eps), rms(x, w[m + "hidden_norm.weight"], eps)],
                        -1)
    t = aux.shape[0]
    q = (attn_in @ w[m + "self_attn.q_proj.weight"].T).view(t, nh, hd).transpose(0, 1)
    k = (attn_in @ w[m + "self_attn.k_proj.weight"].T).view(t, nkv, hd).transpose(0, 1)
    v = (attn_in @ w[m + "self_attn.v_proj.weight"].T).view(t, nkv, hd).transpose(0, 1)

    class A:  # the rope of a llama config
        head_dim, rope_theta, rope_scaling = hd, cfg["rope_theta"], cfg.get("rope_scaling")

    cos, sin = rope_cos_sin(_rope_inv_freq(A), torch.arange(t)[None], torch.float32)

    def rot(z):
        z1, z2 = z.chunk(2, dim=-1)
        return z * cos[0] + torch.cat([-z2, z1], -1) * sin[0]

    q, k = rot(q), rot(k)
    k, v = k.repeat_interleave(nh // nkv, 0), v.repeat_interleave(nh // nkv, 0)
    o = F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(0, 1).reshape(t, nh * hd)
    r = x + o @ w[m + "self_attn.o_proj.weight"].T
    u = rms(r, w[m + "post_attention_layernorm.weight"], eps)
    r2 = r + (F.silu(u @ w[m + "mlp.gate_proj.weight"].T) * (u @ w[m + "mlp.up_proj.weight"].T)) @ \
        w[m + "mlp.down_proj.weight"].T
    red = rms(r2, w["norm.weight"], eps) @ w["lm_head.weight"].T
    full = torch.full((t, cfg["vocab_size"]), float("-inf"))
    full[:, torch.arange(red.shape[1]) + w["d2t"]] = red
    return full


def test_exported_head_computes_specrl_logits_in_vllm_s_forward(setup, tmp_path):
    target, tdir, d, head, vocab = setup
    out = export_vllm_eagle3(head, tdir, tmp_path / "e3")
    cfg = json.loads((out / "config.json").read_text())
    w = load_file(str(out / "model.safetensors"))
    assert cfg["architectures"] == ["LlamaForCausalLMEagle3"] and cfg["num_hidden_layers"] == 1
    assert cfg["eagle_config"] == {"eagle_aux_hidden_state_layer_ids": [1, 3, 5], "use_aux_hidden_state": True}
    assert cfg["draft_vocab_size"] == len(vocab) and cfg["fc_norm"] is True and "embed_tokens.weight" not in w
    assert torch.equal(w["t2d"].nonzero().flatten(), torch.tensor(vocab))
    tokens = torch.randint(0, 64, (1, 10), generator=torch.Generator().manual_seed(1))
    _, captured = target(tokens, capture=d.fuse_layers)
    aux = torch.cat([captured[i] for i in d.fuse_layers], -1)
    ours = d.to_full_vocab(d.forward_train(d.fuse_concat(aux), tokens, steps=1)[0])[0, :-1]
    emb = target.embed_tokens(tokens[0, 1:]).float()
    theirs = vllm_eagle3_logits(w, cfg, aux[0, :-1].float(), emb)
    finite = torch.isfinite(ours)
    assert torch.equal(finite, torch.isfinite(theirs)) and int(finite[0].sum()) == len(vocab)
    assert torch.allclose(ours[finite], theirs[finite], atol=1e-4, rtol=1e-4)


def test_every_tensor_is_renamed_and_none_is_lost(setup):
    _, _, d, _, _ = setup
    state = d.state_dict()
    mapped = vllm_eagle3_state(state)
    assert len(mapped) == len(state) - 1  # all but d2t
    assert {n.split(".")[0] for n in mapped} == {"fc_norm", "fc", "midlayer", "norm", "lm_head"}
    with pytest.raises(SpecRLError, match=r"'proj\.weight'.*EAGLE-3 layout"):
        vllm_eagle3_name("proj.weight")


def test_export_bad_input(setup, tmp_path):
    target, tdir, _, head, _ = setup
    mtp = save_drafter(MTPDrafter(target), tmp_path / "mtp")
    with pytest.raises(SpecRLError, match="only EAGLE heads export"):
        export_vllm_eagle3(mtp, tdir, tmp_path / "o1")
    other = save_hf_checkpoint(tiny_model("llama", vocab_size=64, seed=0, hidden_size=48, num_layers=6),
                               tmp_path / "t2")
    with pytest.raises(SpecRLError, match=r"hidden size.*vocabulary.*--model"):
        export_vllm_eagle3(head, other, tmp_path / "o2")
    with pytest.raises(SpecRLError, match="not an HF checkpoint"):
        export_vllm_eagle3(head, tmp_path, tmp_path / "o3")
    with pytest.raises(SpecRLError, match=r"drafter directory itself"):
        export_vllm_eagle3(head, tdir, head)
    with pytest.raises(SpecRLError, match="export dtype"):
        export_vllm_eagle3(head, tdir, tmp_path / "o4", dtype="int8")


def test_format_1_eagle_heads_are_refused_mtp_heads_still_load(setup, tmp_path):
    target, _, _, head, _ = setup
    cfg = json.loads((head / "config.json").read_text())
    assert cfg["format_version"] == 2
    (head / "config.json").write_text(json.dumps({**cfg, "format_version": 1}))
    with pytest.raises(SpecRLError, match=r"format 1\b.*draft init"):
        load_drafter(head, target)
    (head / "config.json").write_text(json.dumps({**cfg, "format_version": 3}))
    with pytest.raises(SpecRLError, match=r"format_version 3\b.*newer specrl"):
        read_config(head)
    mtp = save_drafter(MTPDrafter(target), tmp_path / "mtp")
    mcfg = json.loads((mtp / "config.json").read_text())
    (mtp / "config.json").write_text(json.dumps({**mcfg, "format_version": 1}))
    assert isinstance(load_drafter(mtp, target), MTPDrafter)


def test_cli_draft_export(setup, tmp_path):
    _, tdir, _, head, _ = setup
    runner = CliRunner()
    r = runner.invoke(app, ["draft", "export", "--drafter", f"eagle:{head}", "--model", str(tdir), "--out",
                            str(tmp_path / "cli")])
    assert r.exit_code == 0, r.output
    assert "method" in r.output and (tmp_path / "cli" / "model.safetensors").is_file()
    r = runner.invoke(app, ["draft", "export", "--drafter", f"eagle:{head}", "--model", str(tdir), "--out",
                            str(tmp_path / "x"), "--format", "onnx"])
    assert r.exit_code != 0 and re.search(r"--format\b.*\['vllm-eagle3'\].*'onnx'", r.output)
    r = runner.invoke(app, ["draft", "export", "--drafter", f"mtp:{head}", "--model", str(tdir), "--out",
                            str(tmp_path / "x")])
    assert r.exit_code != 0 and "--drafter must be eagle:DIR" in r.output
