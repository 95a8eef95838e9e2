"""The drafter protocol: the engine's contract with every drafter (drafters propose, the engine verifies).

A drafter is bound once to a rollout engine through a `BindContext` (the target model, the number of batch
slots, the cache length and k_max: nothing else of the engine). Each speculative step it sees the active batch
as a `DraftBatch` (sequences in slots 0..n-1, their tokens so far, sampling parameters and the position-keyed
noise) and returns a `Proposal`: k tokens per sequence and, for drafters that sample from a full distribution,
the processed probabilities q of every drafted position. Deterministic drafters (n-gram, suffix, argmax
drafting) return `probs=None`, meaning one-hot q. Drafters with state (a KV cache, hidden features) keep it in
step through the hooks: `on_prefill` when new sequences enter slots, `on_verified` after each verification (and
after each plain step, with `proposal=None`), carrying the captured target hidden states when `target_layers` is
non-empty, and `compact` when the engine drops finished sequences from its batch. The decision which drafted
tokens are kept is never the drafter's: it is `specrl.rollout.spec_decode.verify.verify`.
"""

from __future__ import annotations

from dataclasses import dataclass

from torch import Tensor

from specrl.rollout.sampling import STREAM_DRAFT, STREAM_SAMPLE, probs_from_logits, sample_inverse_cdf, uniform


@dataclass(frozen=True)
class BindContext:
    """What a drafter may know about the engine it serves."""

    target: object  # the engine's target model (a specrl Transformer)
    max_batch_size: int  # slots 0..max_batch_size-1
    cache_len: int  # positions per slot in the engine's KV cache (max_seq_len + k_max + 1)
    k_max: int  # the largest k the engine will ask for


@dataclass
class DraftBatch:
    tokens: list[list[int]]  # per active sequence: prompt + generated tokens so far
    positions: Tensor  # [n] position of the first token to draft (= current length)
    seeds: Tensor  # [n]
    request_ids: Tensor  # [n]
    group_ids: list[int]  # [n] sequences sharing a prompt share a group id (suffix drafting)
    temperature: Tensor  # [n]
    top_p: Tensor  # [n]
    top_k: Tensor  # [n]
    verify_mode: str = "rejection"

    @property
    def size(self) -> int:
        return len(self.tokens)

    def noise(self, offset: int | Tensor) -> Tensor:
        """The uniforms a sampling drafter uses for the token at positions + offset: [n], or [n, j] for a
        tensor of j offsets (a drafter that draws j positions at once).

        In seed_exact mode this is the policy's own sampling noise (so a good drafter reproduces the
        policy's token); in rejection mode it is an independent stream.
        """
        stream = STREAM_SAMPLE if self.verify_mode == "seed_exact" else STREAM_DRAFT
        if isinstance(offset, Tensor):
            return uniform(self.seeds[:, None], self.request_ids[:, None], self.positions[:, None] + offset[None, :],
                           stream)
        return uniform(self.seeds, self.request_ids, self.positions + offset, stream)

    def _params(self, logits: Tensor, offset: int | Tensor) -> tuple[Tensor, Tensor, Tensor]:
        """Each row's T/top-p/top-k, spread over the positions of logits [n, j, V] drawn at once."""
        many = isinstance(offset, Tensor)
        if logits.dim() != (3 if many else 2) or (many and (offset.dim() != 1 or len(offset) != logits.shape[1])):
            raise ValueError(f"drafter logits {list(logits.shape)} with offset {offset!r}: one draw per row takes "
                             "logits [n, V] and an int offset; j positions at once take logits [n, j, V] and a 1-D "
                             "tensor of j offsets")
        if not many:
            return self.temperature, self.top_p, self.top_k
        j = logits.shape[1]
        return tuple(t[:, None].expand(-1, j) for t in (self.temperature, self.top_p, self.top_k))

    def sample(self, logits: Tensor, offset: int | Tensor) -> tuple[Tensor, Tensor]:
        """Process drafter logits [n, V] with each request's T/top-p/top-k and draw one token each; or logits
        [n, j, V] at the j offsets of a tensor `offset`, one token per row and position (the same draws as j
        calls with one offset each)."""
        q = probs_from_logits(logits, *self._params(logits, offset))
        return sample_inverse_cdf(q, self.noise(offset)), q

    def sample_subset(self, logits: Tensor, ids: Tensor, vocab_size: int, offset: int | Tensor,
                      out: Tensor | None = None) -> tuple[Tensor, Tensor]:
        """`sample` for logits [n, Vd] (or [n, j, Vd]) over a subset of the vocabulary, `ids` [Vd] its target
        ids in ascending order: T/top-p/top-k, the softmax and the inverse CDF run over the Vd entries only (the
        full distribution is zero elsewhere, so its CDF in id order has the same steps, and a uniform picks the
        same token), and the returned q [n, (j,) vocab_size] is that distribution scattered into the full
        vocabulary, zero outside. `out`, a zero-filled float32 tensor of q's shape (a view of a drafter's [n, k, V]
        proposal buffer), receives q instead of a new tensor, so k draws need no stacking copy."""
        qd = probs_from_logits(logits, *self._params(logits, offset))
        tok = ids[sample_inverse_cdf(qd, self.noise(offset))]
        q = qd.new_zeros((*qd.shape[:-1], vocab_size)) if out is None else out
        q[..., ids] = qd
        return tok, q


@dataclass
class Proposal:
    tokens: Tensor  # [n, k] long
    probs: Tensor | None = None  # [n, k, V] processed q, or None for one-hot drafts
    # [n] long: row b's real drafts are its first num_drafts[b] tokens, the rest padding (ragged proposals of the
    # n-gram, suffix and hybrid drafters); None: all k are real. Padding is never accepted nor counted as drafted,
    # and columns past the longest real draft are not verified at all: the engine hands `on_verified` the proposal
    # trimmed to those columns (a stateful drafter sees fewer columns than it drafted, as under per-row budgets).
    num_drafts: Tensor | None = None
    # [n] bool: row b's draft came from the history of its prompt (the suffix index: siblings and earlier
    # rollouts), counted apart in the generation metrics; None: no row did
    from_history: Tensor | None = None


class Drafter:
    """Base class; subclasses implement `propose` and, if stateful, the hooks."""

    kind: str = "base"
    target_layers: tuple[int, ...] = ()  # target hidden states this drafter needs from verify forwards
    # seconds of the last `propose` spent catching up on tokens emitted by plain (k=0) steps: the deferred cost of
    # those steps, which the adaptive draft length does not charge to the speculative step that pays it
    catch_up_seconds: float = 0.0

    def bind(self, ctx: BindContext) -> None:
        """Called once by the engine: check compatibility with the target, allocate state."""

    def on_prefill(self, slot_start: int, batch_tokens: list[list[int]], captured: dict | None) -> None:
        """New sequences entered slots slot_start.. with these prompts (target prefill done)."""

    def propose(self, batch: DraftBatch, k: int) -> Proposal:
        raise NotImplementedError

    def on_verified(self, batch: DraftBatch, proposal: Proposal | None, num_emitted: Tensor,
                    captured: dict | None) -> None:
        """The engine kept num_emitted[b] tokens of row b (accepted drafts + one policy token; 1 after a plain
        step, where proposal is None)."""

    def compact(self, order: list[int]) -> None:
        """Slots order[0], order[1], ... became slots 0, 1, ... (order is increasing); the rest are free."""

    def memory(self) -> dict[str, int]:
        """What a drafter that keeps rollout history holds ("tokens", "index_entries"); empty for the others."""
        return {}
