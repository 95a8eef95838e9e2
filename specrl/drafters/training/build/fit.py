"""Stage 3 of `specrl draft build`: a head (EAGLE, parallel) trained on the feature shards, resumable from a checkpoint.

`examples_from_features` turns feature files (`features.py`) into the `training.Example`s that `training.batch_loss`
consumes (target ids mapped to draft-vocabulary indices here, so the vocabulary is chosen after extraction:
`select_draft_vocab` over the response tokens of the rollouts, `vocab_coverage` records how much of them it covers).
`fit` is `training.train_drafter`'s loop (AdamW, warm-up then cosine decay, batches of similar length in a seeded
order, gradient clipping, the head's own loss: EAGLE's over `ttt_steps` of training-time test, scored with the
recipe's objective, soft cross-entropy or that plus the TV distance) made resumable: every `checkpoint_every` steps
and at each epoch's end it saves the head, the optimizer, the step and the random state to one file, atomically; a
killed training restarts from that step with the same batch order, so it ends where an uninterrupted one would. The
checkpoint holds only tensors, numbers, strings, lists and dicts and is read with `torch.load(weights_only=True)`: a
crafted file that would build any other object (and so could run code) is refused before anything in it runs. It
also saves snapshots of the head at given steps (the scaling curve's points) and returns the tokens each had trained
on.
"""

from __future__ import annotations

import math
import os
import pickle
import random
import re
import time
from collections import Counter
from pathlib import Path

import torch

from specrl.cpu import tick
from specrl.drafters.training.build.features import load_features
from specrl.drafters.training.offline import (
    ADAM_BETAS,
    GRAD_CLIP_NORM,
    LENGTH_JITTER,
    LR_FLOOR,
    MAX_WARMUP_STEPS,
    WARMUP_DIVISOR,
    Example,
    _pad,
    batch_loss,
)
from specrl.errors import SpecRLError
from specrl.fileio import temp_path

CHECKPOINT_FILE = "checkpoint.pt"


def vocab_coverage(responses: list[list[int]], vocab: list[int], sizes: tuple[int, ...] = ()) -> dict:
    """The share of response tokens inside the draft vocabulary (and inside its first `sizes` entries)."""
    counts = Counter(t for r in responses for t in r)
    total = max(sum(counts.values()), 1)
    out = {"tokens": total, "distinct": len(counts), "size": len(vocab),
           "coverage": sum(counts[t] for t in set(vocab)) / total}
    for n in sizes:
        if n < len(vocab):
            out[f"coverage_at_{n}"] = sum(counts[t] for t in set(vocab[:n])) / total
    return out


def examples_from_features(files: list[Path], t2d: torch.Tensor | None) -> list[Example]:
    """Every row of the feature files as an `Example` (features stay in their stored dtype, views of the file's
    tensors); `t2d` maps target ids to draft indices (-1 outside the draft vocabulary), None: full vocabulary."""
    out = []
    for f in files:
        sf = load_features(f)
        top_idx = sf.top_ids.long() if t2d is None else t2d[sf.top_ids.long()]
        tokens, top1 = sf.tokens.long(), sf.top1.long()
        off = sf.offsets.tolist()
        for r in range(len(off) - 1):
            a, b = off[r], off[r + 1]
            out.append(Example(tokens=tokens[a:b], feats=sf.feats[a:b], top_idx=top_idx[a:b], top_p=sf.top_p[a:b],
                               top1=top1[a:b], loss_from=int(sf.loss_from[r])))
    return out


def _loss_tokens(e: Example) -> int:
    return max(len(e.tokens) - max(e.loss_from, 1), 0)


def epoch_batches(examples: list[Example], batch_size: int, seed: int, epoch: int) -> list[list[int]]:
    """Epoch `epoch`'s batches (example indices): similar lengths together, in an order seeded by (seed, epoch)."""
    rng = random.Random(seed * 1_000_003 + epoch)
    by_len = sorted(range(len(examples)), key=lambda i: len(examples[i].tokens) + rng.random() * LENGTH_JITTER)
    batches = [by_len[a: a + batch_size] for a in range(0, len(by_len), batch_size)]
    rng.shuffle(batches)
    return batches


