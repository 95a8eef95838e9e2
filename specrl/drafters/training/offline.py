"""Offline drafter initialisation: distil the target's next-token distributions into an EAGLE, MTP or draft model.

`collect` runs the target once over every training sequence (no grad, the target is never modified) and keeps
what the drafter learns from: the hidden states it reads (three fused layers for EAGLE, the final-normed
hidden for MTP) and the target's top-K next-token probabilities (K = TARGET_TOPK = 32 by default: the loss is a soft
cross-entropy against this truncated target, which keeps memory bounded for a 49k vocabulary). `train_drafter`
then trains the drafter with that soft cross-entropy (forward KL up to a constant):
* EAGLE: entry t = (g_t, x_{t+1}) predicts the target distribution at t+1, over `ttt_steps` unrolled steps of
  training-time test (step s feeds the step s-1 output hidden back, exactly as drafting does; see
  `EagleDrafter.forward_train`), weighted 0.8^(s-1) (`eagle.TTT_STEP_WEIGHT`). With a reduced draft vocabulary
  the target mass outside the subset simply cannot be matched (the loss only sums over the subset).
* MTP: module j at t predicts the target distribution at t+j (`MTPDrafter.forward_train`).
* Draft model (`DraftModelDrafter`, e.g. a slice of the target's layers): position t predicts the target
  distribution at t from the tokens alone (no target features); its embeddings / LM head train only if they
  require grad.
Each kind's features and loss are methods of its class (`specrl.drafters.trainable.TrainableDrafter`:
`training_capture`, `training_features`, `target_to_draft`, `training_loss`); this module runs them for any drafter
that implements it.
Positions before `prompt_lens` (the prompt) are context only, never loss. `heldout_acceptance` measures the
drafter the way it will be used: the real engine, k drafts per step, returning the acceptance length.
"""

from __future__ import annotations

import math
import random
import time
from collections import Counter
from dataclasses import dataclass

import torch
from torch import Tensor

from specrl.cpu import tick
from specrl.drafters.trainable import TrainableDrafter
from specrl.errors import SpecRLError

MIN_SEQUENCE_TOKENS = 3
MIN_SEQUENCES = 2  # one sequence at least is held out
TARGET_TOPK = 32  # the target distribution is kept as its top-K tokens (soft cross-entropy target)
TTT_STEPS = 3  # EAGLE training-time-test steps unrolled per position
ADAM_BETAS = (0.9, 0.95)
GRAD_CLIP_NORM = 1.0
MAX_WARMUP_STEPS = 50  # linear warm-up over min(MAX_WARMUP_STEPS, total steps // WARMUP_DIVISOR) steps
WARMUP_DIVISOR = 20
LR_FLOOR = 0.1  # the cosine schedule decays to this fraction of lr
LENGTH_JITTER = 8  # tokens of random jitter when batching sequences of similar length


@dataclass
class Example:
    tokens: Tensor  # [T] long
    feats: Tensor  # [T, F] target hidden states the drafter reads (EAGLE: 3 layers concatenated)
    top_idx: Tensor  # [T, K] long: draft-vocab index of the target's top-K tokens at t (-1: outside subset)
    top_p: Tensor  # [T, K] float: their target probabilities (distribution of x_{t+1})
    top1: Tensor  # [T] long: the target's argmax (target ids)
    loss_from: int  # first predicted token index that counts (= prompt length)


def _trainable(drafter) -> TrainableDrafter:
    if isinstance(drafter, TrainableDrafter):
        return drafter
    raise SpecRLError(f"train_drafter trains EAGLE, MTP and draft-model drafters; got {type(drafter).__name__} "
                      "(unknown drafter kind; use specrl.drafters.kinds.eagle.EagleDrafter, "
                      "specrl.drafters.kinds.mtp.MTPDrafter or specrl.drafters.DraftModelDrafter)")


def _module(drafter) -> torch.nn.Module:
    """The trainable module: the drafter itself (EAGLE, MTP) or the draft model it wraps."""
    return _trainable(drafter).training_module


