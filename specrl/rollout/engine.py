"""The batched rollout engine: continuous batching, autoregressive and speculative decoding.

The native implementation of the rollout backend protocol (`specrl.rollout.protocol`), and the exact reference
(the only backend with `seed_exact`). Shaped like gpt-fast's generate.py: `_prefill`, `_ar_step` and
`_spec_step` are plain methods beside each other over one preallocated, slot-indexed KV cache. Active sequences
always occupy slots 0..n-1: when sequences finish, the survivors are compacted, in order, into the first slots
(one gather per cache tensor) and waiting sequences are prefilled into the slots after them, so every forward
runs on a contiguous view of the cache. Random draws depend only on (seed, request id, position), so outputs do
not depend on batch composition. Speculative steps ask the drafter for k tokens, score them in one target
forward and hand the decision to `specrl.rollout.spec_decode.verify` — the single verification point. A ragged proposal
(n-gram, suffix) is cut to its longest real draft before the forward; after it, `_verify_logits` does the
vocabulary-wide work only where it is needed (argmax alone for greedy batches, log-probs at emitted positions).
With `per_sequence_k`, each row keeps only its own budget k_i <= k of the step's drafts
(`specrl.rollout.spec_decode.seq_budget`, from that sequence's past acceptance), and the drafter is asked for max_i k_i.
With `confidence_cut`, each row then verifies only the drafts its calibrated draft confidence pays for
(`specrl.rollout.spec_decode.confidence`).
An optional `between_steps` callable runs between engine steps and may load newer weights (in-flight updates);
every emitted token records the policy version that produced it. The books of each request (its `Sequence`: what
it emitted, with which log-probs and versions, why it finished) are `specrl.rollout.sequences`'.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable

import torch
from torch import Tensor

from specrl.cpu import tick
from specrl.errors import SpecRLError
from specrl.model.hf_checkpoint import copy_state, hf_named_tensors, load_state_into
from specrl.model.packed import pack_for_inference
from specrl.rollout.digest import weights_digest
from specrl.rollout.drafter import BindContext, DraftBatch, Proposal
from specrl.rollout.drafter_spec import kinds_offered
from specrl.rollout.generation_metrics import SpecMetrics
from specrl.rollout.protocol import (
    BackendCapabilities,
    GenerationResult,
    RolloutRequest,
    check_weight_kind,
)
from specrl.rollout.sampling import (
    STREAM_ACCEPT,
    STREAM_RESIDUAL,
    STREAM_SAMPLE,
    SamplingParams,
    behaviour_logprobs,
    probs_from_scaled,
    sample_inverse_cdf,
    scaled_logits,
    uniform,
)
from specrl.rollout.sequences import Sequence, context_length, make_sequences, outputs, param_tensors, trim
from specrl.rollout.spec_decode.adaptive import DraftLengthController
from specrl.rollout.spec_decode.confidence import ConfidenceCut, check_cut
from specrl.rollout.spec_decode.seq_budget import SequenceDraftBudget
from specrl.rollout.spec_decode.verify import VERIFY_MODES, VerifyResult, check_draft_ids, verify


class RolloutEngine:
    """Batched generation with a fixed number of slots; optional speculative decoding.

    `num_draft_tokens` is an int k (0..k_max) or "auto" (choose k per step from measured costs and
    acceptance); `verify` is "rejection" (default) or "seed_exact". With `packed` (default), a model and drafter
    on CPU run their linear layers on weights laid out once for decode (`specrl.model.packed`: bf16 prepacked for
    oneDNN, bitwise the same outputs; float32 per kernel class, the same to float32 rounding); packed=False leaves the
    model as it is (one another engine packed stays packed: packing is a property of the model's modules).
    `per_sequence_k` (default off) caps each sequence's drafts by its recent acceptance (`spec_decode.seq_budget`);
    `confidence_cut` ("off", "row", "column") cuts each row's drafts by the drafter's own calibrated confidence.
    """

    def __init__(self, model, max_batch_size: int = 32, max_seq_len: int = 2048, drafter=None,
                 num_draft_tokens: int | str = 3, verify: str = "rejection", k_max: int = 7,
                 prefill_chunk_tokens: int = 4096, packed: bool = True, per_sequence_k: bool = False,
                 confidence_cut: str = "off"):
        if not isinstance(max_batch_size, int) or max_batch_size < 1:
            raise SpecRLError(f"max_batch_size must be an integer >= 1, got {max_batch_size!r}")
        if not isinstance(max_seq_len, int) or max_seq_len < 2:
            raise SpecRLError(f"max_seq_len must be an integer >= 2, got {max_seq_len!r}")
        if max_seq_len > model.args.max_position_embeddings:
            raise SpecRLError(f"max_seq_len {max_seq_len} exceeds the model's max_position_embeddings "
                              f"{model.args.max_position_embeddings}")
        if verify not in VERIFY_MODES:
            raise SpecRLError(f"verify={verify!r} is unknown; use one of {list(VERIFY_MODES)}")
        if not isinstance(k_max, int) or k_max < 1:
            raise SpecRLError(f"k_max must be an integer >= 1, got {k_max!r}")
        if num_draft_tokens != "auto" and (not isinstance(num_draft_tokens, int) or not
                                           0 <= num_draft_tokens <= k_max):
            raise SpecRLError(f"num_draft_tokens must be an integer in 0..{k_max} (k_max) or 'auto', "
                              f"got {num_draft_tokens!r}")
        if not isinstance(per_sequence_k, bool):
            raise SpecRLError(f"per_sequence_k must be true or false (per-sequence draft budgets on or off), got "
                              f"{per_sequence_k!r}")
        check_cut(confidence_cut)
        self.model = model
        self.max_batch_size = max_batch_size
        self.max_seq_len = max_seq_len
        self.k_max = k_max
        self.verify_mode = verify
        self.num_draft_tokens = num_draft_tokens
        self.prefill_chunk_tokens = prefill_chunk_tokens
        # k_max + 1 positions of margin: a verify forward may write up to k positions past the last
        # token a sequence can keep.
        try:
            self.cache = model.new_cache(max_batch_size, max_seq_len + k_max + 1)
        except (RuntimeError, MemoryError) as e:
            if "alloc" not in str(e) and not isinstance(e, MemoryError):
                raise
            a = model.args
            need = 2 * a.num_layers * max_batch_size * (max_seq_len + k_max + 1) * a.num_kv_heads * a.head_dim * \
                model.embed_tokens.weight.element_size()
            raise SpecRLError(f"the KV cache for max_batch_size={max_batch_size} x max_seq_len={max_seq_len} needs "
                              f"{need / 2**30:.1f} GiB, more than this machine can allocate; lower max_batch_size "
                              "or max_seq_len (generation.max_batch_size, model.max_seq_len in a config)") from None
        self.drafter = drafter
        self.device = model.embed_tokens.weight.device
        if drafter is not None:
            with self._on_device():
                drafter.bind(BindContext(model, max_batch_size, self.cache.max_seq_len, k_max))
        self.packed_layers = 0
        if packed:
            self.packed_layers = pack_for_inference(model)
            if isinstance(drafter, torch.nn.Module):
                self.packed_layers += pack_for_inference(drafter)
        self.controller = DraftLengthController(k_max, num_draft_tokens) if drafter is not None else None
        self.per_sequence_k = per_sequence_k
        self.budget = SequenceDraftBudget(max_batch_size) if per_sequence_k and drafter is not None else None
        self.cut = ConfidenceCut(confidence_cut, k_max) if confidence_cut != "off" and drafter is not None else None
        self.capabilities = BackendCapabilities("native", VERIFY_MODES, kinds_offered("native"), k_max,
                                                exact_seeds=True, in_flight_updates=True)
        self.policy_version = 0
        self.drafter_version = 0
        # in-flight weight updates (specrl.rollout.protocol): called between engine steps; it may call load_weights
        self.between_steps: Callable[[], None] | None = None

    # ------------------------------------------------------------------ public
    @torch.no_grad()
    def generate(self, requests: list[RolloutRequest] | list[list[int]],
                 params: SamplingParams | list[SamplingParams], progress=None) -> GenerationResult:
        """Generate a continuation per request (`RolloutRequest`s, or plain token id lists whose request id is
        their index). Returns the outputs in request order and the call's metrics (`SpecMetrics.as_dict`)."""
        seqs = make_sequences(requests, params, self.model.args.vocab_size, self.max_seq_len)
        with self._on_device():
            return self._generate(seqs, progress)

    def _on_device(self):
        """Off CPU, a default-device context: every tensor the engine, verifier and drafters create on the hot
        path lands on the model's device (on CPU that is already the default, and the context would only cost
        a dispatch per op)."""
        return torch.device(self.device) if self.device.type != "cpu" else contextlib.nullcontext()

    def _generate(self, seqs: list[Sequence], progress) -> GenerationResult:
        metrics = SpecMetrics(self.k_max)
        t0 = time.perf_counter()
        waiting = list(seqs)
        active: list[Sequence] = []
        first = True
        while waiting or active:
            tick()  # a long generation follows the machine's load when a thread governor is active
            if self.between_steps is not None and not first:
                self.between_steps()  # a newer policy loaded here produces the next step's tokens
            first = False
            if waiting and len(active) < self.max_batch_size:
                take = waiting[: self.max_batch_size - len(active)]
                waiting = waiting[len(take):]
                self._prefill(active, take, metrics)
                active.extend(take)
                active = self._retire(active, metrics, progress)
                if not active:
                    continue
            k = self.controller.choose(len(active), context_length(active)) if self.controller else 0
            budgets = self.budget.budgets(len(active), k) if self.budget is not None and k > 0 else None
            if k > 0 and budgets is None:
                self._spec_step(active, k, metrics)
            elif k > 0 and int(budgets.max()) > 0:
                self._spec_step(active, k, metrics, budgets)
            else:
                self._ar_step(active, metrics)
                if self.budget is not None:  # every row at k_i = 0 (or a plain step): one more step without drafts
                    zero = torch.zeros(len(active), dtype=torch.long)
                    self.budget.observe(zero, zero)
            active = self._retire(active, metrics, progress)
        metrics.total_seconds = time.perf_counter() - t0
        memory = getattr(self.drafter, "memory", None)
        if memory is not None:  # what a history-keeping drafter holds after this call (its bounded window)
            mem = memory()
            metrics.history_tokens, metrics.history_entries = mem.get("tokens", 0), mem.get("index_entries", 0)
        return GenerationResult(outputs(seqs, self.policy_version), metrics.as_dict())

    def load_weights(self, which: str, named_tensors: dict[str, Tensor], version: int) -> dict[str, str]:
        """Weight sync: copy HF-named policy tensors (or the drafter's own checkpoint names) in place; returns the
        acknowledgement `weights_digest` of what this engine now holds (`specrl.rollout.digest`)."""
        check_weight_kind(which)
        if not isinstance(version, int) or version < 0:
            raise SpecRLError(f"load_weights: version must be an integer >= 0, got {version!r}")
        if which == "policy":
            load_state_into(self.model, dict(named_tensors), "load_weights(policy)")
            self.policy_version = version
            return self.weights_digest("policy")
        if self.drafter is None or not isinstance(self.drafter, torch.nn.Module):
            raise SpecRLError("load_weights(drafter): this engine has no drafter with weights (configure an "
                              "eagle:, mtp: or draft-model: drafter)")
        copy_state(self.drafter, dict(named_tensors), "load_weights(drafter)")
        self.drafter_version = version
        return self.weights_digest("drafter")

    def weights_digest(self, which: str) -> dict[str, str]:
        """`weights_digest` of the policy (HF names; a tied LM head under its own name too) or the drafter (its
        checkpoint names) as this engine holds them now."""
        check_weight_kind(which)
        if which == "policy":
            held = hf_named_tensors(self.model)
            if self.model.args.tie_word_embeddings:
                held["lm_head.weight"] = self.model.embed_tokens.weight.detach()
            return weights_digest(held)
        if self.drafter is None or not isinstance(self.drafter, torch.nn.Module):
            return {}
        return weights_digest(self.drafter.state_dict())

    # ------------------------------------------------------------------ sampling
    def _sample_rows(self, logits: Tensor, seqs: list[Sequence], positions: Tensor) -> tuple[Tensor, Tensor]:
        """Sample one token per row [n, V] at the given positions (the AR rule); return tokens, logprobs."""
        seeds, rids, temp, top_p, top_k = param_tensors(seqs)
        if bool((temp <= 0).all()):  # greedy fast path: what inverse CDF on the one-hot picks, and the raw log-prob
            tok = logits.argmax(-1)
            return tok, behaviour_logprobs(logits, logits, tok, temp)
        scaled = scaled_logits(logits, temp, top_p, top_k)
        tok = sample_inverse_cdf(probs_from_scaled(logits, scaled, temp), uniform(seeds, rids, positions,
                                                                                   STREAM_SAMPLE))
        return tok, behaviour_logprobs(logits, scaled, tok, temp)

    def _retire(self, active: list[Sequence], metrics: SpecMetrics, progress) -> list[Sequence]:
        """Drop finished sequences; survivors move (in order) to slots 0..m-1 with one gather per layer."""
        if all(s.finish_reason is None for s in active):
            return active
        order = []
        for slot, s in enumerate(active):
            if s.finish_reason is None:
                order.append(slot)
                continue
            metrics.finished += 1
            if progress is not None:
                progress.update(1)
        survivors = [active[i] for i in order]
        if survivors and order != list(range(len(order))):
            self.cache.compact(order, context_length(survivors))
            if self.drafter is not None:
                self.drafter.compact(order)
            if self.budget is not None:
                self.budget.compact(order)
        return survivors

    # ------------------------------------------------------------------ prefill
    def _prefill(self, active: list[Sequence], new: list[Sequence], metrics: SpecMetrics) -> None:
        """Batched prefill of new sequences into slots len(active).. and sample their first token."""
        t0 = time.perf_counter()
        start = len(active)
        i = 0
        while i < len(new):
            # chunk so that (sequences x longest prompt) stays bounded
            j = i + 1
            longest = len(new[i].prompt)
            while j < len(new) and max(longest, len(new[j].prompt)) * (j + 1 - i) <= self.prefill_chunk_tokens:
                longest = max(longest, len(new[j].prompt))
                j += 1
            self._prefill_chunk(start + i, new[i:j], metrics)
            i = j
        if self.budget is not None:
            self.budget.enter(start, start + len(new))
        metrics.prefill_seconds += time.perf_counter() - t0

    def _prefill_chunk(self, slot0: int, seqs: list[Sequence], metrics: SpecMetrics) -> None:
        m = len(seqs)
        lens = torch.tensor([len(s.prompt) for s in seqs])
        longest = int(lens.max())
        tokens = torch.zeros(m, longest, dtype=torch.long)
        for b, s in enumerate(seqs):
            tokens[b, : len(s.prompt)] = torch.tensor(s.prompt)
        pos = torch.arange(longest).expand(m, longest)
        layers = self.drafter.target_layers if self.drafter is not None else ()
        cache = self.cache.slots(slot0, slot0 + m)
        hidden, captured = self.model.forward_hidden(tokens, pos, cache, capture=layers, kv_len=longest)
        last = hidden[torch.arange(m), lens - 1]
        logits = self.model.logits(last)
        tok, lp = self._sample_rows(logits, seqs, lens)
        for b, s in enumerate(seqs):
            s.emit(int(tok[b]), float(lp[b]), self.policy_version)
        metrics.prompt_tokens += int(lens.sum())
        metrics.generated_tokens += m
        if self.drafter is not None:
            captured["final"] = hidden
            self.drafter.on_prefill(slot0, [s.tokens for s in seqs], captured)

    # ------------------------------------------------------------------ decode steps
    def _ar_step(self, active: list[Sequence], metrics: SpecMetrics) -> None:
        t0 = time.perf_counter()
        n = len(active)
        tokens = torch.tensor([[s.out[-1]] for s in active], dtype=torch.long)
        pos = torch.tensor([[len(s.prompt) + len(s.out) - 1] for s in active], dtype=torch.long)
        layers = self.drafter.target_layers if self.drafter is not None else ()
        batch = self._draft_batch(active) if self.drafter is not None else None
        hidden, captured = self.model.forward_hidden(tokens, pos, self.cache.slots(0, n), capture=layers,
                                                     kv_len=context_length(active))
        logits = self.model.logits(hidden[:, -1])
        tok, lp = self._sample_rows(logits, active, pos[:, 0] + 1)
        for b, s in enumerate(active):
            s.emit(int(tok[b]), float(lp[b]), self.policy_version)
        if batch is not None:  # the drafter keeps its state in step even when it did not draft
            captured["final"] = hidden
            self.drafter.on_verified(batch, None, torch.ones(n, dtype=torch.long), captured)
        dt = time.perf_counter() - t0
        metrics.record_ar(n, dt)
        if self.controller is not None:
            self.controller.observe_target(n, 1, context_length(active), dt)

    def _draft_batch(self, active: list[Sequence]) -> DraftBatch:
        seeds, rids, temp, top_p, top_k = param_tensors(active)
        positions = torch.tensor([len(s.prompt) + len(s.out) for s in active], dtype=torch.long)
        return DraftBatch(tokens=[s.tokens for s in active], positions=positions, seeds=seeds, request_ids=rids,
                          group_ids=[s.group_id for s in active], temperature=temp, top_p=top_p, top_k=top_k,
                          verify_mode=self.verify_mode)

    def _spec_step(self, active: list[Sequence], k: int, metrics: SpecMetrics, budgets: Tensor | None = None) -> None:
        """One speculative step with the step's k; `budgets` [n] (per-sequence k_i <= k, from past outcomes only:
        `specrl.rollout.spec_decode.seq_budget`): the drafter is asked for max_i k_i drafts and row i's drafts past
        k_i are
        marked as not drafted, so the verifier treats the proposal as ragged."""
        t0 = time.perf_counter()  # like _ar_step, the step's clock includes building its batch
        n = len(active)
        batch = self._draft_batch(active)
        proposal = self.drafter.propose(batch, k if budgets is None else int(budgets.max()))
        ids, nd = check_draft_ids(proposal.tokens, proposal.num_drafts, self.model.args.vocab_size)
        if budgets is not None:  # row i's drafts past k_i are padding from here on
            cap = budgets.clamp_max(ids.shape[1])
            nd = cap if nd is None else torch.minimum(nd, cap)
        if self.cut is not None:  # then each row's drafts past what its confidence pays for
            kept, feats = self.cut.cut(proposal.probs, nd, n, ids.shape[1], self.controller)
            nd = kept.to(ids.device)
        proposal = trim(proposal if ids is proposal.tokens and nd is proposal.num_drafts
                         else Proposal(ids, proposal.probs, nd, proposal.from_history))
        kv = proposal.tokens.shape[1]  # verified columns: k, or the longest real draft of a ragged proposal
        t1 = time.perf_counter()
        last = torch.tensor([[s.out[-1]] for s in active], dtype=torch.long)
        tokens = torch.cat([last, proposal.tokens], dim=1)  # [n, kv+1]
        pos0 = batch.positions  # position of the first drafted token
        pos = (pos0 - 1)[:, None] + torch.arange(kv + 1)[None, :]
        hidden, captured = self.model.forward_hidden(tokens, pos, self.cache.slots(0, n),
                                                     capture=self.drafter.target_layers,
                                                     kv_len=context_length(active) + kv)
        logits = self.model.logits(hidden)  # [n, kv+1, V]
        res, lps = self._verify_logits(logits, batch, proposal)
        emitted = torch.zeros(n, dtype=torch.long)
        toks, lpl, ne = res.tokens.tolist(), lps.tolist(), res.num_emitted.tolist()
        at = 0  # lps holds the emitted positions only, row by row
        for b, s in enumerate(active):
            for i in range(ne[b]):
                emitted[b] += 1
                if s.emit(toks[b][i], lpl[at + i], self.policy_version):
                    break
            at += ne[b]
        t2 = time.perf_counter()
        captured["final"] = hidden
        self.drafter.on_verified(batch, proposal, emitted, captured)
        t3 = time.perf_counter()
        metrics.record_spec(kv, res.num_accepted, emitted, draft_s=(t1 - t0) + (t3 - t2), verify_s=t2 - t1,
                            num_drafts=proposal.num_drafts, from_history=proposal.from_history)
        if self.cut is not None:  # predicted vs realised acceptance per position, before the table learns this step
            real = torch.full((n,), kv) if proposal.num_drafts is None else proposal.num_drafts
            metrics.record_confidence(*self.cut.observe(feats[:, :kv], real, res.num_accepted))
        self.controller.observe_draft(n, k, (t1 - t0) + (t3 - t2) - self.drafter.catch_up_seconds)
        # the controller learns what choosing k cost and yielded (a ragged proposal's trimming included)
        self.controller.observe_target(n, k + 1, context_length(active), t2 - t1, emitted=int(emitted.sum()))
        self.controller.observe_acceptance(res.num_accepted, k)
        if self.budget is not None:
            drafted = torch.full((n,), kv, dtype=torch.long) if proposal.num_drafts is None else proposal.num_drafts
            self.budget.observe(drafted, res.num_accepted)

    def _verify_logits(self, logits: Tensor, batch: DraftBatch, proposal: Proposal) -> tuple[VerifyResult, Tensor]:
        """Policy logits [n, k+1, V] of a verify forward -> the verify decision and the behaviour log-probs of the
        emitted tokens ([sum(num_emitted)], row by row). A batch of greedy requests only is verified by argmax
        (no softmax or inverse CDF); log-probs are computed at emitted positions only."""
        n, k1, v = logits.shape
        k = k1 - 1
        out_pos = batch.positions[:, None] + torch.arange(k1)[None, :]
        u = uniform(batch.seeds[:, None, None], batch.request_ids[:, None, None], out_pos[:, None, :],
                    torch.tensor([STREAM_SAMPLE, STREAM_ACCEPT, STREAM_RESIDUAL])[None, :, None])  # [n, 3, k+1]
        temp = batch.temperature[:, None].expand(n, k1)
        if bool((temp <= 0).all()):  # greedy fast path: the behaviour log-prob is the raw one
            scaled, probs, argmax = logits, None, logits.argmax(-1)
        else:
            scaled = scaled_logits(logits, temp, batch.top_p[:, None].expand(n, k1), batch.top_k[:, None].expand(n, k1))
            probs, argmax = probs_from_scaled(logits, scaled, temp), None
        res = verify(self.verify_mode, probs, proposal.tokens, proposal.probs, u[:, 0], u[:, 1, :k], u[:, 2, :k],
                     proposal.num_drafts, argmax, v)
        sel = torch.arange(k1)[None, :] < res.num_emitted[:, None]
        return res, behaviour_logprobs(logits[sel], scaled[sel], res.tokens[sel], temp[sel])

