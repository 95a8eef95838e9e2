"""The trainer's cost model: the FLOPs of one trainer forward over a step's rollouts (packed, or padded per
micro-batch as specrl's trainer runs them) and the expert-parallel all-to-all of a MoE trainer forward. The
simulation's logprob and train stages (`specrl.sim.pipeline.other_stages`) price a step with them.
"""

from __future__ import annotations

import numpy as np

from specrl.sim.costs.accelerators import Hardware
from specrl.sim.costs.models import ModelSpec


def trainer_forward_flops(m: ModelSpec, prompts: np.ndarray, responses: np.ndarray, micro_batch: int = 0,
                          head_on_all: bool = False) -> tuple[float, float]:
    """(GEMM FLOPs, attention FLOPs) of one trainer forward over a step's rollouts.

    Packed (micro_batch 0): every token through every weight, causal attention over each sequence (L²/2 pairs).
    Padded (specrl's trainer): each micro-batch of `micro_batch` consecutive rollouts is right-padded to its
    longest sequence, so the decoder body and attention run over n·L_max tokens (n·L_max²/2 pairs); the LM head
    runs only on the response tokens, whose log-probabilities are needed (`head_on_all`: on every token, as
    a drafter's training forward does).
    """
    seq = prompts + responses
    if micro_batch <= 0:
        body, head = float(seq.sum()), float(seq.sum())
        pairs = float((seq * seq / 2).sum())
    else:
        longest = np.array([seq[i:i + micro_batch].max() for i in range(0, len(seq), micro_batch)])
        sizes = np.array([len(seq[i:i + micro_batch]) for i in range(0, len(seq), micro_batch)])
        body = float((sizes * longest).sum())
        head = body if head_on_all else float(responses.sum())
        pairs = float((sizes * longest * longest / 2).sum())
    lm = m.lm_head_params()
    return 2.0 * (m.active_params() - lm) * body + 2.0 * lm * head, m.attn_flops_per_pair() * pairs


def moe_train_a2a_seconds(m: ModelSpec, hw: Hardware, tokens: float, ep: int, train_gpus: int) -> float:
    """Expert-parallel all-to-all of one trainer forward: every token's hidden state goes to its k experts and
    comes back (dispatch + combine, bf16) in every MoE layer, across the `ep` GPUs that share the experts."""
    if not m.is_moe or ep <= 1:
        return 0.0
    ep = min(ep, m.num_experts)
    per_gpu = tokens / train_gpus * 2 * m.experts_per_token * m.hidden * 2.0 * m.moe_layers * (ep - 1) / ep
    return per_gpu / hw.link_bandwidth(ep) + 2 * m.moe_layers * hw.collective_latency_s
