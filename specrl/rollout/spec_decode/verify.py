"""THE verification module: the one place that decides which drafted tokens are kept.

Every drafter only proposes tokens (and, if it samples from a full distribution, their probabilities q);
`verify` turns the policy's probabilities p over the k+1 verified positions into emitted tokens:

* `rejection`: draft x ~ q is accepted with probability min(1, p(x)/q(x)); at the first rejection a
  replacement is drawn from norm(max(0, p - q)); if all k are accepted a bonus token is drawn from p. A
  deterministic drafter passes q = one-hot(x) (`draft_probs=None`), which stays exact.
* `seed_exact`: the policy's own token at each position is drawn by inverse CDF from the position-keyed
  uniform that the autoregressive sampler uses; a draft is accepted iff it equals that token. The output is
  then token-for-token the autoregressive output for the same seed.

Greedy requests arrive with one-hot p, for which both rules reduce to "accept iff draft == argmax"; a batch of
greedy requests only takes that path directly (`target_argmax`, no vocabulary-wide work). Ragged proposals
(`num_drafts`) verify row b as a step with its own k = num_drafts[b]. Each row pays one inverse-CDF draw per
emitted policy token, never one per verified position.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from specrl.errors import SpecRLError
from specrl.rollout.sampling import sample_inverse_cdf

VERIFY_MODES = ("rejection", "seed_exact")


@dataclass
class VerifyResult:
    tokens: Tensor  # [n, k+1] emitted tokens; only the first num_emitted[b] of row b are meaningful
    num_emitted: Tensor  # [n] in 1..k+1  (= accepted drafts + 1)
    num_accepted: Tensor  # [n] in 0..k


def verify(mode: str, target_probs: Tensor | None, draft_tokens: Tensor, draft_probs: Tensor | None,
           u_sample: Tensor, u_accept: Tensor, u_residual: Tensor, num_drafts: Tensor | None = None,
           target_argmax: Tensor | None = None, vocab_size: int | None = None) -> VerifyResult:
    """Decide the emitted tokens of one speculative step for n sequences.

    target_probs [n, k+1, V]: processed policy probabilities at the k+1 positions.
    draft_tokens [n, k]; draft_probs [n, k, V] or None for one-hot drafts.
    u_sample [n, k+1], u_accept [n, k], u_residual [n, k]: position-keyed uniforms.
    num_drafts [n] (optional, 0..k): row b's real drafts are its first num_drafts[b] columns; the rest is
    padding, never accepted (row b is verified as a k = num_drafts[b] step: after its last real draft comes the
    bonus from p at that position). None: every column is a real draft.
    target_argmax [n, k+1] (optional, with target_probs=None): the greedy fast path for batches whose every row is
    greedy (T = 0, p one-hot at the argmax): a draft is accepted iff it equals the argmax, in both modes (what the
    general rules give for one-hot p), with no vocabulary-wide work.

    vocab_size (optional): V for the greedy fast path without draft_probs, where no tensor carries it.

    Inputs are checked first, the same way in both modes (`_check_inputs`): shapes (a [n, k-1] draft_tokens would
    otherwise broadcast and emit a token never checked at its position); token ids and counts of any integer dtype
    (int32, int16, uint8, ...) are taken as int64, float or bool ones are an error; a real draft id outside
    0..V-1 is an error naming the row (padding columns may hold any id: one outside 0..V-1 is read as token 0;
    padding is never accepted nor emitted).

    In `rejection` mode with draft_probs given, a draft x with q(x) <= 0 is an error naming the row: rejection
    sampling is exact only for drafts drawn from q, and a draft of probability 0 under q was not, so no rule could
    be exact for it (accepting, as min(1, p/0) would, emits x whenever p(x) > 0; rejecting leaves norm(max(0, p -
    q)), which also differs from p). A sampling drafter draws from the q it returns (the inverse-CDF sampler never
    lands on a zero-probability token), so this never fires on valid input. The check runs on every rejection path
    with draft_probs (the greedy fast path and k = 0 too); padding columns are exempt, as they were not drawn from q
    and are never accepted.

    Work per row is one inverse-CDF draw per emitted policy token: seed_exact samples position i only for rows
    whose drafts 0..i-1 were all accepted, and rejection draws either the bonus or the replacement, not both. A
    row's draw is computed exactly as `sample_inverse_cdf` computes it in a batch (row by row), so the tokens are
    bit-identical to drawing at every position.
    """
    if mode not in VERIFY_MODES:
        raise SpecRLError(f"verify mode {mode!r} unknown; use one of {VERIFY_MODES}")
    n, k1, k, draft_tokens, num_drafts, target_argmax = _check_inputs(
        target_probs, draft_tokens, draft_probs, u_sample, u_accept, u_residual, num_drafts, target_argmax,
        vocab_size)
    rows = torch.arange(n)
    if mode == "rejection" and draft_probs is not None and k > 0:
        q_x = draft_probs.gather(-1, draft_tokens[..., None]).squeeze(-1)
        _check_drafts_have_mass(q_x if num_drafts is None else q_x.masked_fill(~_real(num_drafts, k), 1.0),
                                draft_tokens)
    if target_probs is None:  # greedy fast path: p is one-hot at target_argmax
        num_acc = _num_accepted(target_argmax[:, :k] == draft_tokens, num_drafts)
        return VerifyResult(target_argmax, num_acc + 1, num_acc)
    if k == 0:
        tok = sample_inverse_cdf(target_probs[:, 0], u_sample[:, 0])
        return VerifyResult(tok[:, None], torch.ones(n, dtype=torch.long), torch.zeros(n, dtype=torch.long))
    if mode == "seed_exact":
        return _seed_exact(target_probs, draft_tokens, u_sample, num_drafts)
    p_x = target_probs[:, :k].gather(-1, draft_tokens[..., None]).squeeze(-1)  # [n, k]
    if draft_probs is None:
        q_x = torch.ones_like(p_x)
    # accept with probability min(1, p/q)  <=>  u * q < p   (q(x) > 0 since x was drawn from q)
    ok = u_accept * q_x.double() < p_x.double()
    num_acc = _num_accepted(ok, num_drafts)
    full = num_acc == (k if num_drafts is None else num_drafts)  # all real drafts accepted: a bonus token
    out = torch.zeros(n, k1, dtype=torch.long)
    out[:, :k] = draft_tokens
    j = num_acc.clamp_max(k - 1)  # index of the rejected position (meaningful where not full)
    p_j = target_probs[rows, j]
    if draft_probs is None:
        q_j = torch.zeros_like(p_j).scatter(-1, draft_tokens[rows, j][:, None], 1.0)
    else:
        q_j = draft_probs[rows, j]
    resid = (p_j - q_j).clamp_min(0.0)
    mass = resid.sum(-1, keepdim=True)
    resid = torch.where(mass > 0, resid / mass.clamp_min(1e-30), p_j)
    # one draw per row: the bonus from p at position num_acc, or the replacement from the residual at j
    bonus_p, bonus_u = target_probs[rows, num_acc], u_sample[rows, num_acc]
    dist = torch.where(full[:, None], bonus_p, resid)
    out[rows, num_acc] = sample_inverse_cdf(dist, torch.where(full, bonus_u, u_residual[rows, j]))
    return VerifyResult(out, num_acc + 1, num_acc)


def _seed_exact(target_probs: Tensor, draft_tokens: Tensor, u_sample: Tensor, num_drafts: Tensor | None
                ) -> VerifyResult:
    """The policy's inverse-CDF token at each position, drawn only where every draft before it was accepted."""
    n, k1, _ = target_probs.shape
    k = k1 - 1
    nd = torch.full((n,), k, dtype=torch.long) if num_drafts is None else num_drafts
    out = torch.zeros(n, k1, dtype=torch.long)
    live = torch.arange(n)  # rows whose drafts before position i were all accepted
    for i in range(k1):
        tok = sample_inverse_cdf(target_probs[live, i], u_sample[live, i])
        out[live, i] = tok
        if i == k:
            break
        live = live[(tok == draft_tokens[live, i]) & (nd[live] > i)]
        if live.numel() == 0:
            break
    num_acc = _num_accepted(out[:, :k] == draft_tokens, num_drafts)
    return VerifyResult(out, num_acc + 1, num_acc)


