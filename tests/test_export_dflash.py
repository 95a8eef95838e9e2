"""vLLM's DFlash layout (`specrl.drafters.storage.export_dflash`) and the refusal of a parallel head, without
starting vLLM.

The layout is checked shape by shape for a head config; a parallel head's state dict (an EAGLE-3 layer plus one
learned [embedding; feature] placeholder per draft depth, as `specrl.drafters.kinds.parallel` documents it) is refused
with every mismatch named; a state dict already in DFlash's layout passes the same check, so the refusal is the
head's shape and not the checker. Where vLLM is installed, its DFlash model source is read for the facts the
refusal rests on.
"""

import re

import pytest
import torch

from specrl.drafters.kinds.eagle import EagleDrafter
from specrl.drafters.storage.export_dflash import (
    ARCHITECTURE,
    check_dflash_export,
    dflash_config,
    dflash_layout,
    dflash_mismatches,
)
from specrl.errors import SpecRLError
from specrl.model.transformer import tiny_model

MAX_K = 4


@pytest.fixture(scope="module")
def parallel_head():
    """(state, config) of a parallel head on a tiny target, over a draft vocabulary of 40 of its 64 tokens."""
    target = tiny_model("llama", vocab_size=64, seed=3)
    eagle = EagleDrafter(target, layers=(0, 1, 3), draft_vocab=list(range(0, 64))[:40])
    state = dict(eagle.state_dict())
    state["placeholders"] = torch.zeros(MAX_K - 1, 2 * target.args.hidden_size)
    return state, {**eagle.config(), "kind": "parallel", "max_k": MAX_K}


def test_layout_names_and_shapes(parallel_head):
    _, cfg = parallel_head
    lay = dflash_layout(cfg)  # H 32, 4 heads x 8, 2 kv heads, intermediate 64, 3 target layers, draft vocab 40
    assert lay["fc.weight"] == (32, 96) and lay["hidden_norm.weight"] == (32,)
    assert lay["layers.0.self_attn.q_proj.weight"] == (32, 32) and lay["layers.0.self_attn.k_proj.weight"] == (16, 32)
    assert lay["layers.0.self_attn.q_norm.weight"] == (8,) and lay["layers.0.self_attn.k_norm.weight"] == (8,)
    assert lay["layers.0.mlp.down_proj.weight"] == (32, 64) and lay["lm_head.weight"] == (40, 32)
    assert lay["d2t"] == (40,)
    assert "d2t" not in dflash_layout({**cfg, "draft_vocab_size": 64})  # full vocabulary: no map
    assert not any("embed_tokens" in k for k in lay)


def test_config_fields(parallel_head):
    _, cfg = parallel_head
    c = dflash_config(cfg, mask_token_id=7)
    assert c["architectures"] == [ARCHITECTURE] and c["model_type"] == "qwen3" and c["num_hidden_layers"] == 1
    assert c["dflash_config"] == {"target_layer_ids": [0, 1, 3], "mask_token_id": 7, "use_aux_hidden_state": True,
                                  "causal": True}
    assert c["draft_vocab_size"] == 40 and c["vocab_size"] == 64 and c["head_dim"] == 8


def test_parallel_head_is_refused_with_every_mismatch_named(parallel_head):
    state, cfg = parallel_head
    found = dflash_mismatches(state, cfg)
    text = " | ".join(found)
    assert any(s.startswith("placeholders:") for s in found) and any(s.startswith("layer_norms:") for s in found)
    for p in ("q_proj", "k_proj", "v_proj"):
        assert f"block.self_attn.{p}.weight" in text
    (q,) = [s for s in found if s.startswith("block.self_attn.q_proj.weight ")]
    assert "weight (32, 64)" in q and "layers.0.self_attn.q_proj.weight is (32, 32)" in q
    for norm in ("q_norm", "k_norm"):
        assert any(re.search(rf"no tensor\b.*layers\.0\.self_attn\.{norm}\.weight \(8,\)", s) for s in found)
    assert not any(s.startswith(("fc.", "norm.", "lm_head.", "d2t", "block.mlp", "block.hidden_norm")) for s in found)
    with pytest.raises(SpecRLError, match=r"'parallel'.*DFlash.*placeholders:.*native"):
        check_dflash_export(state, cfg)


def test_a_head_in_dflash_layout_passes_the_same_check(parallel_head):
    _, cfg = parallel_head
    state = {k: torch.zeros(shape) for k, shape in dflash_layout(cfg).items()}
    assert dflash_mismatches(state, cfg) == []
    check_dflash_export(state, cfg)  # no error
    state["extra.weight"] = torch.zeros(3)
    assert dflash_mismatches(state, cfg) == ["extra.weight (3,): DFlash has no tensor in its role"]


def test_full_vocabulary_d2t_is_not_a_mismatch(parallel_head):
    _, cfg = parallel_head
    full = {**cfg, "draft_vocab_size": 64}
    state = {k: torch.zeros(s) for k, s in dflash_layout(full).items()}
    state["d2t"] = torch.arange(64)
    assert dflash_mismatches(state, full) == []


def test_bad_config_is_named(parallel_head):
    state, cfg = parallel_head
    bad = {k: v for k, v in cfg.items() if k not in ("head_dim", "layers")}
    with pytest.raises(SpecRLError, match=r"lacks \['head_dim', 'layers'\]"):
        check_dflash_export(state, bad)


def test_vllm_dflash_model_declares_what_the_refusal_rests_on():
    """Where vLLM is installed: its DFlash layer has q/k norms and H-wide q/k/v projections, fc has no bias, the
    context K/V come from hidden_norm(fc(features)), and queries embed mask_token_id."""
    pytest.importorskip("vllm", reason="vLLM is not installed here (make venv-vllm / make test-vllm)")
    import inspect

    from vllm.model_executor.models import qwen3_dflash

    src = inspect.getsource(qwen3_dflash)
    assert "self.q_norm = RMSNorm(self.head_dim" in src and "self.k_norm = RMSNorm(self.head_dim" in src
    assert "QKVParallelLinear(\n            hidden_size," in src
    assert "self.hidden_norm = RMSNorm(" in src and "self._hidden_norm_weight" in src
    assert "mask_token_id" in src and "def precompute_and_store_context_kv" in src
    assert '"midlayer.": "layers.0."' in src and 'name.replace("d2t", "draft_id_to_target_id")' in src
