"""Refit acknowledgement: a cheap digest of named tensors, and the check of a backend's word against what was sent.

`weights_digest(named_tensors)` maps each name to `"<dtype>[<shape>]:<hash>"`, the hash a 64-bit blake2b of the
tensor's dtype, shape and the raw bytes of a fixed strided sample of at most `SAMPLE` elements (the first and the
last included): cheap enough for every refit of every step, and blind only to a change confined to unsampled
elements. Every backend's `load_weights` returns this digest computed from the tensors it holds after the load
(after its renaming, dtype casts and fused layouts, under the names it was sent). `check_refit` recomputes the
digest of what was sent, cast to the dtype the backend reports for each tensor, and raises `RefitError` naming the
backend and every tensor the backend does not hold as sent (missing, other values, other shape). A weight the
backend holds only inside a packed kernel (vLLM's CPU linears) is acknowledged by reading columns of it back
through that kernel (`columns_digest`, prefix `READBACK`), and a tied LM head's packed copy of the embedding under
`NAME#lm_head`; only what can be neither read nor probed is `OPAQUE`. So a refit that
was dropped, partial, loaded under the wrong name or reported for a version it does not hold stops the step
before a single rollout is generated with the wrong weights.
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping

import torch
from torch import Tensor

from specrl.errors import SpecRLError

SAMPLE = 64  # elements hashed per tensor
# An acknowledgement's value for a tensor the backend holds in a layout it can neither read back nor probe: its
# presence is acknowledged, its values are not compared.
OPAQUE = "opaque"
# A prefix for a weight read back through the kernel that holds it (vLLM's prepacked CPU linears and tied LM head):
# the layer applied to one-hot inputs returns the weight's columns `probe_columns(in_features)` exactly (one
# product per output, no rounding), and the digest is of those columns, [len(cols), out].
READBACK = "cols:"
HEAD_SUFFIX = "#lm_head"  # an extra acknowledgement: the tied LM head's own (packed) copy of the embedding


class RefitError(SpecRLError):
    """A backend's acknowledgement of a weight load does not match the tensors it was sent."""


def _sample(t: Tensor) -> Tensor:
    flat = t.detach().reshape(-1)
    n = flat.numel()
    if n <= SAMPLE:
        return flat.cpu()
    idx = torch.arange(SAMPLE, dtype=torch.long) * (n - 1) // (SAMPLE - 1)
    return flat[idx.to(flat.device)].cpu()


def _hash(dtype: torch.dtype, shape: tuple[int, ...], sample: Tensor) -> str:
    name = str(dtype).removeprefix("torch.")
    h = hashlib.blake2b(digest_size=8)
    h.update(f"{name}{list(shape)}".encode())
    h.update(sample.to(dtype).contiguous().view(torch.uint8).numpy().tobytes())
    return f"{name}{list(shape)}:{h.hexdigest()}"


def tensor_digest(t: Tensor, dtype: torch.dtype | None = None) -> str:
    """`"<dtype>[<shape>]:<hash>"` of `t`, or of `t` cast to `dtype` (only the sample is cast)."""
    return _hash(dtype or t.dtype, tuple(t.shape), _sample(t))


def probe_columns(in_features: int) -> list[int]:
    """The input columns a readback probes: the first, the last and two between."""
    return sorted({0, in_features // 3, (2 * in_features) // 3, in_features - 1})


def columns_digest(t: Tensor, dtype: torch.dtype | None = None) -> str:
    """`READBACK` + the digest of weight `t` [out, in]'s probed columns, transposed to [len(cols), out]."""
    return READBACK + tensor_digest(t.detach()[:, probe_columns(t.shape[1])].t().contiguous(), dtype)


def weights_digest(named_tensors: Mapping[str, Tensor]) -> dict[str, str]:
    """{name: tensor_digest} of every tensor (the acknowledgement a backend's `load_weights` returns)."""
    return {name: tensor_digest(t) for name, t in named_tensors.items()}


def _dtype_of(digest: str) -> torch.dtype | None:
    dt = getattr(torch, digest.partition("[")[0], None)
    return dt if isinstance(dt, torch.dtype) else None


def check_refit(sent: Mapping[str, Tensor], ack: Mapping[str, str] | None, which: str, backend: str,
                version: int) -> None:
    """Raise RefitError unless `ack` (a backend's `load_weights` result) holds every sent tensor as sent.

    Each sent tensor is digested in the dtype the backend reports for it (a cast is part of loading); names the
    backend holds beyond those sent (buffers, tensors shared with the target) are not compared."""
    if ack is None:
        raise RefitError(f"load_weights({which}, version {version}) on the {backend} backend returned no "
                         "acknowledgement; a backend must return weights_digest() of the tensors it holds after "
                         "the load")
    missing, differ = [], []
    extra = [(n, n.removesuffix(HEAD_SUFFIX)) for n in ack if n.endswith(HEAD_SUFFIX)]
    for name, base in [(n, n) for n in sent] + [(n, b) for n, b in extra if b in sent]:
        t, got = sent[base], ack.get(name)
        if got is None:
            missing.append(name)
            continue
        if got == OPAQUE:
            continue
        if got.startswith(READBACK):
            want = columns_digest(t, _dtype_of(got.removeprefix(READBACK))) if t.dim() == 2 else "a 2-D weight"
        else:
            want = tensor_digest(t, _dtype_of(got))
        if want != got:
            differ.append(f"{name} (holds {got}, sent {want})")
    if missing or differ:
        parts = []
        if differ:
            parts.append(f"{len(differ)} tensor(s) hold other values than were sent: {'; '.join(differ[:4])}"
                         f"{' ...' if len(differ) > 4 else ''}")
        if missing:
            parts.append(f"{len(missing)} sent tensor(s) are not held at all: {missing[:6]}"
                         f"{' ...' if len(missing) > 6 else ''}")
        raise RefitError(
            f"weight refit not acknowledged: after load_weights({which}, version {version}) the {backend} backend "
            f"does not hold what was sent ({'; '.join(parts)}). Its load was dropped, partial or went to other "
            "names, so no rollout is generated with these weights; the backend must load every sent tensor under "
            "its name")