def _as_ids(name: str, t: Tensor) -> Tensor:
    """`t` as int64 if it holds integers of any width; a clear error for float, bool or complex tensors."""
    if not isinstance(t, Tensor):
        raise SpecRLError(f"verify: {name} must be a tensor of integer token ids, got {type(t).__name__}")
    if t.dtype == torch.long:
        return t
    if t.dtype == torch.bool or t.dtype.is_floating_point or t.dtype.is_complex:
        raise SpecRLError(f"verify: {name} must hold integer token ids (any integer dtype: int64, int32, ...), got "
                          f"dtype {t.dtype}")
    return t.long()


def check_draft_ids(draft_tokens: Tensor, num_drafts: Tensor | None, vocab_size: int | None
                    ) -> tuple[Tensor, Tensor | None]:
    """The draft checks of both verify modes (the engine runs them before its verify forward too): draft_tokens
    [n, k] and num_drafts [n] of any integer dtype as int64; num_drafts in 0..k; every real draft id in 0..V-1
    (only >= 0 where V is unknown); padding columns holding ids outside it set to token 0. A SpecRLError naming
    the row otherwise."""
    draft_tokens = _as_ids("draft_tokens", draft_tokens)
    if draft_tokens.dim() != 2:
        raise SpecRLError(f"verify: draft_tokens must have shape [n, k], got {tuple(draft_tokens.shape)}")
    k = draft_tokens.shape[1]
    real = None
    if num_drafts is not None:
        num_drafts = _as_ids("num_drafts", num_drafts)
        if bool(((num_drafts < 0) | (num_drafts > k)).any()):
            raise SpecRLError(f"verify: num_drafts must be integer counts in 0..{k}, got {num_drafts.tolist()}")
        real = _real(num_drafts, k)
    if k == 0:
        return draft_tokens, num_drafts
    outside = (draft_tokens < 0) if vocab_size is None else (draft_tokens < 0) | (draft_tokens >= vocab_size)
    bad = outside if real is None else outside & real
    if bool(bad.any()):
        b, i = (int(j) for j in bad.nonzero()[0])
        within = "0 or more" if vocab_size is None else f"in 0..{vocab_size - 1} (V={vocab_size})"
        raise SpecRLError(f"verify: row {b} drafted token id {int(draft_tokens[b, i])} at draft position {i}, but "
                          f"token ids must be {within} ({int(bad.sum())} such drafts in this step); the drafter's "
                          "vocabulary or id mapping does not match the policy's")
    if real is not None and bool(outside.any()):
        draft_tokens = draft_tokens.masked_fill(~real, 0)  # padding: never accepted, read as token 0
    return draft_tokens, num_drafts


