"""Event-driven simulation of continuous batching over one RL step's rollouts.

Each engine (a group of GPUs holding one copy of the policy) gets a contiguous share of the rollouts, admits
them FIFO while it has batch slots and KV-cache room (a batched prefill per admission wave), and decodes the
active batch step by step. Between two events — a sequence finishing, or the KV cache filling up (the newest
sequence is then preempted and re-queued to be recomputed, like vLLM) — the batch is fixed, every sequence
advances AL tokens per step (1 for plain decoding), and the KV read grows linearly, so the interval is priced
in closed form from the step model at its mid-point. The batch drains over the step: early steps are large and
closer to compute-bound, the long tail is small and memory-bound, which is where speculation pays. The
generation stage ends when the slowest engine finishes.
"""

from __future__ import annotations

import heapq
import math
from collections import deque
from dataclasses import dataclass, field

import numpy as np

from specrl.errors import SpecRLError
from specrl.sim.costs.roofline import ForwardCost
from specrl.sim.costs.speculation import StepModel


@dataclass
class EngineStats:
    seconds: float = 0.0
    prefill_seconds: float = 0.0
    steps: int = 0
    tokens: float = 0.0
    k_steps: float = 0.0  # sum of k over steps (for the mean draft length)
    preemptions: int = 0
    batch_steps: float = 0.0  # sum of batch size over steps
    eager_seconds: float = 0.0  # decode-step time whose target forward ran outside a CUDA graph


@dataclass
class SimulatedGeneration:
    seconds: float
    engines: int
    generated_tokens: float
    steps: int
    mean_k: float
    acceptance_length: float
    preemptions: int
    mean_batch: float
    prefill_seconds: float
    engine_seconds: list[float] = field(default_factory=list)
    eager_share: float = 0.0  # share of decode-step time (all engines) whose target forward ran outside a graph

    def to_dict(self) -> dict:
        return {
            "seconds": self.seconds, "engines": self.engines, "generated_tokens": self.generated_tokens,
            "decode_steps_slowest_engine": self.steps, "mean_k": self.mean_k,
            "acceptance_length": self.acceptance_length, "preemptions": self.preemptions,
            "mean_batch": self.mean_batch, "prefill_seconds": self.prefill_seconds,
            "eager_step_share": self.eager_share,
        }


