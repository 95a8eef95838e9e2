"""Stage 2 of `specrl draft build`: the target's features and top-K distributions of every rollout shard, on disk.

For rollout shard i (`shards.py`) the target runs once, no grad, over each prompt + response and
`WORK/features/feat-NNNNN.safetensors` keeps what an EAGLE head learns from, concatenated over the shard's rows:
`tokens` [N] int32, `offsets` [rows + 1] int64 (row r is tokens[offsets[r]:offsets[r+1]]), `loss_from` [rows]
int32 (the prompt length: earlier positions are context only), `feats` [N, 3H] in the target's dtype (bf16 on
CPUs with bf16 units: the three fused layers EAGLE-3 reads, exactly what the engine feeds it), `top_ids` [N, K]
int32 target ids and `top_p` [N, K] float16 (the target's top-K next-token distribution) and `top1` [N] int32.
The file's metadata names the rollout shard's sha256, K and the fused layers, so a feature file is reused only for
the shard and settings it was made from; it is written atomically, so a killed stage loses at most the shard in
progress, and a file that cannot be read back is named and extracted again. Target ids, not draft-vocabulary
indices, are stored, so the draft vocabulary can be chosen afterwards (`fit.py`).
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from specrl.drafters.training.build.shards import ShardInfo, read_shard, shard_path
from specrl.errors import SpecRLError
from specrl.fileio import temp_path

FEATURE_TENSORS = ("tokens", "offsets", "loss_from", "feats", "top_ids", "top_p", "top1")


def feature_path(root: Path, index: int) -> Path:
    return Path(root) / f"feat-{index:05d}.safetensors"


@dataclass(frozen=True)
class FeatureInfo:
    index: int
    shard_sha256: str
    rows: int
    tokens: int  # prompt + response tokens
    response_tokens: int


def _meta(path: Path) -> dict | None:
    """The metadata of a readable feature file, or None when it is missing, truncated or foreign."""
    try:
        with safe_open(str(path), "pt") as f:
            meta = f.metadata() or {}
            if set(FEATURE_TENSORS) - set(f.keys()):
                return None
        return {k: json.loads(v) for k, v in meta.items()}
    except Exception:  # safetensors raises its own error types for a damaged header
        return None


def _current(path: Path, shard: ShardInfo, topk: int, layers: tuple[int, ...]) -> FeatureInfo | None:
    m = _meta(path) if path.exists() else None
    if m is None or m.get("shard_sha256") != shard.sha256 or m.get("topk") != topk or \
            m.get("layers") != list(layers):
        return None
    return FeatureInfo(shard.index, shard.sha256, m["rows"], m["tokens"], m["response_tokens"])


def extract_shard(target, rollouts: Path, out: Path, shard: ShardInfo, layers: tuple[int, ...], topk: int,
                  batch_size: int = 8) -> FeatureInfo:
    """The features of one rollout shard into `out/feat-NNNNN.safetensors` (atomically)."""
    from specrl.drafters.training.offline import target_outputs

    rows = list(read_shard(shard_path(rollouts, shard.index)))
    seqs = [r["prompt_ids"] + r["response_ids"] for r in rows]
    plens = [len(r["prompt_ids"]) for r in rows]
    got: list = [None] * len(seqs)
    for i, tok, captured, _h, top_i, top_p, top1 in target_outputs(target, seqs, tuple(layers), batch_size, topk):
        got[i] = (tok, torch.cat([captured[j] for j in layers], -1), top_i, top_p, top1)
    lens = torch.tensor([len(s) for s in seqs])
    state = {
        "tokens": torch.cat([g[0] for g in got]).int(), "offsets": torch.cat([torch.zeros(1), lens.cumsum(0)]).long(),
        "loss_from": torch.tensor(plens, dtype=torch.int32), "feats": torch.cat([g[1] for g in got]).contiguous(),
        "top_ids": torch.cat([g[2] for g in got]).int(), "top_p": torch.cat([g[3] for g in got]).half(),
        "top1": torch.cat([g[4] for g in got]).int(),
    }
    info = FeatureInfo(shard.index, shard.sha256, len(rows), int(lens.sum()), shard.tokens)
    meta = {"shard_sha256": shard.sha256, "topk": topk, "layers": list(layers), "rows": info.rows,
            "tokens": info.tokens, "response_tokens": info.response_tokens,
            "dtype": str(state["feats"].dtype).removeprefix("torch.")}
    out.mkdir(parents=True, exist_ok=True)
    final = feature_path(out, shard.index)
    tmp = temp_path(final)
    try:
        save_file(state, str(tmp), metadata={k: json.dumps(v) for k, v in meta.items()})
        os.replace(tmp, final)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    return info


def current_features(out: Path, shards: list[ShardInfo], layers: tuple[int, ...], topk: int,
                     fix: str) -> list[FeatureInfo]:
    """The feature files of `shards` under `out`, each current for its shard and settings; a SpecRLError naming
    the first that is missing or stale and `fix` (what makes it) otherwise. Nothing is extracted."""
    infos = []
    for s in shards:
        p = feature_path(out, s.index)
        cur = _current(p, s, topk, layers)
        if cur is None:
            what = "missing" if not p.exists() else (f"unreadable or made from another shard or settings (this build "
                                                      f"reads top-K {topk}, layers {list(layers)})")
            raise SpecRLError(f"{p} is {what}; run {fix} first")
        infos.append(cur)
    return infos


def extract_features(target, rollouts: Path, out: Path, shards: list[ShardInfo], layers: tuple[int, ...],
                     topk: int, batch_size: int = 8, progress: bool = True, log=print) -> list[FeatureInfo]:
    """Features of every shard in `shards`, skipping those already extracted from the same shard and settings."""
    infos: dict[int, FeatureInfo] = {}
    for s in shards:
        p = feature_path(out, s.index)
        cur = _current(p, s, topk, layers)
        if cur is not None:
            infos[s.index] = cur
        elif p.exists():
            log(f"[specrl] {p} is unreadable or was made from another shard or settings: extracting it again")
    todo = [s for s in shards if s.index not in infos]
    bar = None
    if progress and todo:
        from tqdm import tqdm

        bar = tqdm(total=sum(s.rows for s in shards), initial=sum(i.rows for i in infos.values()),
                   desc="target features", unit="seq", smoothing=0.05)
    for s in todo:
        infos[s.index] = extract_shard(target, rollouts, out, s, layers, topk, batch_size)
        if bar is not None:
            bar.update(s.rows)
            bar.set_postfix(shards=f"{len(infos)}/{len(shards)}")
    if bar is not None:
        bar.close()
    return [infos[s.index] for s in shards]


@dataclass
class ShardFeatures:
    """One feature file in memory (the tensors of `FEATURE_TENSORS`)."""

    tokens: torch.Tensor
    offsets: torch.Tensor
    loss_from: torch.Tensor
    feats: torch.Tensor
    top_ids: torch.Tensor
    top_p: torch.Tensor
    top1: torch.Tensor


def load_features(path: Path) -> ShardFeatures:
    from safetensors.torch import load

    try:  # read into memory (not a map of the file: the tensors stay valid whatever happens to it)
        state = load(Path(path).read_bytes())
    except Exception as e:
        raise SpecRLError(f"feature file {path} cannot be read ({type(e).__name__}: {e}); delete it and run the "
                          "build again to extract it anew") from None
    missing = set(FEATURE_TENSORS) - set(state)
    if missing:
        raise SpecRLError(f"feature file {path} lacks {', '.join(sorted(missing))}; delete it and run the build again")
    return ShardFeatures(**{k: state[k] for k in FEATURE_TENSORS})