def _check_inputs(target_probs: Tensor | None, draft_tokens: Tensor, draft_probs: Tensor | None, u_sample: Tensor,
                  u_accept: Tensor, u_residual: Tensor, num_drafts: Tensor | None = None,
                  target_argmax: Tensor | None = None, vocab_size: int | None = None
                  ) -> tuple[int, int, int, Tensor, Tensor | None, Tensor | None]:
    """(n, k+1, k, draft_tokens, num_drafts, target_argmax) for both verify modes: shapes checked against
    target_probs [n, k+1, V] (or target_argmax [n, k+1]); id and count tensors of any integer dtype returned as
    int64; real draft ids (and target_argmax) checked to lie in 0..V-1 where V is known (`check_draft_ids`). A
    clear error naming the argument for anything else."""
    if (target_probs is None) == (target_argmax is None):
        raise SpecRLError("verify: give exactly one of target_probs and target_argmax (the greedy fast path)")
    draft_tokens = _as_ids("draft_tokens", draft_tokens)
    num_drafts = None if num_drafts is None else _as_ids("num_drafts", num_drafts)
    if target_probs is None:
        target_argmax = _as_ids("target_argmax", target_argmax)
        if target_argmax.dim() != 2 or target_argmax.shape[1] < 1:
            raise SpecRLError(f"verify: target_argmax must be token ids of shape [n, k+1], got "
                              f"{tuple(target_argmax.shape)}")
        (n, k1), v = target_argmax.shape, draft_probs.shape[-1] if draft_probs is not None else vocab_size
        target = f"target_argmax of shape {tuple(target_argmax.shape)}"
    else:
        if target_probs.dim() != 3 or target_probs.shape[1] < 1:
            raise SpecRLError(f"verify: target_probs must have shape [n, k+1, V], got {tuple(target_probs.shape)}")
        n, k1, v = target_probs.shape
        target = f"target_probs of shape {tuple(target_probs.shape)}"
    k = k1 - 1
    expected = [("draft_tokens", draft_tokens, (n, k)), ("u_sample", u_sample, (n, k1)),
                ("u_accept", u_accept, (n, k)), ("u_residual", u_residual, (n, k))]
    if draft_probs is not None:
        expected.append(("draft_probs", draft_probs, (n, k, v)))
    if num_drafts is not None:
        expected.append(("num_drafts", num_drafts, (n,)))
    for name, t, shape in expected:
        if tuple(t.shape) != shape:
            raise SpecRLError(f"verify: {name} has shape {tuple(t.shape)}, but {target} "
                              f"(n={n}, k={k}, V={v}) needs {shape}")
    if vocab_size is not None and v is not None and vocab_size != v:
        raise SpecRLError(f"verify: vocab_size={vocab_size} but {target} (or draft_probs) has V={v}")
    draft_tokens, num_drafts = check_draft_ids(draft_tokens, num_drafts, v)
    if target_argmax is not None and v is not None and bool(((target_argmax < 0) | (target_argmax >= v)).any()):
        raise SpecRLError(f"verify: target_argmax holds token ids outside 0..{v - 1} (V={v})")
    return n, k1, k, draft_tokens, num_drafts, target_argmax


def _check_drafts_have_mass(q_x: Tensor, draft_tokens: Tensor) -> None:
    bad = q_x <= 0
    if bool(bad.any()):
        b, i = (int(j) for j in bad.nonzero()[0])
        raise SpecRLError(
            f"drafter bug: row {b} proposed token {int(draft_tokens[b, i])} at draft position {i} with draft "
            f"probability q(x) = {float(q_x[b, i])}, so it was not drawn from q and no verification rule can keep "
            f"the output exact ({int(bad.sum())} such drafts in this step); a sampling drafter must draw each "
            f"draft from the probabilities it returns (deterministic drafters return probs=None)")


def _real(num_drafts: Tensor, k: int) -> Tensor:
    """[n, k] mask of the real (not padding) draft columns."""
    return torch.arange(k)[None, :] < num_drafts[:, None]


def _num_accepted(ok: Tensor, num_drafts: Tensor | None) -> Tensor:
    """Number of leading accepted real drafts per row (padding columns count as rejections)."""
    if num_drafts is not None:
        ok = ok & _real(num_drafts, ok.shape[1])
    return ok.long().cumprod(dim=-1).sum(dim=-1)
