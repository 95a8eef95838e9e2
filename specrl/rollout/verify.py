"""THE verification module: the one place that decides which drafted tokens are kept.

Every drafter only proposes tokens (and, if it samples from a full distribution, their probabilities q);
`verify` turns the policy's probabilities p over the k+1 verified positions into emitted tokens:

* `rejection`: draft x ~ q is accepted with probability min(1, p(x)/q(x)); at the first rejection a
  replacement is drawn from norm(max(0, p - q)); if all k are accepted a bonus token is drawn from p. A
  deterministic drafter passes q = one-hot(x) (`draft_probs=None`), which stays exact.
* `seed_exact`: the policy's own token at each position is drawn by inverse CDF from the position-keyed
  uniform that the autoregressive sampler uses; a draft is accepted iff it equals that token. The output is
  then token-for-token the autoregressive output for the same seed.

Greedy requests arrive with one-hot p, for which both rules reduce to "accept iff draft == argmax".
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


def verify(mode: str, target_probs: Tensor, draft_tokens: Tensor, draft_probs: Tensor | None,
           u_sample: Tensor, u_accept: Tensor, u_residual: Tensor) -> VerifyResult:
    """Decide the emitted tokens of one speculative step for n sequences.

    target_probs [n, k+1, V]: processed policy probabilities at the k+1 positions.
    draft_tokens [n, k]; draft_probs [n, k, V] or None for one-hot drafts.
    u_sample [n, k+1], u_accept [n, k], u_residual [n, k]: position-keyed uniforms.

    Shapes are checked first (a [n, k-1] draft_tokens would otherwise broadcast and emit a token never checked at
    its position). In `rejection` mode with draft_probs given, a draft x with q(x) <= 0 is an error naming the
    row: rejection sampling is exact only for drafts drawn from q, and a draft of probability 0 under q was not,
    so no rule could be exact for it (accepting, as min(1, p/0) would, emits x whenever p(x) > 0; rejecting
    leaves norm(max(0, p - q)), which also differs from p). A sampling drafter draws from the q it returns (the
    inverse-CDF sampler never lands on a zero-probability token), so this never fires on valid input.
    """
    n, k1, k = _check_shapes(target_probs, draft_tokens, draft_probs, u_sample, u_accept, u_residual)
    rows = torch.arange(n)
    if k == 0:
        tok = sample_inverse_cdf(target_probs[:, 0], u_sample[:, 0])
        return VerifyResult(tok[:, None], torch.ones(n, dtype=torch.long), torch.zeros(n, dtype=torch.long))
    p_x = target_probs[:, :k].gather(-1, draft_tokens[..., None]).squeeze(-1)  # [n, k]
    if mode == "seed_exact":
        policy_tok = sample_inverse_cdf(target_probs, u_sample)  # [n, k+1]
        ok = policy_tok[:, :k] == draft_tokens
        num_acc = _first_false(ok)
        return VerifyResult(policy_tok, num_acc + 1, num_acc)
    if mode != "rejection":
        raise ValueError(f"verify mode {mode!r} unknown; use one of {VERIFY_MODES}")
    if draft_probs is None:
        q_x = torch.ones_like(p_x)
    else:
        q_x = draft_probs.gather(-1, draft_tokens[..., None]).squeeze(-1)
        _check_drafts_have_mass(q_x, draft_tokens)
    # accept with probability min(1, p/q)  <=>  u * q < p   (q(x) > 0 since x was drawn from q)
    ok = u_accept * q_x.double() < p_x.double()
    num_acc = _first_false(ok)
    out = torch.zeros(n, k1, dtype=torch.long)
    out[:, :k] = draft_tokens
    # bonus token (all accepted): a fresh sample from p at position k
    bonus = sample_inverse_cdf(target_probs[:, k], u_sample[:, k])
    j = num_acc.clamp_max(k - 1)  # index of the rejected position (meaningful where num_acc < k)
    p_j = target_probs[rows, j]
    if draft_probs is None:
        q_j = torch.zeros_like(p_j).scatter(-1, draft_tokens[rows, j][:, None], 1.0)
    else:
        q_j = draft_probs[rows, j]
    resid = (p_j - q_j).clamp_min(0.0)
    mass = resid.sum(-1, keepdim=True)
    resid = torch.where(mass > 0, resid / mass.clamp_min(1e-30), p_j)
    replacement = sample_inverse_cdf(resid, u_residual[rows, j])
    out[rows, num_acc] = torch.where(num_acc == k, bonus, replacement)
    return VerifyResult(out, num_acc + 1, num_acc)


def _check_shapes(target_probs: Tensor, draft_tokens: Tensor, draft_probs: Tensor | None, u_sample: Tensor,
                  u_accept: Tensor, u_residual: Tensor) -> tuple[int, int, int]:
    """(n, k+1, k) from target_probs [n, k+1, V]; a clear error for any other argument of the wrong shape."""
    if target_probs.dim() != 3 or target_probs.shape[1] < 1:
        raise SpecRLError(f"verify: target_probs must have shape [n, k+1, V], got {tuple(target_probs.shape)}")
    n, k1, v = target_probs.shape
    k = k1 - 1
    expected = [("draft_tokens", draft_tokens, (n, k)), ("u_sample", u_sample, (n, k1)),
                ("u_accept", u_accept, (n, k)), ("u_residual", u_residual, (n, k))]
    if draft_probs is not None:
        expected.append(("draft_probs", draft_probs, (n, k, v)))
    for name, t, shape in expected:
        if tuple(t.shape) != shape:
            raise SpecRLError(f"verify: {name} has shape {tuple(t.shape)}, but target_probs of shape "
                              f"{tuple(target_probs.shape)} (n={n}, k={k}, V={v}) needs {shape}")
    if draft_tokens.dtype != torch.long:
        raise SpecRLError(f"verify: draft_tokens must be int64 token ids, got dtype {draft_tokens.dtype}")
    return n, k1, k


def _check_drafts_have_mass(q_x: Tensor, draft_tokens: Tensor) -> None:
    bad = q_x <= 0
    if bool(bad.any()):
        b, i = (int(j) for j in bad.nonzero()[0])
        raise SpecRLError(
            f"drafter bug: row {b} proposed token {int(draft_tokens[b, i])} at draft position {i} with draft "
            f"probability q(x) = {float(q_x[b, i])}, so it was not drawn from q and no verification rule can keep "
            f"the output exact ({int(bad.sum())} such drafts in this step); a sampling drafter must draw each "
            f"draft from the probabilities it returns (deterministic drafters return probs=None)")


def _first_false(ok: Tensor) -> Tensor:
    """Number of leading True values per row."""
    return ok.long().cumprod(dim=-1).sum(dim=-1)
