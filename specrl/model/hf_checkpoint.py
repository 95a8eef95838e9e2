"""HF checkpoint interop: config.json <-> ModelArgs, safetensors (single file or sharded index) load/save.

`load_hf_checkpoint(dir)` returns our `Transformer` from a directory holding an HF checkpoint (`load_model` in
`loader.py` adds preset names and the tokenizer). Loading validates everything a user can get wrong: unknown
architecture, missing or unexpected tensors, shape mismatches, corrupt or truncated files. `copy_state` is the
same validated copy for any module's own state dict (drafters use it).
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file

from specrl.errors import SpecRLError
from specrl.model.transformer import SUPPORTED_ARCHITECTURES, ModelArgs, Transformer, _rope_inv_freq

_DTYPES = {"float32": torch.float32, "fp32": torch.float32, "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
           "float16": torch.float16, "fp16": torch.float16}


def parse_dtype(dtype: str | torch.dtype) -> torch.dtype:
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype not in _DTYPES:
        raise SpecRLError(f"unknown dtype {dtype!r}; use one of {sorted(_DTYPES)}")
    return _DTYPES[dtype]


def args_from_hf_config(cfg: dict, where: str = "config.json") -> ModelArgs:
    archs = cfg.get("architectures") or []
    arch_name = archs[0] if archs else None
    if arch_name not in SUPPORTED_ARCHITECTURES:
        raise SpecRLError(f"{where}: architecture {arch_name!r} is not supported; supported architectures are "
                          f"{sorted(SUPPORTED_ARCHITECTURES)}")
    arch = SUPPORTED_ARCHITECTURES[arch_name]
    try:
        hidden = int(cfg["hidden_size"])
        heads = int(cfg["num_attention_heads"])
        rope = cfg.get("rope_parameters") or {}
        rope_theta = cfg.get("rope_theta", rope.get("rope_theta", 10000.0))
        scaling = cfg.get("rope_scaling") or (rope if rope.get("rope_type", "default") != "default" else None)
        if scaling and scaling.get("rope_type", scaling.get("type")) not in (None, "default", "llama3"):
            raise SpecRLError(f"{where}: rope scaling {scaling!r} is not supported; supported: none, llama3")
        if arch == "llama" and (cfg.get("attention_bias") or cfg.get("mlp_bias")):
            raise SpecRLError(f"{where}: Llama with attention_bias/mlp_bias is not supported; expected both false")
        eos = cfg.get("eos_token_id")
        eos_list = [] if eos is None else ([int(eos)] if isinstance(eos, int) else [int(e) for e in eos])
        return ModelArgs(
            arch=arch,
            vocab_size=int(cfg["vocab_size"]),
            hidden_size=hidden,
            intermediate_size=int(cfg["intermediate_size"]),
            num_layers=int(cfg["num_hidden_layers"]),
            num_heads=heads,
            num_kv_heads=int(cfg.get("num_key_value_heads") or heads),
            head_dim=int(cfg.get("head_dim") or hidden // heads),
            rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
            rope_theta=float(rope_theta),
            rope_scaling=scaling,
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            attention_bias=arch == "qwen2" or (arch == "qwen3" and bool(cfg.get("attention_bias", False))),
            qk_norm=arch == "qwen3",
            max_position_embeddings=int(cfg.get("max_position_embeddings", 8192)),
            bos_token_id=cfg.get("bos_token_id"),
            eos_token_id=eos_list,
        )
    except KeyError as e:
        raise SpecRLError(f"{where}: required field {e.args[0]!r} is missing") from None


def hf_config_from_args(args: ModelArgs) -> dict:
    arch_name = {v: k for k, v in SUPPORTED_ARCHITECTURES.items()}[args.arch]
    cfg = {
        "architectures": [arch_name],
        "model_type": args.arch,
        "vocab_size": args.vocab_size,
        "hidden_size": args.hidden_size,
        "intermediate_size": args.intermediate_size,
        "num_hidden_layers": args.num_layers,
        "num_attention_heads": args.num_heads,
        "num_key_value_heads": args.num_kv_heads,
        "head_dim": args.head_dim,
        "rms_norm_eps": args.rms_norm_eps,
        "rope_theta": args.rope_theta,
        "rope_scaling": args.rope_scaling,
        "tie_word_embeddings": args.tie_word_embeddings,
        "max_position_embeddings": args.max_position_embeddings,
        "hidden_act": "silu",
        "bos_token_id": args.bos_token_id,
        "eos_token_id": args.eos_token_id[0] if len(args.eos_token_id) == 1 else args.eos_token_id,
    }
    if args.arch == "qwen3":
        cfg["attention_bias"] = args.attention_bias
    return cfg


def _hf_name(ours: str) -> str:
    return ours if ours.startswith("lm_head") else "model." + ours


def hf_named_tensors(model: Transformer) -> dict[str, torch.Tensor]:
    """The model's parameters under their HF checkpoint names, detached (tied weights appear once)."""
    return {_hf_name(n): p.detach() for n, p in model.named_parameters()}


