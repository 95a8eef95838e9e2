"""The vLLM backend's options and how a specrl drafter spec maps onto vLLM's `speculative_config`: `VLLMOptions` (the
engine's settings, checked, `auto` dtype resolved for this machine), `speculative_config(opts, ...)` (method and k,
plus each vLLM method's own entries: n-gram's lookup window, a draft model's or an EAGLE-3 head's directory, a
specrl EAGLE head exported to vLLM's layout first) and `fused_group_errors` (the fused q/k/v and gate/up groups a
partial refit would split). Light: no vLLM import, so the options are checked before vLLM starts.
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from specrl.device import resolve_device, resolve_dtype
from specrl.errors import SpecRLError
from specrl.rollout.drafter_spec import EMBEDDED, DrafterSpec, kinds_offered, parse_drafter_spec

SAMPLING_FIX = ("auto", "on", "off")
_FUSED = (re.compile(r"\.(q|k|v)_proj\."), re.compile(r"\.(gate|up)_proj\."))



@dataclass(frozen=True)
class VLLMOptions:
    dtype: str = "auto"  # "auto" (bf16 where the device has bf16 units, else fp32) | "bfloat16" | "float32" | "float16"
    max_model_len: int = 1024
    kv_cache_space_gib: float = 1.0
    enforce_eager: bool = True
    tensor_parallel_size: int = 1
    max_num_seqs: int = 64
    seed: int = 0
    drafter: str = "none"  # a specrl drafter spec: none | ngram | draft-model:DIR | eagle:DIR (a vllm-eagle3 export)
    num_draft_tokens: int = 3
    draft_sample_method: str = "greedy"  # vLLM's: greedy (q = one-hot) | probabilistic (full q)
    sampling_fix: str = "auto"  # auto (on for CPU platforms) | on | off

    def __post_init__(self):
        if self.dtype not in ("auto", "bfloat16", "float32", "float16"):
            raise SpecRLError(f"vLLM dtype must be auto, bfloat16, float32 or float16, got {self.dtype!r}")
        if self.dtype == "auto":  # what this machine runs fast (specrl.device), not vLLM's "auto" (the checkpoint's)
            object.__setattr__(self, "dtype", resolve_dtype("auto", resolve_device("auto")))
        if not isinstance(self.max_model_len, int) or self.max_model_len < 16:
            raise SpecRLError(f"vLLM max_model_len must be an integer >= 16, got {self.max_model_len!r}")
        if not self.kv_cache_space_gib > 0:
            raise SpecRLError(f"vLLM kv_cache_space_gib must be > 0, got {self.kv_cache_space_gib!r}")
        if self.tensor_parallel_size != 1:
            raise SpecRLError(f"vLLM tensor_parallel_size={self.tensor_parallel_size}: this backend runs vLLM "
                              "in-process (refit by reference), which is one worker; use tensor_parallel_size=1")
        if self.sampling_fix not in SAMPLING_FIX:
            raise SpecRLError(f"vLLM sampling_fix must be one of {list(SAMPLING_FIX)}, got {self.sampling_fix!r}")
        if self.draft_sample_method not in ("greedy", "probabilistic"):
            raise SpecRLError("vLLM draft_sample_method must be 'greedy' or 'probabilistic', got "
                              f"{self.draft_sample_method!r}")
        spec = parse_drafter_spec(self.drafter)
        if spec.kind not in kinds_offered("vllm"):
            raise SpecRLError(f"drafter {self.drafter!r} has no vLLM equivalent (vLLM backend drafters: none, "
                              "ngram, suffix, draft-model:DIR, eagle:DIR with DIR a `specrl draft export --format "
                              "vllm-eagle3` output); MTP heads trained by specrl do not map onto vLLM's MTP")
        if spec.info.drafts and (not isinstance(self.num_draft_tokens, int) or self.num_draft_tokens < 1):
            raise SpecRLError(f"vLLM num_draft_tokens must be an integer >= 1 with a drafter (vLLM has no 'auto'), "
                              f"got {self.num_draft_tokens!r}")


def speculative_config(opts: VLLMOptions, model_dir: str | os.PathLike | None = None,
                       export_to: str | os.PathLike | None = None) -> dict | None:
    """vLLM's `speculative_config` for `opts.drafter`. `eagle:DIR` takes a vLLM EAGLE-3 checkpoint as it is, or a
    specrl EAGLE directory, which is exported (`specrl.drafters.storage.export`) for the target `model_dir` into
    `export_to` first; the returned dict then has `specrl_eagle: True` (refits must be renamed)."""
    spec = parse_drafter_spec(opts.drafter)
    if not spec.info.drafts:
        return None
    method = spec.info.vllm
    sc: dict = {"method": method, "num_speculative_tokens": opts.num_draft_tokens}
    options = _METHOD_OPTIONS.get(method)
    if options is not None:
        sc.update(options(opts, spec, model_dir, export_to))
    return sc


def _checkpoint_dir(opts: VLLMOptions, spec: DrafterSpec) -> Path:
    d = Path(spec.arg).expanduser()
    if spec.info.embedded and spec.arg in EMBEDDED and not (d / "config.json").is_file():
        raise SpecRLError(f"drafter {opts.drafter!r}: give the head's directory (the trainer and `specrl "
                          f"check-backend` resolve {spec.kind}:default / {spec.kind}:think, building them on first "
                          "use)")
    if not (d / "config.json").is_file():
        raise SpecRLError(f"drafter {opts.drafter!r}: {d} is not a checkpoint directory (no config.json)")
    return d


def _ngram_options(opts: VLLMOptions, spec: DrafterSpec, model_dir, export_to) -> dict:
    return {"prompt_lookup_min": 1, "prompt_lookup_max": 4}


def _draft_model_options(opts: VLLMOptions, spec: DrafterSpec, model_dir, export_to) -> dict:
    return {"model": str(_checkpoint_dir(opts, spec)), "draft_sample_method": opts.draft_sample_method}


def _eagle3_options(opts: VLLMOptions, spec: DrafterSpec, model_dir, export_to) -> dict:
    """A vLLM EAGLE-3 checkpoint as it is, or a specrl EAGLE directory exported for vLLM first."""
    d = _checkpoint_dir(opts, spec)
    specrl_eagle = False
    cfg = json.loads((d / "config.json").read_text())
    if cfg.get("format") == "specrl-drafter":
        if model_dir is None or export_to is None:
            raise SpecRLError(f"drafter {opts.drafter!r} is a specrl EAGLE head: exporting it for vLLM "
                              "needs the target's model_dir and a directory to export to")
        from specrl.drafters.storage.export import export_vllm_eagle3

        d = export_vllm_eagle3(d, model_dir, export_to, dtype=opts.dtype)
        specrl_eagle = True
    elif "LlamaForCausalLMEagle3" not in cfg.get("architectures", []):
        raise SpecRLError(f"drafter {opts.drafter!r}: {d} is neither a specrl EAGLE head nor in vLLM's "
                          f"EAGLE-3 layout (architectures {cfg.get('architectures')}); give a directory "
                          "written by `specrl draft init --drafter eagle` or `specrl draft export --format "
                          "vllm-eagle3`")
    return {"model": str(d), "draft_sample_method": opts.draft_sample_method,
            **({"specrl_eagle": True} if specrl_eagle else {})}


# vLLM's speculative_config entries for each vLLM method (a kind's `DrafterKind.vllm`) beyond method and
# num_speculative_tokens; a method without an entry (suffix) takes none
_METHOD_OPTIONS = {"ngram": _ngram_options, "draft_model": _draft_model_options, "eagle3": _eagle3_options}


def fused_group_errors(names: Sequence[str]) -> list[str]:
    """Names of fused groups (q/k/v, gate/up) that a partial refit would split: vLLM reloads them together."""
    present = set(names)
    bad = []
    for n in names:
        for pat in _FUSED:
            m = pat.search(n)
            if m:
                members = ("q", "k", "v") if m.group(1) in ("q", "k", "v") else ("gate", "up")
                missing = [pat.sub(f".{x}_proj.", n, count=1) for x in members]
                missing = [x for x in missing if x not in present]
                if missing:
                    bad.append(f"{n} without {missing}")
    return bad