def validate_sequences(sequences, vocab_size: int, prompt_lens=None) -> list[list[int]]:
    if not isinstance(sequences, (list, tuple)) or len(sequences) == 0:
        raise SpecRLError("training data is empty: give a list of token id sequences (prompt + response), at "
                          "least 2 (one is held out)")
    if len(sequences) < MIN_SEQUENCES:
        raise SpecRLError(f"training data has {len(sequences)} sequence; at least {MIN_SEQUENCES} are needed (one is "
                          "held out)")
    out = []
    for i, s in enumerate(sequences):
        s = [int(t) for t in s]
        if len(s) < MIN_SEQUENCE_TOKENS:
            raise SpecRLError(f"training sequence {i} has {len(s)} tokens; every sequence needs at least "
                              f"{MIN_SEQUENCE_TOKENS} (prompt + response)")
        if min(s) < 0 or max(s) >= vocab_size:
            raise SpecRLError(f"training sequence {i} has token ids outside [0, {vocab_size}) (the target's "
                              "vocabulary)")
        out.append(s)
    if prompt_lens is not None and len(prompt_lens) != len(out):
        raise SpecRLError(f"prompt_lens has {len(prompt_lens)} entries; expected one per sequence ({len(out)})")
    return out


def select_draft_vocab(sequences: list[list[int]], size: int, always: tuple[int, ...] | list[int] = ()) -> list[int]:
    """The `size` most frequent token ids in the data (plus `always`, e.g. stop tokens), most frequent first.

    Fewer are returned when the data has fewer distinct tokens.
    """
    if not isinstance(size, int) or size < 1:
        raise SpecRLError(f"draft vocabulary size must be an integer >= 1, got {size!r}")
    counts = Counter(t for s in sequences for t in s)
    out = [int(t) for t in always]
    seen = set(out)
    for t, _ in counts.most_common():
        if len(out) >= size:
            break
        if t not in seen:
            out.append(int(t))
            seen.add(t)
    return out[:max(size, len(always))]


@torch.no_grad()
def target_outputs(target, sequences: list[list[int]], capture: tuple[int, ...] = (), batch_size: int = 8,
                   topk: int = TARGET_TOPK, progress: bool = False):
    """One no-grad target forward per batch of similar-length sequences; yields, per sequence index i,
    (i, tokens [T], captured layers {layer: [T, H]}, final-normed hidden [T, H], top-K target ids [T, K],
    their probabilities [T, K], argmax [T]) on the host. The shared core of `collect` and the build's feature
    stage (`specrl.drafters.training.build.features`)."""
    vocab = target.args.vocab_size
    dev = target.embed_tokens.weight.device
    kk = min(topk, vocab)
    order = sorted(range(len(sequences)), key=lambda i: len(sequences[i]))
    starts = range(0, len(order), batch_size)
    if progress:
        from tqdm import tqdm

        starts = tqdm(starts, desc="target forwards", unit="batch")
    for a in starts:
        tick()  # target forwards over the whole corpus: follow the machine's load (an active thread governor)
        idx = order[a: a + batch_size]
        longest = max(len(sequences[i]) for i in idx)
        tok = torch.zeros(len(idx), longest, dtype=torch.long)
        for b, i in enumerate(idx):
            tok[b, : len(sequences[i])] = torch.tensor(sequences[i])
        hidden, captured = target.forward_hidden(tok.to(dev), capture=capture)
        logits = target.logits(hidden)
        top_p, top_i = torch.softmax(logits, dim=-1).topk(kk, dim=-1)
        top1 = logits.argmax(-1)
        for b, i in enumerate(idx):
            n = len(sequences[i])
            yield (i, tok[b, :n].clone(), {k: v[b, :n].cpu() for k, v in captured.items()}, hidden[b, :n].cpu(),
                   top_i[b, :n].cpu(), top_p[b, :n].cpu(), top1[b, :n].cpu())


@torch.no_grad()
def collect(target, drafter, sequences: list[list[int]], batch_size: int = 8, topk: int = TARGET_TOPK,
            prompt_lens: list[int] | None = None, progress: bool = False) -> list[Example]:
    """One no-grad target forward per batch: the hidden states and top-K next-token distributions."""
    drafter = _trainable(drafter)
    t2d = drafter.target_to_draft()  # None: draft index = target id
    capture = drafter.training_capture
    out: list[Example | None] = [None] * len(sequences)
    for i, tok, captured, hidden, top_i, top_p, top1 in target_outputs(target, sequences, capture, batch_size, topk,
                                                                       progress):
        feats = drafter.training_features(captured, hidden)
        top_idx = top_i if t2d is None else t2d.to(top_i.device)[top_i]
        # the corpus lives in host memory (all sequences' features); `_pad` moves each batch to the device
        out[i] = Example(tokens=tok, feats=feats.clone(), top_idx=top_idx, top_p=top_p.half(), top1=top1,
                         loss_from=int(prompt_lens[i]) if prompt_lens else 1)
    return out  # type: ignore[return-value]


