"""Log-probabilities of chosen tokens through the LM head, in row chunks, without a whole batch's [N, V] logits.

A response-token batch of N rows over a vocabulary of V makes [N, V] float32 logits, and the plain autograd path
keeps several such arrays at once (the logits, their scaled copy, the softmax's temporaries, the gradient): at
N = 4096 (8 sequences of 512 tokens) and V = 49,152 each one is 805 MB, and the train stage's peak grows by gigabytes.
`head_logprobs` computes log p(target) = logits[target]/T − logsumexp(logits/T) chunk by chunk, keeping only the
per-row log-normaliser, and its backward recomputes each chunk's logits (one more LM-head product) to form
∂/∂logits = g·(onehot − softmax)/T, so the peak holds one chunk's [rows, V] arrays. At or below `max_rows` rows it
runs the plain ops (the same numbers as `token_logprobs` on `model.logits`), so short-answer batches pay no
recomputation. The matrix products run in the ambient autocast dtype (bf16-mixed), forward and backward alike, as
autograd's own linear would. With `top` > 0 it also returns, per row, the top `top` probabilities and token ids and
the argmax (what the online drafter distils), computed per chunk, so no caller keeps [N, V] logits for them.
With the sampler's top-p / top-k (`top_p < 1`, `top_k > 0`) the normaliser runs over the kept set
(`grpo.sampler_support`), recomputed per chunk in the backward from the same logits.
"""

from __future__ import annotations

import torch
from torch import Tensor

from specrl.algorithms.grpo import filtered, sampler_support, token_logprobs
from specrl.errors import SpecRLError

CHUNK_BYTES = 128 << 20  # float32 logits per chunk: 682 rows at V = 49,152, 220 rows at Qwen's 151,936