def _save_atomic(obj, path: Path) -> None:
    tmp = temp_path(path)
    try:
        torch.save(obj, tmp)
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def _load_checkpoint(ck: Path) -> dict:
    """The training checkpoint `ck`, read with `weights_only=True` (tensors and plain data only)."""
    try:
        state = torch.load(ck, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as e:
        found = re.search(r"GLOBAL ([\w.]+)", str(e))
        what = f"`{found.group(1)}`" if found else "an object that is not a tensor or plain data"
        raise SpecRLError(f"training checkpoint {ck} asks to build {what} when loaded, which could run code; "
                          "refused. specrl's training checkpoint holds only tensors, numbers, strings, lists and "
                          f"dicts: delete {ck} to train from the start") from None
    except Exception as e:
        raise SpecRLError(f"training checkpoint {ck} cannot be read ({type(e).__name__}: {e}); delete it to "
                          "train from the start") from None
    if not isinstance(state, dict) or not {"setting", "model", "opt", "torch_rng"} <= set(state):
        raise SpecRLError(f"training checkpoint {ck} is not a specrl drafter training checkpoint (it needs the "
                          "keys setting, model, opt, torch_rng); delete it to train from the start")
    return state


def fit(drafter, examples: list[Example], out: Path, epochs: int, lr: float, batch_size: int, ttt_steps: int,
        seed: int = 0, checkpoint_every: int = 200, checkpoint_seconds: float = 300.0,
        snapshot_steps: tuple[int, ...] = (), progress: bool = True, log=print, stop_after: int | None = None,
        autocast: str = "float32", objective=None) -> dict:
    """Train `drafter` on `examples` for `epochs`, checkpointing into `out`; resume from `out`'s checkpoint.

    `snapshot_steps`: global steps after which the head is saved to `out/snapshots/step-NNNNNN` (save_drafter).
    `stop_after`: stop (checkpointed) after this many steps of this call: a test's way to kill a training.
    A checkpoint is written every `checkpoint_every` steps, at each epoch's end and `checkpoint_seconds` after the
    last one; it holds the loop's seconds over every life so far, so a killed life loses at most that much work.
    `autocast` "bfloat16": the forward and backward matrix products in bf16 (torch.autocast; weights, optimizer
    state and the loss stay float32), about 2x faster on CPUs with bf16 units; "float32": none. `objective` (a
    `specrl.drafters.trainable.Objective`, default soft cross-entropy) is what the head's loss scores with.
    Returns dict(steps, epochs, train_loss (mean of the last epoch's steps), loss_per_epoch, seconds (every life),
    seconds_this_call, snapshots: [{step, tokens_seen, path}], resumed_from).
    """
    from specrl.drafters.storage.io import save_drafter
    from specrl.drafters.trainable import Objective

    if not examples:
        raise SpecRLError("no training examples: the build's feature stage produced none")
    if autocast not in ("float32", "bfloat16"):
        raise SpecRLError(f"train_dtype must be float32 or bfloat16 (autocast), got {autocast!r}")
    out.mkdir(parents=True, exist_ok=True)
    params = [p for p in drafter.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=lr, weight_decay=0.0, betas=ADAM_BETAS)
    steps_per_epoch = math.ceil(len(examples) / batch_size)
    total_steps = steps_per_epoch * epochs
    warmup = max(1, min(MAX_WARMUP_STEPS, total_steps // WARMUP_DIVISOR))
    setting = {"examples": len(examples), "epochs": epochs, "lr": lr, "batch_size": batch_size,
               "ttt_steps": ttt_steps, "seed": seed, "draft_vocab_size": int(drafter.d2t.numel()), "autocast": autocast,
               **drafter.checkpoint_setting()}
    objective = Objective() if objective is None else objective
    if objective != Objective():  # recorded when not the default, so checkpoints of soft cross-entropy still resume
        setting["objective"] = objective.record()
    before, drafter.objective = drafter.objective, objective

    def lr_at(step: int) -> float:
        if step < warmup:
            return lr * (step + 1) / warmup
        frac = (step - warmup) / max(1, total_steps - warmup)
        return lr * (LR_FLOOR + (1 - LR_FLOOR) * 0.5 * (1 + math.cos(math.pi * frac)))

    ck = out / CHECKPOINT_FILE
    step, tokens_seen, losses, snaps, seconds, resumed = 0, 0, [], [], 0.0, None
    if ck.exists():
        state = _load_checkpoint(ck)
        if state.get("setting") != setting:
            diff = {k: (state.get("setting", {}).get(k), v) for k, v in setting.items()
                    if state.get("setting", {}).get(k) != v}
            raise SpecRLError(f"training checkpoint {ck} was made with other settings ({diff}: (checkpoint, now)); "
                              f"delete {out} to train anew with these")
        drafter.load_state_dict(state["model"])
        opt.load_state_dict(state["opt"])
        torch.set_rng_state(state["torch_rng"])
        step, tokens_seen, losses, snaps, seconds = (state["step"], state["tokens_seen"], state["losses"],
                                                     state["snapshots"], state["seconds"])
        resumed = step
        log(f"[specrl] resuming the drafter training from {ck} at step {step}/{total_steps}")
    else:
        torch.manual_seed(seed)

    t0 = time.perf_counter()
    saved_at = t0

    def save() -> None:
        nonlocal saved_at
        saved_at = time.perf_counter()
        _save_atomic({"setting": setting, "model": drafter.state_dict(), "opt": opt.state_dict(),
                      "torch_rng": torch.get_rng_state(), "step": step, "tokens_seen": tokens_seen,
                      "losses": losses, "snapshots": snaps, "seconds": seconds + time.perf_counter() - t0}, ck)

    bar = None
    if progress and step < total_steps:
        from tqdm import tqdm

        bar = tqdm(total=total_steps, initial=step, desc=f"train {drafter.kind} head", unit="step", smoothing=0.05)
    device = next(drafter.parameters()).device
    drafter.train()
    done_here, order_of = 0, (-1, [])
    while step < total_steps:
        epoch, within = divmod(step, steps_per_epoch)
        if order_of[0] != epoch:
            order_of = (epoch, epoch_batches(examples, batch_size, seed, epoch))
        chunk = [examples[i] for i in order_of[1][within]]
        tick()
        for g in opt.param_groups:
            g["lr"] = lr_at(step)
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=autocast == "bfloat16"):
            loss, _ = batch_loss(drafter, _pad(chunk, device), ttt_steps)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, GRAD_CLIP_NORM)
        opt.step()
        losses.append(float(loss.detach()))
        tokens_seen += sum(_loss_tokens(e) for e in chunk)
        step += 1
        done_here += 1
        if bar is not None:
            bar.update(1)
            bar.set_postfix(epoch=f"{epoch + 1}/{epochs}", loss=f"{sum(losses[-50:]) / len(losses[-50:]):.3f}")
        if step in snapshot_steps and not any(s["step"] == step for s in snaps):
            p = out / "snapshots" / f"step-{step:06d}"
            drafter.eval()
            save_drafter(drafter, p)
            drafter.train()
            snaps.append({"step": step, "epoch": step / steps_per_epoch, "tokens_seen": tokens_seen, "path": str(p)})
        if step % checkpoint_every == 0 or step % steps_per_epoch == 0 or step == total_steps or \
                time.perf_counter() - saved_at >= checkpoint_seconds:  # a kill loses at most this much work
            save()
        if stop_after is not None and done_here >= stop_after and step < total_steps:
            save()
            break
    if bar is not None:
        bar.close()
    drafter.eval()
    drafter.objective = before
    here = time.perf_counter() - t0
    seconds += here
    per_epoch = [sum(losses[a: a + steps_per_epoch]) / len(losses[a: a + steps_per_epoch])
                 for a in range(0, len(losses), steps_per_epoch)]
    return {"steps": step, "total_steps": total_steps, "steps_per_epoch": steps_per_epoch, "epochs": epochs,
            "train_loss": per_epoch[-1] if per_epoch else None, "loss_per_epoch": per_epoch,
            "tokens_seen": tokens_seen, "seconds": seconds, "seconds_this_call": here, "snapshots": snaps,
            "resumed_from": resumed,
            "finished": step >= total_steps}
