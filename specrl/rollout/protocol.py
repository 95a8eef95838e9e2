"""THE rollout backend protocol: what a trainer may ask of any engine that generates rollouts.

The native engine (`specrl.rollout.engine.RolloutEngine`) implements it, and so can a vLLM or remote backend
without importing the native engine. A trainer reaches a backend only through these names:

* `generate(requests, params) -> GenerationResult` — one `RolloutOutput` per request (token ids, behaviour
  log-probs, finish reason, the policy version that produced it) plus the call's speculative metrics. There is
  no side channel: everything a caller learns about a call is in its result.
* `load_weights(which, named_tensors, version)` — `which` is "policy" or "drafter"; names are HF checkpoint
  names (`model.layers.0.self_attn.q_proj.weight`, ...; a drafter's are the names in its own checkpoint file).
  Each backend maps them to its internal names. `version` tags every output generated afterwards. It returns
  the acknowledgement: `specrl.rollout.digest.weights_digest` of the tensors it holds after the load, under the
  names it was sent (after its renaming, casts and fused layouts); the publisher checks it (`check_refit`).
* `capabilities` — a `BackendCapabilities`: verify modes (seed_exact is native-only), drafter kinds, the
  largest k, whether per-request seeds reproduce exactly. `BackendCapabilities.require` turns a request for
  something undeclared into a config error naming both what was asked and what the backend offers.

* `between_steps` (optional, a backend whose capabilities declare `in_flight_updates`) — a callable the caller
  may set; the backend calls it between engine steps of a `generate` call, and it may call `load_weights`
  there. Tokens emitted afterwards carry the new version (`RolloutOutput.token_versions`); an output's
  `policy_version` is the oldest version among its tokens.

Behaviour log-probs are defined once, here: the log-probability of the emitted token under the distribution
it was actually sampled from, i.e. after temperature, top-k and top-p (for a greedy request, where nothing was
sampled, the unprocessed log-prob; see `specrl.rollout.sampling.behaviour_logprobs`). The GRPO loss uses the
trainer's own recomputation under temperature only (the policy pi_theta); the behaviour log-probs feed the
optional truncated importance-sampling correction and the `token_mult_prob_error` diagnostic.
"""

from __future__ import annotations

import math
import operator
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Literal, Protocol, runtime_checkable

import torch
from torch import Tensor

from specrl.errors import SpecRLError
from specrl.rollout.drafter_spec import parse_drafter_spec
from specrl.rollout.sampling import SamplingParams

WEIGHT_KINDS = ("policy", "drafter")


@dataclass(frozen=True)
class RolloutRequest:
    """One sequence to generate. Samples of one prompt share a `group_id` (suffix drafters read siblings)."""

    prompt_token_ids: list[int]
    request_id: int
    group_id: int | None = None  # None: one group per distinct prompt (across calls: its history too)


@dataclass
class RolloutOutput:
    token_ids: list[int]
    logprobs: list[float]  # behaviour log-probs of token_ids (see the module docstring)
    finish_reason: str  # "stop" | "length"
    prompt_index: int = 0
    policy_version: int = 0  # the oldest version among the tokens (what a lag bound checks)
    token_versions: list[int] | None = None  # per token: the policy version whose forward produced it


@dataclass
class GenerationResult(Sequence):
    """The outputs of one `generate` call in request order (indexable like a list) and the call's metrics."""

    outputs: list[RolloutOutput]
    metrics: dict = field(default_factory=dict)

    def __len__(self) -> int:
        return len(self.outputs)

    def __getitem__(self, i):  # type: ignore[override]
        return self.outputs[i]

    def __iter__(self) -> Iterator[RolloutOutput]:
        return iter(self.outputs)

    @property
    def policy_versions(self) -> list[int]:
        return [o.policy_version for o in self.outputs]


@dataclass(frozen=True)
class BackendCapabilities:
    name: str
    verify_modes: tuple[str, ...]
    drafter_kinds: tuple[str, ...]  # "none" included when plain decoding is offered (see drafter_spec.kinds_offered)
    max_k: int
    exact_seeds: bool  # the same (seed, request id) reproduces the same tokens, whatever the batch
    in_flight_updates: bool = False  # `between_steps` is honoured: weights may change inside a generate call

    def require(self, verify: str | None = None, drafter: str | None = None, k: int | str | None = None,
                exact_seeds: bool = False, in_flight_updates: bool = False, where: str = "config") -> None:
        """Raise a SpecRLError naming the unmet request and this backend's offer."""
        if verify is not None and verify not in self.verify_modes:
            raise SpecRLError(f"{where}: verify={verify!r} is not offered by the {self.name} backend (it offers "
                              f"{list(self.verify_modes)}); choose one of those or another rollout backend")
        kind = None if drafter is None else parse_drafter_spec(drafter).kind
        if kind is not None and kind not in self.drafter_kinds:
            raise SpecRLError(f"{where}: drafter {drafter!r} is not offered by the {self.name} backend (it offers "
                              f"{list(self.drafter_kinds)}); choose one of those or another rollout backend")
        if isinstance(k, int) and k > self.max_k:
            raise SpecRLError(f"{where}: num_draft_tokens={k} exceeds the {self.name} backend's maximum k "
                              f"({self.max_k})")
        if exact_seeds and not self.exact_seeds:
            raise SpecRLError(f"{where}: per-request seeds are not exact on the {self.name} backend")
        if in_flight_updates and not self.in_flight_updates:
            raise SpecRLError(f"{where}: pipeline.in_flight_updates=true needs weight updates between engine steps, "
                              f"which the {self.name} backend does not offer; set pipeline.in_flight_updates=false "
                              "or rollout.backend=native")