def _pad(examples: list[Example], device) -> dict:
    b = len(examples)
    t = max(len(e.tokens) for e in examples)
    k = examples[0].top_idx.shape[1]
    f = examples[0].feats.shape[1]
    batch = {
        "tokens": torch.zeros(b, t, dtype=torch.long), "feats": torch.zeros(b, t, f, dtype=examples[0].feats.dtype),
        "top_idx": torch.full((b, t, k), -1, dtype=torch.long), "top_p": torch.zeros(b, t, k),
        "top1": torch.zeros(b, t, dtype=torch.long), "len": torch.tensor([len(e.tokens) for e in examples]),
        "loss_from": torch.tensor([e.loss_from for e in examples]),
    }
    for i, e in enumerate(examples):
        n = len(e.tokens)
        batch["tokens"][i, :n] = e.tokens
        batch["feats"][i, :n] = e.feats
        batch["top_idx"][i, :n] = e.top_idx
        batch["top_p"][i, :n] = e.top_p.float()
        batch["top1"][i, :n] = e.top1
    return {k: v.to(device) for k, v in batch.items()}


def batch_loss(drafter, batch: dict, ttt_steps: int = TTT_STEPS) -> tuple[Tensor, dict]:
    """Loss of one padded batch; also counts for step-1 top-1 agreement with the target (the kind's
    `training_loss`)."""
    return _trainable(drafter).training_loss(batch, ttt_steps)


def _device(module: torch.nn.Module) -> torch.device:
    return next(module.parameters()).device


def evaluate(drafter, examples: list[Example], batch_size: int = 8, ttt_steps: int = TTT_STEPS) -> dict:
    module = _module(drafter)
    was_training = module.training
    module.eval()
    loss_sum, n_pos, n_top1, n_batches = 0.0, 0, 0, 0
    with torch.no_grad():
        for a in range(0, len(examples), batch_size):
            loss, st = batch_loss(drafter, _pad(examples[a: a + batch_size], _device(module)), ttt_steps)
            loss_sum += float(loss)
            n_batches += 1
            n_pos += st["positions"]
            n_top1 += st["top1"]
    module.train(was_training)
    return {"loss": loss_sum / max(n_batches, 1), "top1": n_top1 / max(n_pos, 1)}


