"""Model and hardware catalogs: parameter counts from specs, HF config parsing, MoE/MLA/MTP structure."""

import json

import pytest

from specrl.errors import SpecRLError
from specrl.sim.costs.accelerators import CATALOG, get_hardware, load_profile, save_profile
from specrl.sim.costs.models import eagle3_head, from_hf_config, get_model, load_config, model_names, mtp_head


@pytest.mark.parametrize("name,total,active", [
    ("qwen3-8b", 8.19e9, 7.57e9),  # active excludes the input embedding lookup
    ("qwen3-32b", 32.8e9, 32.0e9),
    ("qwen3-235b-a22b", 235.1e9, 21.6e9),
    ("llama-3.1-70b", 70.6e9, 69.5e9),
    ("deepseek-v3", 671.0e9, 36.6e9),
    ("smollm2-135m", 134.5e6, 134.5e6),
])
def test_catalog_parameter_counts(name, total, active):
    m = get_model(name)
    assert m.total_params() == pytest.approx(total, rel=0.01)
    assert m.active_params() == pytest.approx(active, rel=0.02)


def test_required_catalog_entries():
    for name in ("qwen3-8b", "qwen3-32b", "qwen3-235b-a22b", "llama-3.1-70b", "deepseek-v3"):
        assert name in model_names()
    for name in ("h100", "h200", "b200", "gb200"):
        hw = get_hardware(name)
        assert hw.flops("fp8") == pytest.approx(2 * hw.flops("bf16"), rel=0.01)
    assert CATALOG["gb200"].nvlink_domain == 72


def test_moe_touched_experts_grow_with_tokens():
    m = get_model("qwen3-235b-a22b")
    assert m.experts_touched(1) == pytest.approx(8)
    assert m.experts_touched(4096) == pytest.approx(128, rel=1e-3)
    assert m.streamed_params(1) < m.streamed_params(16) < m.streamed_params(1024) <= m.total_params()


def test_kv_bytes_gqa_and_mla():
    assert get_model("qwen3-8b").kv_bytes_per_token() == 2 * 36 * 8 * 128 * 2
    ds = get_model("deepseek-v3")
    assert ds.is_mla and ds.kv_bytes_per_token() == 61 * (512 + 64) * 2
    assert ds.mtp_layers == 1


def test_hf_config_dense_moe_and_shared_experts(tmp_path):
    mixtral = {"hidden_size": 4096, "num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 8,
               "intermediate_size": 14336, "vocab_size": 32000, "num_local_experts": 8, "num_experts_per_tok": 2}
    m = from_hf_config(mixtral, "mixtral")
    assert m.is_moe and m.moe_intermediate == 14336 and m.intermediate == 0
    assert m.total_params() == pytest.approx(46.7e9, rel=0.01)
    assert m.active_params() == pytest.approx(12.9e9, rel=0.02)
    qwen2moe = dict(mixtral, num_experts=60, num_experts_per_tok=4, moe_intermediate_size=1408,
                    shared_expert_intermediate_size=5632)
    del qwen2moe["num_local_experts"]
    q = from_hf_config(qwen2moe)
    assert q.shared_experts == 1 and q.shared_intermediate == 5632
    path = tmp_path / "cfg" / "config.json"
    path.parent.mkdir()
    path.write_text(json.dumps(mixtral))
    assert load_config(path.parent).total_params() == m.total_params()
    assert get_model(str(path)).name == "cfg"


def test_drafters_from_target():
    e = eagle3_head(get_model("qwen3-8b"))
    assert 0.2e9 < e.total_params() < 0.6e9
    assert mtp_head(get_model("deepseek-v3")).is_moe
    with pytest.raises(SpecRLError, match="no MTP layers"):
        mtp_head(get_model("qwen3-8b"))


def test_cpu_profile_roundtrip(tmp_path):
    prof = {"name": "cpu", "peak_flops": {"bf16": 1e11, "fp32": 5e10, "fp8": 1e11}, "hbm_bandwidth": 2e10,
            "hbm_bytes": 16e9, "nvlink_bandwidth": 2e10, "network_bandwidth": 1e9, "nvlink_domain": 1}
    path = save_profile(prof, tmp_path / "cpu.json")
    hw = get_hardware("cpu", path)
    assert hw.measured and hw.flops("fp32") == 5e10
    (tmp_path / "bad.json").write_text("{}")
    with pytest.raises(SpecRLError, match="malformed"):
        load_profile(tmp_path / "bad.json")
    with pytest.raises(SpecRLError, match="profile-hardware"):
        get_hardware("cpu", tmp_path / "missing.json")


def test_moe_forward_pays_dispatch_and_combine_collectives_per_layer():
    from specrl.sim.costs.roofline import Efficiency, ForwardCost

    hw, eff = get_hardware("gb200"), Efficiency()
    moe, dense = get_model("qwen3-235b-a22b"), get_model("qwen3-32b")
    # attention all-reduce + MoE dispatch + combine: 3 collectives per MoE layer; dense: attention + FFN all-reduce
    assert ForwardCost(moe, hw, eff, "fp8", 4, 0.0).comm_fixed == pytest.approx(3 * 94 * hw.collective_latency_s)
    assert ForwardCost(dense, hw, eff, "bf16", 4, 0.0).comm_fixed == pytest.approx(2 * 64 * hw.collective_latency_s)


def test_moe_trainer_pays_expert_parallel_all_to_all():
    from specrl.sim.pipeline import moe_train_a2a_seconds

    hw, moe = get_hardware("gb200"), get_model("qwen3-235b-a22b")
    assert moe_train_a2a_seconds(get_model("qwen3-8b"), hw, 1e6, 32, 512) == 0.0
    assert moe_train_a2a_seconds(moe, hw, 1e6, 1, 512) == 0.0  # experts not split: nothing to send
    t = moe_train_a2a_seconds(moe, hw, 8e6, 32, 512)
    bytes_per_gpu = 8e6 / 512 * 2 * 8 * 4096 * 2 * 94 * 31 / 32  # dispatch + combine, bf16, 94 MoE layers
    assert t == pytest.approx(bytes_per_gpu / hw.nvlink_bandwidth + 2 * 94 * hw.collective_latency_s)
    assert moe_train_a2a_seconds(moe, hw, 8e6, 128, 512) > t  # EP beyond the 72-GPU NVLink domain: network


def test_the_cpu_profile_times_the_engines_decode_gemv(monkeypatch):
    """profile_cpu's GEMV bandwidth is measured on the kernel the engine runs (prepacked, where supported)."""
    import torch

    from specrl.model import packed
    from specrl.sim.costs.accelerators import profile_cpu

    calls = []
    real = packed.fused_linear
    monkeypatch.setattr(packed, "fused_linear", lambda *a, **k: calls.append(1) or real(*a, **k))
    prof = profile_cpu(matmul_size=64, bandwidth_mb=2, repeats=1)
    assert prof["hbm_bandwidth"] > 0 and prof["copy_bandwidth"] > 0
    if packed.supported(torch.bfloat16, "cpu"):
        assert calls, "the GEMV did not run through the packed path"