def chunk_rows(vocab_size: int, chunk_bytes: int | None = None) -> int:
    """Rows per chunk so that one chunk's float32 [rows, V] logits take about `chunk_bytes` (CHUNK_BYTES)."""
    return max(1, (CHUNK_BYTES if chunk_bytes is None else chunk_bytes) // (4 * vocab_size))


def _compute_dtype(device_type: str) -> torch.dtype | None:
    return torch.get_autocast_dtype(device_type) if torch.is_autocast_enabled(device_type) else None


def _raw_logits(h: Tensor, w: Tensor, dtype: torch.dtype | None) -> Tensor:
    if dtype is not None:
        h, w = h.to(dtype), w.to(dtype)
    return torch.nn.functional.linear(h, w).float()


def _top(logits: Tensor, top: int) -> tuple[Tensor, Tensor, Tensor]:
    probs = torch.softmax(logits, dim=-1)
    p, i = probs.topk(min(top, probs.shape[-1]), dim=-1)
    return p, i, logits.argmax(-1)


def _restrict(scaled: Tensor, targets: Tensor, top_p: float, top_k: int) -> Tensor:
    """Tempered logits with -inf outside the sampler's kept set (unchanged without a filter)."""
    if not filtered(top_p, top_k):
        return scaled
    return scaled.masked_fill(~sampler_support(scaled, targets, top_p, top_k), float("-inf"))


class _ChunkedHeadLogprob(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden, weight, targets, temperature, rows, top, dtype, top_p=1.0, top_k=0):
        n = hidden.shape[0]
        out = torch.empty(n, dtype=torch.float32, device=hidden.device)
        logz = torch.empty(n, dtype=torch.float32, device=hidden.device)
        tops = []
        with torch.autocast(hidden.device.type, enabled=False):
            for s in range(0, n, rows):
                raw = _raw_logits(hidden[s:s + rows], weight, dtype)
                if top:
                    tops.append(_top(raw, top))
                scaled = raw / temperature if temperature != 1.0 else raw
                del raw
                scaled = _restrict(scaled, targets[s:s + rows], top_p, top_k)
                lz = torch.logsumexp(scaled, dim=-1)
                out[s:s + rows] = scaled.gather(-1, targets[s:s + rows].unsqueeze(-1)).squeeze(-1) - lz
                logz[s:s + rows] = lz
        ctx.save_for_backward(hidden, weight, targets, logz)
        ctx.temperature, ctx.rows, ctx.dtype, ctx.top_p, ctx.top_k = temperature, rows, dtype, top_p, top_k
        if not top:
            return out
        tp, ti, t1 = (torch.cat(x) for x in zip(*tops, strict=True))
        ctx.mark_non_differentiable(tp, ti, t1)
        return out, tp, ti, t1

    @staticmethod
    def backward(ctx, g, *_):
        hidden, weight, targets, logz = ctx.saved_tensors
        t, rows, dtype = ctx.temperature, ctx.rows, ctx.dtype
        need_h, need_w = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        grad_h = torch.empty_like(hidden) if need_h else None
        grad_w = torch.zeros(weight.shape, dtype=torch.float32, device=weight.device) if need_w else None
        wc = weight.to(dtype) if dtype is not None else weight
        with torch.autocast(hidden.device.type, enabled=False):
            for s in range(0, hidden.shape[0], rows):
                h = hidden[s:s + rows]
                raw = _raw_logits(h, weight, dtype)
                scaled = raw / t if t != 1.0 else raw
                del raw
                scaled = _restrict(scaled, targets[s:s + rows], ctx.top_p, ctx.top_k)
                gl = torch.exp(scaled - logz[s:s + rows, None]).mul_(-g[s:s + rows, None])  # -g * softmax
                del scaled
                gl.scatter_add_(-1, targets[s:s + rows, None], g[s:s + rows, None].float())  # + g * onehot
                if t != 1.0:
                    gl.div_(t)
                gc = gl.to(dtype) if dtype is not None else gl
                del gl
                if need_h:
                    grad_h[s:s + rows] = (gc @ wc).to(hidden.dtype)
                if need_w:
                    grad_w += (gc.t() @ (h.to(dtype) if dtype is not None else h)).float()
        return grad_h, None if grad_w is None else grad_w.to(weight.dtype), None, None, None, None, None, None, None


def head_logprobs(hidden: Tensor, lm_head: torch.nn.Linear, targets: Tensor, temperature: float, top: int = 0,
                  max_rows: int | None = None, top_p: float = 1.0, top_k: int = 0
                  ) -> tuple[Tensor, tuple[Tensor, Tensor, Tensor] | None]:
    """log p(targets) [N] under softmax(lm_head(hidden) / temperature) for hidden [N, H], targets [N] (restricted
    to the sampler's top-p / top-k set and renormalised, as `grpo.token_logprobs`); with top > 0
    also (top-`top` probabilities [N, top], their ids, argmax ids [N]) of softmax(logits) (untempered), detached.

    Rows above `max_rows` (default: `chunk_rows(V)`) are processed in chunks of that many rows, recomputing each
    chunk's logits in the backward instead of keeping [N, V] arrays."""
    if temperature <= 0:
        raise SpecRLError(f"temperature must be > 0 to compute log-probabilities, got {temperature}")
    if getattr(lm_head, "bias", None) is not None:
        raise SpecRLError("head_logprobs expects an LM head without bias (Llama / Qwen2 / Qwen3 heads have none)")
    rows = chunk_rows(lm_head.weight.shape[0]) if max_rows is None else max_rows
    if rows < 1:
        raise SpecRLError(f"max_rows must be >= 1, got {rows}")
    if hidden.shape[0] <= rows:
        logits = lm_head(hidden).float()
        lp = token_logprobs(logits.unsqueeze(0), targets.unsqueeze(0), temperature, top_p, top_k)[0]
        return lp, (tuple(x.detach() for x in _top(logits.detach(), top)) if top else None)
    dtype = _compute_dtype(hidden.device.type)
    out = _ChunkedHeadLogprob.apply(hidden, lm_head.weight, targets, float(temperature), rows, top, dtype,
                                    float(top_p), int(top_k))
    return (out[0], tuple(out[1:])) if top else (out, None)