def expected_tensor_names(model: Transformer) -> list[str]:
    names = [n for n, _ in model.named_parameters()]
    return [_hf_name(n) for n in names]


def _read_safetensors(path: Path) -> dict[str, torch.Tensor]:
    try:
        return load_file(str(path))
    except (SafetensorError, OSError, RuntimeError, ValueError) as e:
        raise SpecRLError(f"{path}: cannot read safetensors file (corrupt or truncated?): {e}; "
                          "re-export or re-download the checkpoint") from None


def read_state_dict(ckpt_dir: Path) -> dict[str, torch.Tensor]:
    single = ckpt_dir / "model.safetensors"
    index = ckpt_dir / "model.safetensors.index.json"
    if single.exists():
        return _read_safetensors(single)
    if index.exists():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (json.JSONDecodeError, KeyError) as e:
            raise SpecRLError(f"{index}: malformed shard index ({e}); "
                              "expected {'weight_map': {name: file}}") from None
        state: dict[str, torch.Tensor] = {}
        for shard in sorted(set(weight_map.values())):
            state.update(_read_safetensors(ckpt_dir / shard))
        return state
    raise SpecRLError(f"{ckpt_dir}: no model.safetensors or model.safetensors.index.json found; "
                      "expected an HF checkpoint directory")


def load_state_into(model: Transformer, state: dict[str, torch.Tensor], where: str) -> None:
    expected = set(expected_tensor_names(model))
    if model.args.tie_word_embeddings:
        expected.discard("lm_head.weight")
        state = {k: v for k, v in state.items() if k != "lm_head.weight"}
    state = {k: v for k, v in state.items() if not k.endswith("rotary_emb.inv_freq")}
    missing = sorted(expected - set(state))
    unexpected = sorted(set(state) - expected)
    if missing or unexpected:
        raise SpecRLError(f"{where}: tensor names do not match the {model.args.arch} architecture; "
                          f"missing: {missing[:10]}{' ...' if len(missing) > 10 else ''}; "
                          f"unexpected: {unexpected[:10]}{' ...' if len(unexpected) > 10 else ''}")
    params = dict(model.named_parameters())
    with torch.no_grad():
        for ours, p in params.items():
            t = state[_hf_name(ours)]
            if tuple(t.shape) != tuple(p.shape):
                raise SpecRLError(f"{where}: tensor {_hf_name(ours)} has shape {tuple(t.shape)}, the config "
                                  f"implies {tuple(p.shape)}")
            p.copy_(t.to(p.dtype))


def copy_state(module: torch.nn.Module, state: dict[str, torch.Tensor], where: str,
               expected_by: str = "the destination module") -> None:
    """Copy `state` into `module.state_dict()` in place (casting dtype); a clear error naming bad names/shapes.

    `where` names the source in messages (e.g. a file), `expected_by` what defines the expected names and shapes
    (e.g. "config.json" for a drafter directory).
    """
    expected = module.state_dict()
    missing = sorted(set(expected) - set(state))
    unexpected = sorted(set(state) - set(expected))
    if missing or unexpected:
        raise SpecRLError(f"{where}: tensors do not match {expected_by}: missing tensors {missing[:5]}, "
                          f"unexpected tensors {unexpected[:5]}")
    for name, t in expected.items():
        if tuple(state[name].shape) != tuple(t.shape):
            raise SpecRLError(f"{where}: tensor {name!r} has shape {tuple(state[name].shape)}, but {expected_by} "
                              f"implies {tuple(t.shape)}")
    with torch.no_grad():
        for name, t in expected.items():
            t.copy_(state[name].to(t.dtype))