def simulate_engine(prompts: np.ndarray, responses: np.ndarray, step: StepModel, prefill: ForwardCost,
                    kv_capacity: float, max_seqs: int, prefix_share: int = 1,
                    trace: list | None = None) -> EngineStats:
    """Simulate one engine draining its rollouts; returns its timings. `trace` (a list) receives one
    (batch, k, steps, seconds per step, mean cached tokens) tuple per interval of fixed batch."""
    prompt = prompts.astype(float).copy()
    remaining = responses.astype(float).copy()
    n = len(prompt)
    start = np.zeros(n)
    epoch = np.zeros(n, dtype=np.int64)
    alive = np.zeros(n, dtype=bool)
    queue: deque[int] = deque(range(n))
    heap: list[tuple[float, int, int]] = []
    admitted: list[int] = []  # admission order, for LIFO preemption
    st = EngineStats()
    progress, batch, sum_prompt, sum_start = 0.0, 0, 0.0, 0.0
    cache: dict[tuple[int, int], tuple[int, float, float]] = {}

    while queue or batch:
        new_tokens, new_pairs = 0.0, 0.0
        kv_used = sum_prompt + batch * progress - sum_start
        # admit while slots remain and the batch keeps room for one more step of worst-case growth
        while queue and batch < max_seqs and \
                kv_used + prompt[queue[0]] + (batch + 1) * step.max_growth <= kv_capacity:
            i = queue.popleft()
            alive[i] = True
            epoch[i] += 1
            start[i] = progress
            batch += 1
            sum_prompt += prompt[i]
            sum_start += progress
            kv_used += prompt[i]
            new_tokens += prompt[i] / prefix_share
            new_pairs += prompt[i] * prompt[i] / 2 / prefix_share
            heapq.heappush(heap, (progress + remaining[i], i, int(epoch[i])))
            admitted.append(i)
        if batch == 0:
            need = prompt[queue[0]] + remaining[queue[0]]
            raise SpecRLError(
                f"one sequence ({prompt[queue[0]]:.0f} prompt tokens) does not fit the engine's KV cache of "
                f"{kv_capacity:.0f} tokens; use more GPUs per engine or fewer max tokens (needs {need:.0f})")
        if new_tokens:
            dt = prefill(new_tokens, 0.0, attn_pairs=new_pairs)
            st.seconds += dt
            st.prefill_seconds += dt
        while heap and (not alive[heap[0][1]] or heap[0][2] != epoch[heap[0][1]]):
            heapq.heappop(heap)
        key = (batch, int(kv_used // 4096))
        choice = cache.get(key)
        if choice is None:
            choice = step.choose(batch, kv_used)
            cache[key] = choice
        k, al, _ = choice
        growth = batch * al
        n_finish = max(1, math.ceil((heap[0][0] - progress) / al - 1e-9))
        n_full = math.floor((kv_capacity - kv_used) / growth)
        if n_full < 1:
            if batch == 1:
                raise SpecRLError(
                    f"a single sequence outgrows the engine's KV cache of {kv_capacity:.0f} tokens; use more "
                    "GPUs per engine or a smaller --max-response-tokens")
            while not alive[admitted[-1]]:
                admitted.pop()
            j = admitted.pop()
            done = progress - start[j]
            alive[j] = False
            batch -= 1
            sum_prompt -= prompt[j]
            sum_start -= start[j]
            prompt[j] += done
            remaining[j] -= done
            queue.appendleft(j)
            st.tokens += done  # kept: recomputed as prompt on re-admission
            st.preemptions += 1
            continue
        nsteps = min(n_finish, n_full)
        kv_mid = kv_used + growth * (nsteps - 1) / 2
        dt = step.spec_seconds(batch, kv_mid, k) if k else step.ar_seconds(batch, kv_mid)
        st.seconds += nsteps * dt
        if trace is not None:
            trace.append((batch, k, nsteps, dt, kv_mid))
        if not step.target.graphed(batch * (k + 1)):
            st.eager_seconds += nsteps * dt
        st.steps += nsteps
        st.k_steps += nsteps * k
        st.batch_steps += nsteps * batch
        progress += nsteps * al
        while heap and heap[0][0] <= progress + 1e-9:
            _, i, ep = heapq.heappop(heap)
            if alive[i] and ep == epoch[i]:
                alive[i] = False
                batch -= 1
                sum_prompt -= prompt[i]
                sum_start -= start[i]
                st.tokens += progress - start[i]
    return st


def simulate_generation(prompts: np.ndarray, responses: np.ndarray, engines: int, step: StepModel,
                        prefill: ForwardCost, kv_capacity: float, max_seqs: int,
                        generations_per_prompt: int = 1, trace: list | None = None) -> SimulatedGeneration:
    """Split rollouts over `engines` in contiguous prompt groups and simulate each; the stage ends with the
    slowest engine.

    2-D inputs (streams x rollouts) model generation that runs ahead under a policy lag: each engine queues
    its share of every stream back to back, so the drain at the end is paid once for all streams, and the
    result's seconds are per stream. `trace`: the decode intervals of the slowest engine (see simulate_engine).
    """
    prompts, responses = np.atleast_2d(prompts), np.atleast_2d(responses)
    streams, n = responses.shape
    groups = max(1, n // max(1, generations_per_prompt))
    bounds = [round(i * groups / engines) * generations_per_prompt for i in range(engines + 1)]
    bounds[-1] = n
    stats, traces = [], []
    for e in range(engines):
        lo, hi = bounds[e], bounds[e + 1]
        if hi > lo:
            traces.append([] if trace is not None else None)
            stats.append(simulate_engine(prompts[:, lo:hi].ravel(), responses[:, lo:hi].ravel(), step, prefill,
                                         kv_capacity, max_seqs, prefix_share=generations_per_prompt,
                                         trace=traces[-1]))
    slow = max(stats, key=lambda s: s.seconds)
    if trace is not None:
        trace.extend(traces[stats.index(slow)])
    steps = sum(s.steps for s in stats)
    gen_tokens = float(responses.sum()) / streams
    return SimulatedGeneration(
        seconds=slow.seconds / streams, engines=engines, generated_tokens=gen_tokens, steps=slow.steps // streams,
        mean_k=sum(s.k_steps for s in stats) / max(steps, 1),
        acceptance_length=gen_tokens * streams / max(sum(s.batch_steps for s in stats), 1.0),
        preemptions=sum(s.preemptions for s in stats) // streams,
        mean_batch=sum(s.batch_steps for s in stats) / max(steps, 1),
        prefill_seconds=slow.prefill_seconds / streams, engine_seconds=[s.seconds / streams for s in stats],
        eager_share=sum(s.eager_seconds for s in stats) / max(sum(s.seconds - s.prefill_seconds for s in stats),
                                                               1e-30),
    )
