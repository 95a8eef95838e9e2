"""Usable weights: the check that runs before every checkpoint.

`NonFiniteError` (the policy) and `DrafterNonFiniteError` (the online drafter), defined in `specrl.errors` and
re-exported here, name what became NaN/inf in a step; the update that produced it was not applied.
`check_weights` refuses weights that could not train on: a NaN/inf scan of the policy and drafter tensors, then
a 16-token probe forward + backward of the policy that must stay finite (weights blown up by a far too high
learning rate are finite, yet overflow the next forward). The learner runs it before every checkpoint, in the
sync trainer and in the async learner actor alike.
"""

from __future__ import annotations

from typing import Any

import torch

from specrl.errors import DrafterNonFiniteError, NonFiniteError

__all__ = ["DrafterNonFiniteError", "NonFiniteError", "check_weights", "probe_tokens"]


def _nonfinite(state: dict[str, Any]) -> tuple[str, int, int] | None:
    """(name, non-finite count, numel) of the first floating tensor holding NaN/inf, else None."""
    for name, t in state.items():
        if isinstance(t, torch.Tensor) and t.is_floating_point() and t.numel():
            if bool(torch.isfinite(t.amax()) & torch.isfinite(t.amin())):  # NaN propagates, +-inf shows
                continue
            bad = int((~torch.isfinite(t)).sum())
            if bad:
                return name, bad, t.numel()
    return None


PROBE_TOKENS = 16


def probe_tokens(vocab: int, device: torch.device) -> torch.Tensor:
    """The weight probe's [1, 16] token ids (spread over the vocabulary), on the policy's device."""
    return (torch.arange(PROBE_TOKENS, device=device) * 7919 % vocab).unsqueeze(0)


def check_weights(parts: dict[str, Any], policy: torch.nn.Module | None, step: int) -> None:
    """Refuse to checkpoint weights that are not usable: NaN/inf in the policy or drafter, or a policy whose
    forward pass gives non-finite logits (weights blown up to ~1e10 by a huge learning rate are finite, yet
    the next step's forward overflows). Raises NonFiniteError naming the part, so no checkpoint holds them."""
    for part, err in (("policy", NonFiniteError), ("drafter", DrafterNonFiniteError)):
        state = parts.get(part)
        hit = _nonfinite(state) if isinstance(state, dict) else None
        if hit:
            name, bad, n = hit
            raise err(f"step {step}: after the update, the {part}'s tensor {name!r} holds {bad} NaN/inf values "
                      f"(of {n}); the step-{step} checkpoint was not written")
    if policy is not None and hasattr(policy, "forward_hidden") and hasattr(policy, "logits"):
        # A probe forward + backward on 16 tokens: the next step must be able to train from these weights.
        vocab = policy.args.vocab_size
        toks = probe_tokens(vocab, next(policy.parameters()).device)
        params = [p for p in policy.parameters() if p.requires_grad]
        with torch.enable_grad():
            logits = policy.logits(policy.forward_hidden(toks)[0][:, :-1])
            what = "logits in a forward pass"
            ok = bool(torch.isfinite(logits).all())
            if ok and params:
                lp = torch.log_softmax(logits.float(), -1).gather(-1, toks[:, 1:, None]).sum()
                grads = [g for g in torch.autograd.grad(lp, params, allow_unused=True) if g is not None]
                what = "gradients"
                ok = bool(torch.isfinite(torch.linalg.vector_norm(
                    torch.stack([torch.linalg.vector_norm(g.float()) for g in grads])))) if grads else True
        if not ok:
            raise NonFiniteError(f"step {step}: after the update the policy gives non-finite {what} (largest "
                                 f"weight magnitude {_max_abs(policy):.3g}: the update blew the weights up, e.g. "
                                 f"a learning rate far too high); the step-{step} checkpoint was not written")


def _max_abs(m: torch.nn.Module) -> float:
    return max(float(p.detach().abs().max()) for p in m.parameters())