def model_from_state(args: ModelArgs, state: dict[str, torch.Tensor], dtype: str | torch.dtype,
                     where: str) -> Transformer:
    """Our `Transformer` of `args` holding `state` (HF names, validated like a checkpoint's) in `dtype`, on CPU."""
    with torch.device("meta"):
        model = Transformer(args)
    model = model.to_empty(device="cpu").to(parse_dtype(dtype))
    if args.tie_word_embeddings:
        model.lm_head.weight = model.embed_tokens.weight
    model.inv_freq = _rope_inv_freq(args)  # buffers made on the meta device hold no values
    load_state_into(model, state, where)
    return model


def load_hf_checkpoint(path: str | os.PathLike, dtype: str | torch.dtype = torch.bfloat16) -> Transformer:
    ckpt_dir = Path(path)
    cfg_path = ckpt_dir / "config.json"
    if not cfg_path.exists():
        raise SpecRLError(f"{ckpt_dir}: no config.json; expected an HF checkpoint directory or a preset name")
    try:
        cfg = json.loads(cfg_path.read_text())
    except json.JSONDecodeError as e:
        raise SpecRLError(f"{cfg_path}: not valid JSON ({e})") from None
    args = args_from_hf_config(cfg, str(cfg_path))
    model = model_from_state(args, read_state_dict(ckpt_dir), dtype, str(ckpt_dir))
    check_finite(model, str(ckpt_dir), "the checkpoint is corrupt or was saved from a diverged run; use another "
                                       "checkpoint (e.g. an earlier one of the run)")
    return model.eval()


def check_finite(module: torch.nn.Module, where: str, advice: str) -> None:
    """Raise a SpecRLError naming the first parameter of `module` that holds NaN/inf values."""
    for name, p in module.named_parameters():
        if p.is_floating_point():
            if p.numel() == 0 or bool(torch.isfinite(p.detach().amax()) & torch.isfinite(p.detach().amin())):
                continue  # fast path: amax/amin propagate NaN and show +-inf
            bad = int((~torch.isfinite(p.detach())).sum())
            if bad:
                label = _hf_name(name) if isinstance(module, Transformer) else name
                raise SpecRLError(f"{where}: tensor {label} holds {bad} NaN/inf values (of {p.numel()}); {advice}")


def save_hf_checkpoint(model: Transformer, path: str | os.PathLike) -> Path:
    """Save as an HF checkpoint directory (config.json + model.safetensors)."""
    out = Path(path)
    out.mkdir(parents=True, exist_ok=True)
    state = {_hf_name(n): p.detach().contiguous() for n, p in model.named_parameters()}
    if model.args.tie_word_embeddings:
        state.pop("lm_head.weight", None)
    cfg = hf_config_from_args(model.args)
    cfg["torch_dtype"] = str(model.dtype).removeprefix("torch.")
    (out / "config.json").write_text(json.dumps(cfg, indent=2))
    save_file(state, str(out / "model.safetensors"), metadata={"format": "pt"})
    return out


def load_tokenizer(path: str | os.PathLike):
    """The tokenizer saved in the checkpoint directory `path`, never running code from it: a tokenizer that names
    its own Python class (`auto_map`) is refused (`trust_remote_code=False`) instead of asking on the terminal."""
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(str(path), trust_remote_code=False)
    except ValueError as e:
        if "trust_remote_code" not in str(e):
            raise
        raise SpecRLError(f"{path}: its tokenizer names Python code of its own (auto_map in tokenizer_config.json "
                          "or config.json), which specrl never runs; save the tokenizer with a standard "
                          "transformers class (tokenizer.json)") from None