@runtime_checkable
class RolloutBackend(Protocol):
    capabilities: BackendCapabilities

    @property
    def policy_version(self) -> int:
        """The version of the policy weights the next `generate` uses."""

    def generate(self, requests: Sequence[RolloutRequest | Sequence[int]],
                 params: SamplingParams | Sequence[SamplingParams]) -> GenerationResult:
        """Generate one continuation per request; plain token lists get request id = their index."""

    def load_weights(self, which: Literal["policy", "drafter"], named_tensors: Mapping[str, Tensor],
                     version: int) -> dict[str, str]:
        """Replace the policy's or the drafter's weights (HF checkpoint names) and tag them with `version`; return
        `weights_digest` of what the backend now holds under the sent names."""


def token_id_list(ids, where: str) -> list[int]:
    """`ids` as a list of Python ints; a SpecRLError for a scalar, a string, floats or bools (never truncated)."""
    if isinstance(ids, str | bytes) or not hasattr(ids, "__iter__"):
        raise SpecRLError(f"{where}: token ids must be a list of integers, got {type(ids).__name__} {ids!r:.60}")
    if isinstance(ids, Tensor):
        if ids.is_floating_point() or ids.dtype == torch.bool or ids.dim() != 1:
            raise SpecRLError(f"{where}: token ids must be a 1-D integer tensor, got {ids.dtype} of shape "
                              f"{tuple(ids.shape)}")
        return [int(t) for t in ids.tolist()]
    out = []
    for j, t in enumerate(ids):
        if isinstance(t, bool):
            raise SpecRLError(f"{where}: token id #{j} is {t!r}; token ids must be integers")
        try:
            out.append(operator.index(t))
        except TypeError:
            raise SpecRLError(f"{where}: token id #{j} is {t!r} ({type(t).__name__}); token ids must be integers "
                              "(a float such as 5.0 is not accepted, so nothing is silently truncated)") from None
    return out


def normalize_requests(requests, params, vocab_size: int, max_len: int, limit: str, raise_hint: str
                       ) -> tuple[list[RolloutRequest], list[SamplingParams]]:
    """The checks every backend's `generate` makes: a non-empty request list (plain token lists get request id =
    their index), one SamplingParams or one per request with finite temperature/top_p, integer token ids (never
    truncated) inside the vocabulary, and prompt + max_new_tokens within `max_len` (named `limit`; `raise_hint`
    says which setting to raise)."""
    if not isinstance(requests, (list, tuple)) or not requests:
        raise SpecRLError("requests must be a non-empty list of RolloutRequest or token id lists")
    n = len(requests)
    if isinstance(params, SamplingParams):
        plist = [params] * n
    else:
        plist = list(params)
        if len(plist) != n or not all(isinstance(p, SamplingParams) for p in plist):
            raise SpecRLError(f"params must be one SamplingParams or a list of {n} (one per request), "
                              f"got {len(plist)} items")
    for i, sp in enumerate(plist):
        for name in ("temperature", "top_p"):
            v = getattr(sp, name)
            if not math.isfinite(v):
                raise SpecRLError(f"request {i}: {name}={v!r} is not a finite number; use e.g. temperature=1.0 "
                                  "(0 = greedy) and top_p in (0, 1]")
    reqs = []
    for i, r in enumerate(requests):
        ids, rid, gid = (r.prompt_token_ids, r.request_id, r.group_id) if isinstance(r, RolloutRequest) else \
            (r, i, None)
        pr = token_id_list(ids, f"prompt {i}")
        sp = plist[i]
        if not pr:
            raise SpecRLError(f"prompt {i} is empty; every prompt needs at least one token")
        if min(pr) < 0 or max(pr) >= vocab_size:
            raise SpecRLError(f"prompt {i} has token ids outside [0, {vocab_size}) (the model's vocabulary)")
        if len(pr) + sp.max_new_tokens > max_len:
            raise SpecRLError(
                f"prompt {i} has {len(pr)} tokens; with max_new_tokens={sp.max_new_tokens} it needs "
                f"{len(pr) + sp.max_new_tokens} positions but {limit} is {max_len}: shorten the prompt to <= "
                f"{max_len - sp.max_new_tokens} tokens, lower max_new_tokens or {raise_hint}")
        reqs.append(RolloutRequest(pr, rid, gid))
    return reqs, plist


def check_weight_kind(which: str) -> None:
    if which not in WEIGHT_KINDS:
        raise SpecRLError(f"load_weights: which={which!r}; use one of {list(WEIGHT_KINDS)}")
