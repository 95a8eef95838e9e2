"""Build a drafter from in-domain rollouts: the body of `specrl draft init`.

`train_drafter_offline` generates rollouts of the target on the prompts it is given (or reads finished texts from a
JSONL file), trains an EAGLE or MTP drafter, or a draft model made of `draft_layers` of the target's layers, on them
(`training.train_drafter`), measures the held-out acceptance length with the real engine on prompts it did not
train on, and saves the drafter (`io.save_drafter`; a draft model as an HF checkpoint with the target's tokenizer,
loadable by transformers as an `assistant_model` too, see `save_draft_model`) with a `train_report.json` and the
training data (`data.jsonl`, reusable via data_jsonl).

Prompts come in one of three forms: prompt strings (rendered with the chat template), token-id lists, or a
callable tokenizer -> (train prompt ids, held-out prompt ids). The last is how a task's prompts arrive from the RL
layer (`specrl.drafters.storage.default.task_prompts`); this module knows nothing of tasks.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable, Sequence
from pathlib import Path

import torch

from specrl.drafters.kinds.draft_model import TOKENIZER_FILES, save_draft_model  # noqa: F401  (this module's API too)
from specrl.drafters.trainable import TrainableDrafter
from specrl.errors import SpecRLError
from specrl.rollout.drafter_spec import DRAFTER_KINDS

MIN_PROMPTS = 2  # some are held out for the acceptance measurement
MIN_SAMPLES = 2  # training holds one sequence out
HELDOUT_PROMPTS = 32  # prompts the held-out acceptance length is measured on
HELDOUT_SHARE = 10  # of given prompt lists, at most 1 in HELDOUT_SHARE is held out
ROLLOUT_BATCH = 32  # sequences generated at once for the training data

Prompts = Sequence[str] | Sequence[Sequence[int]] | Callable[[object], tuple[list[list[int]], list[list[int]]]]


def split_prompts(prompts: Prompts, tokenizer, samples: int, heldout: int = HELDOUT_PROMPTS
                  ) -> tuple[list[list[int]], list[list[int]]]:
    """(train prompt ids, held-out prompt ids) from any of the prompt forms (see the module docstring).

    From a list, the first max(1, min(heldout, len // HELDOUT_SHARE)) prompts are held out and up to `samples`
    of the rest train; a callable decides both itself (its train list is cut to `samples`).
    """
    if callable(prompts):
        got = prompts(tokenizer)
        if not (isinstance(got, (list, tuple)) and len(got) == 2):  # noqa: PLR2004 - a (train, held-out) pair
            raise SpecRLError("a prompt callable must return (train_prompt_ids, heldout_prompt_ids)")
        train, held = got
        if not train or not held:
            raise SpecRLError("the prompt callable returned no train or no held-out prompts; both are needed")
        return list(train)[:samples], list(held)
    if isinstance(prompts, str) or not isinstance(prompts, (list, tuple)):
        raise SpecRLError("prompts must be a list of prompt strings or token-id lists, or a callable tokenizer -> "
                          "(train ids, held-out ids); a task's prompts: "
                          "specrl.drafters.storage.default.task_prompts(name)")
    if len(prompts) < MIN_PROMPTS:
        raise SpecRLError(f"give at least {MIN_PROMPTS} prompt strings (some are held out for the acceptance "
                          "measurement)")
    if all(isinstance(p, (list, tuple)) for p in prompts):
        ids = [[int(t) for t in p] for p in prompts]
    else:
        from specrl.model.tokenizer import encode_chat

        ids = [encode_chat(tokenizer, str(t)) for t in prompts]
    n_held = max(1, min(heldout, len(ids) // HELDOUT_SHARE))
    return ids[n_held:][:samples], ids[:n_held]


def read_jsonl(path: Path) -> tuple[list[list[int]], list[int]]:
    """Rows {"prompt_ids": [...], "response_ids": [...]} -> (sequences, prompt lengths)."""
    if not path.exists():
        raise SpecRLError(f"data file {path} does not exist")
    seqs, plens = [], []
    for i, line in enumerate(path.read_text().splitlines()):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
            p, r = [int(t) for t in row["prompt_ids"]], [int(t) for t in row["response_ids"]]
        except (json.JSONDecodeError, KeyError, TypeError, ValueError) as e:
            raise SpecRLError(f"{path}:{i + 1}: expected a JSON object with integer lists prompt_ids and "
                              f"response_ids ({e})") from None
        seqs.append(p + r)
        plens.append(len(p))
    return seqs, plens


def build_kinds() -> dict[str, type[TrainableDrafter]]:
    """The kinds `specrl draft init` builds: the table's rows whose drafter class is a `TrainableDrafter`, the ones
    the learner can train online first (eagle, mtp, then draft-model)."""
    rows = sorted((k for k in DRAFTER_KINDS.values() if isinstance(k.drafter_class, type)
                   and issubclass(k.drafter_class, TrainableDrafter)), key=lambda k: not k.trainable)
    return {k.name: k.drafter_class for k in rows}


def train_drafter_offline(model: str = "smollm2-135m", drafter_kind: str = "eagle", prompts: Prompts | None = None,
                  samples: int = 512, epochs: int = 3, out: str | os.PathLike = "drafters/eagle",
                  data_jsonl: str | None = None, max_new_tokens: int = 160, temperature: float = 1.0,
                  draft_vocab_size: int = 8192, num_modules: int = 3, lr: float = 1e-3, batch_size: int = 8,
                  heldout: int = HELDOUT_PROMPTS, k: int = 3, seed: int = 0, progress: bool = True,
                  draft_layers: int = 4, source: str = "prompts", dtype: str | torch.dtype = "auto") -> Path:
    """Generate in-domain data, train a drafter, report held-out acceptance, save. Returns the directory.

    `source` names where the prompts came from (a task name, say) in `train_report.json`. `dtype` is the target's
    for the rollouts and the training features (auto: bf16 where the CPU has bf16 units, else fp32).
    """
    from specrl.device import processor_class
    from specrl.drafters.training.offline import heldout_acceptance, select_draft_vocab, train_drafter
    from specrl.model.loader import load_model
    from specrl.model.tokenizer import stop_token_ids
    from specrl.rollout.engine import RolloutEngine
    from specrl.rollout.sampling import SamplingParams

    kinds = build_kinds()
    if not isinstance(drafter_kind, str) or drafter_kind not in kinds:
        names = [repr(k) for k in kinds]
        raise SpecRLError(f"unknown drafter kind {drafter_kind!r}; `specrl draft init` trains "
                          f"{', '.join(names[:-1])} or {names[-1]}")
    cls = kinds[drafter_kind]
    if not isinstance(samples, int) or samples < MIN_SAMPLES:
        raise SpecRLError(f"samples must be an integer >= {MIN_SAMPLES}, got {samples!r}")
    out = Path(out)
    if out.exists() and (not out.is_dir() or (any(out.iterdir()) and not (out / "config.json").is_file())):
        what = "a file" if not out.is_dir() else "a non-empty directory that holds no drafter (no config.json)"
        raise SpecRLError(f"out={str(out)!r} is {what}; the drafter's files would be mixed into it. Pass a new "
                          "directory (or an earlier drafter's, to replace it)")
    target, tokenizer = load_model(model, dtype=dtype)
    cls.check_build(target, draft_layers=draft_layers, num_modules=num_modules)
    if prompts is None:
        raise SpecRLError("give the prompts to build the drafter from (prompt strings, token-id lists, or a "
                          "callable tokenizer -> (train ids, held-out ids))")
    token_ids = isinstance(prompts, (list, tuple)) and bool(prompts) and \
        all(isinstance(p, (list, tuple)) for p in prompts)
    if tokenizer is None and not token_ids:
        raise SpecRLError(f"{model} has no tokenizer; draft init needs one to render prompts")
    stops = stop_token_ids(tokenizer, target.args)
    train_prompts, val_prompts = split_prompts(prompts, tokenizer, samples, heldout)
    sp = SamplingParams(temperature=temperature, max_new_tokens=max_new_tokens, stop_token_ids=stops, seed=seed)
    out.mkdir(parents=True, exist_ok=True)
    if data_jsonl is not None:
        seqs, plens = read_jsonl(Path(data_jsonl))
    else:
        longest = max(len(p) for p in train_prompts)
        engine = RolloutEngine(target, max_batch_size=ROLLOUT_BATCH, max_seq_len=longest + max_new_tokens + 1)
        bar = None
        if progress:
            from tqdm import tqdm

            bar = tqdm(total=len(train_prompts), desc="rollouts", unit="seq")
        outs = engine.generate(train_prompts, sp, progress=bar)
        if bar is not None:
            bar.close()
        seqs = [p + o.token_ids for p, o in zip(train_prompts, outs, strict=True)]
        plens = [len(p) for p in train_prompts]
        with open(out / "data.jsonl", "w") as f:
            for p, o in zip(train_prompts, outs, strict=True):
                f.write(json.dumps({"prompt_ids": p, "response_ids": o.token_ids}) + "\n")
    # the most frequent response tokens: EAGLE's head, and what a draft model drafts over (None: full vocabulary)
    vocab = None if draft_vocab_size >= target.args.vocab_size else \
        select_draft_vocab([s[n:] for s, n in zip(seqs, plens, strict=True)], draft_vocab_size, always=stops)
    torch.manual_seed(seed)  # the fresh drafter's initial weights: two builds with the same arguments agree
    drafter = cls.untrained(target, draft_vocab=vocab, num_modules=num_modules, draft_layers=draft_layers)
    torch.manual_seed(seed)
    result = train_drafter(drafter, target, seqs, epochs=epochs, lr=lr, batch_size=batch_size, progress=progress,
                           prompt_lens=plens, seed=seed)
    drafter = drafter.after_training(vocab)  # a draft model trained over the full vocabulary drafts over `vocab`
    acc = heldout_acceptance(target, drafter, val_prompts, k=min(k, getattr(drafter, "num_modules", k)),
                             temperature=temperature, max_new_tokens=max_new_tokens, stop_token_ids=stops, seed=seed)
    drafter.save_built(out, target, model)
    report = {**result, "heldout_acceptance_length": acc, "k": k, "temperature": temperature, "model": str(model),
              "task": source, "samples": len(seqs),
              "draft_layers": None,
              "tokens": sum(len(s) for s in seqs), "target_dtype": str(target.dtype).removeprefix("torch."),
              "processor_class": processor_class(),
              "draft_vocab_size": None if getattr(drafter, "d2t", None) is None else int(drafter.d2t.numel()),
              **drafter.build_report()}
    (out / "train_report.json").write_text(json.dumps(report, indent=2) + "\n")
    if progress:
        print(f"[specrl] {drafter_kind} drafter -> {out}: held-out acceptance length {acc:.2f} at k={k}, "
              f"T={temperature} (held-out top-1 {result['heldout_top1']:.2f})", flush=True)
    return out