def train_drafter(drafter, target, sequences, epochs: int = 1, lr: float = 1e-3, batch_size: int = 8,
                  progress: bool = True, heldout_fraction: float = 0.1, prompt_lens: list[int] | None = None,
                  ttt_steps: int = TTT_STEPS, topk: int = TARGET_TOPK, seed: int = 0) -> dict:
    """Train `drafter` on (prompt + response) token sequences to match `target`; return loss/top-1 numbers.

    Returns dict(train_loss, heldout_loss, heldout_top1, initial_heldout_loss, initial_heldout_top1,
    train_sequences, heldout_sequences, seconds). The target is only run forward under no_grad.
    """
    drafter = _trainable(drafter)
    if not isinstance(epochs, int) or epochs < 1:
        raise SpecRLError(f"epochs must be an integer >= 1, got {epochs!r}")
    if not lr > 0:
        raise SpecRLError(f"lr must be > 0, got {lr!r}")
    if not isinstance(batch_size, int) or batch_size < 1:
        raise SpecRLError(f"batch_size must be an integer >= 1, got {batch_size!r}")
    if not 0 < heldout_fraction < 1:
        raise SpecRLError(f"heldout_fraction must be in (0, 1), got {heldout_fraction!r}")
    if drafter.unrolls_steps and (not isinstance(ttt_steps, int) or ttt_steps < 1):
        raise SpecRLError(f"ttt_steps must be an integer >= 1, got {ttt_steps!r}")
    seqs = validate_sequences(sequences, target.args.vocab_size, prompt_lens)
    module = _module(drafter)
    t0 = time.perf_counter()
    drafter.prepare_training(target)  # checks the drafter against the target, shares its embedding
    rng = random.Random(seed)
    order = list(range(len(seqs)))
    rng.shuffle(order)
    n_held = max(1, int(round(len(seqs) * heldout_fraction)))
    held_ids, train_ids = order[:n_held], order[n_held:]
    examples = collect(target, drafter, seqs, batch_size=batch_size, topk=topk, prompt_lens=prompt_lens,
                       progress=progress)
    train_ex = [examples[i] for i in train_ids]
    held_ex = [examples[i] for i in held_ids]
    initial = evaluate(drafter, held_ex, batch_size, ttt_steps)
    params = [p for p in module.parameters() if p.requires_grad]
    if not params:
        raise SpecRLError("the drafter has no parameter that requires grad; nothing to train")
    opt = torch.optim.AdamW(params, lr=lr, weight_decay=0.0, betas=ADAM_BETAS)
    steps_per_epoch = math.ceil(len(train_ex) / batch_size)
    total_steps = steps_per_epoch * epochs
    warmup = max(1, min(MAX_WARMUP_STEPS, total_steps // WARMUP_DIVISOR))

    def lr_at(step: int) -> float:
        if step < warmup:
            return lr * (step + 1) / warmup
        frac = (step - warmup) / max(1, total_steps - warmup)
        return lr * (LR_FLOOR + (1 - LR_FLOOR) * 0.5 * (1 + math.cos(math.pi * frac)))

    bar = None
    if progress:
        from tqdm import tqdm

        bar = tqdm(total=total_steps, desc=f"train {drafter.kind} drafter", unit="step")
    module.train()
    step, recent = 0, []
    for _epoch in range(epochs):
        # batches of similar length (less padding), in a seeded random order
        by_len = sorted(train_ex, key=lambda e: len(e.tokens) + rng.random() * LENGTH_JITTER)
        batches = [by_len[a: a + batch_size] for a in range(0, len(by_len), batch_size)]
        rng.shuffle(batches)
        for chunk in batches:
            tick()
            for g in opt.param_groups:
                g["lr"] = lr_at(step)
            loss, _ = batch_loss(drafter, _pad(chunk, _device(module)), ttt_steps)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(params, GRAD_CLIP_NORM)
            opt.step()
            recent.append(float(loss.detach()))
            step += 1
            if bar is not None:
                bar.update(1)
                bar.set_postfix(loss=f"{sum(recent[-20:]) / len(recent[-20:]):.3f}")
    if bar is not None:
        bar.close()
    module.eval()
    final = evaluate(drafter, held_ex, batch_size, ttt_steps)
    tail = recent[-max(1, steps_per_epoch):]
    return {"train_loss": sum(tail) / len(tail), "heldout_loss": final["loss"], "heldout_top1": final["top1"],
            "initial_heldout_loss": initial["loss"], "initial_heldout_top1": initial["top1"],
            "train_sequences": len(train_ex), "heldout_sequences": len(held_ex),
            "seconds": time.perf_counter() - t0}


def heldout_acceptance(target, drafter, prompts: list[list[int]], k: int = 3, temperature: float = 1.0,
                       max_new_tokens: int = 128, stop_token_ids: tuple[int, ...] = (), seed: int = 0,
                       max_batch_size: int = 32) -> float:
    """Run the real engine with this drafter (k drafts per step) and return its acceptance length."""
    from specrl.rollout.engine import RolloutEngine
    from specrl.rollout.sampling import SamplingParams

    if not prompts:
        raise SpecRLError("heldout_acceptance needs at least one prompt")
    modules = getattr(drafter, "num_modules", None)  # a drafter of D modules drafts at most D tokens (MTP)
    if modules is not None and k > modules:
        raise SpecRLError(f"k={k} but the {drafter.kind} drafter has {modules} modules (k must be <= that)")
    longest = max(len(p) for p in prompts)
    engine = RolloutEngine(target, max_batch_size=min(max_batch_size, len(prompts)),
                           max_seq_len=longest + max_new_tokens + 1, drafter=drafter, num_draft_tokens=k,
                           k_max=max(k, 1))
    sp = SamplingParams(temperature=temperature, max_new_tokens=max_new_tokens,
                        stop_token_ids=tuple(stop_token_ids), seed=seed)
    return float(engine.generate([list(p) for p in prompts], sp).metrics["acceptance_length"])
