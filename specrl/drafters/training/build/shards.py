"""Rollout shards on disk: the drafter build's training data, written so a killed build loses at most one shard.

A build's rollouts live in `DIR/shard-NNNNN.jsonl`, shard i holding the rollouts of prompts
[i * shard_size, (i + 1) * shard_size) of the build's prompt list, one JSON row per sequence
(`{"id": global index, "prompt_ids": [...], "response_ids": [...], "finish": "stop"|"length"}`) and a last footer
row `{"footer": {"shard": i, "rows": n, "tokens": t, "sha256": ...}}` whose hash covers every row above it. A
shard is written under a temporary name and renamed when complete, so a file under a shard's name is whole by
construction; `check_shard` re-reads it and verifies the footer, which catches a file damaged after the fact. A
rollout's sampling seed derives from (seed, its global index, position) in the engine, so a shard rebuilt after a
kill or a failed check holds exactly the rows it held before: nothing is duplicated, lost or re-drawn.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from specrl.errors import SpecRLError
from specrl.fileio import atomic_write

SHARD_GLOB = "shard-*.jsonl"


def shard_path(root: Path, index: int) -> Path:
    return Path(root) / f"shard-{index:05d}.jsonl"


@dataclass(frozen=True)
class ShardInfo:
    index: int
    rows: int
    tokens: int  # response tokens
    sha256: str


class CorruptShard(SpecRLError):
    """A shard file whose content does not match its footer (or has none): named, so the build rebuilds it."""


def _row_bytes(row: dict) -> bytes:
    return (json.dumps(row, separators=(",", ":")) + "\n").encode()


def write_shard(root: Path, index: int, rows: list[dict]) -> ShardInfo:
    """Write shard `index` atomically (temporary file, then rename) with its footer; return its info."""
    h = hashlib.sha256()
    body = b"".join(_row_bytes(r) for r in rows)
    h.update(body)
    info = ShardInfo(index, len(rows), sum(len(r["response_ids"]) for r in rows), h.hexdigest())
    footer = {"footer": {"shard": index, "rows": info.rows, "tokens": info.tokens, "sha256": info.sha256}}
    Path(root).mkdir(parents=True, exist_ok=True)
    with atomic_write(shard_path(root, index), "wb") as f:
        f.write(body + _row_bytes(footer))
    return info


def check_shard(path: Path, expect_rows: int | None = None) -> ShardInfo:
    """Verify a shard against its footer (and, if given, its expected row count); raise `CorruptShard` naming
    the file and what is wrong."""
    try:
        lines = Path(path).read_bytes().splitlines(keepends=True)
    except OSError as e:
        raise CorruptShard(f"shard {path} cannot be read ({e})") from None
    if not lines:
        raise CorruptShard(f"shard {path} is empty (expected rows and a footer)")
    try:
        footer = json.loads(lines[-1])["footer"]
        index, rows, sha = int(footer["shard"]), int(footer["rows"]), str(footer["sha256"])
    except (json.JSONDecodeError, KeyError, TypeError, ValueError):
        raise CorruptShard(f"shard {path} has no valid footer line (a truncated or foreign file)") from None
    body = b"".join(lines[:-1])
    got = hashlib.sha256(body).hexdigest()
    if got != sha:
        raise CorruptShard(f"shard {path}: sha256 {got[:12]}… does not match its footer's {sha[:12]}…")
    if len(lines) - 1 != rows or (expect_rows is not None and rows != expect_rows):
        raise CorruptShard(f"shard {path} holds {len(lines) - 1} rows, footer says {rows}"
                           + (f", the build expects {expect_rows}" if expect_rows is not None else ""))
    if Path(path).name != shard_path(Path(path).parent, index).name:
        raise CorruptShard(f"shard {path}'s footer names shard {index}")
    tokens = 0
    for ln in lines[:-1]:
        tokens += len(json.loads(ln)["response_ids"])
    return ShardInfo(index, rows, tokens, sha)


def read_shard(path: Path) -> Iterator[dict]:
    """The rows of a checked shard (call `check_shard` first)."""
    lines = Path(path).read_bytes().splitlines()
    for ln in lines[:-1]:
        yield json.loads(ln)


def data_hash(infos: list[ShardInfo]) -> str:
    """One sha256 over the shards' hashes in order: the build's data identity (the manifest's data hash)."""
    h = hashlib.sha256()
    for i in sorted(infos, key=lambda s: s.index):
        h.update(f"{i.index}:{i.sha256}\n".encode())
    return h.hexdigest()


def collect_rollouts(target, prompts: list[list[int]], root: Path, params, shard_size: int, batch_size: int = 32,
                     progress: bool = True, log=print) -> list[ShardInfo]:
    """Generate the rollouts of every prompt into shards under `root`, skipping shards that are already whole.

    A shard that fails `check_shard` is named, deleted and generated again. Returns every shard's info in order.
    """
    from specrl.rollout.engine import RolloutEngine
    from specrl.rollout.protocol import RolloutRequest

    if shard_size < 1:
        raise SpecRLError(f"shard_size must be >= 1, got {shard_size!r}")
    root = Path(root)
    root.mkdir(parents=True, exist_ok=True)
    n_shards = -(-len(prompts) // shard_size)
    for stray in root.glob(SHARD_GLOB):
        if not stray.stem.split("-")[-1].isdigit() or int(stray.stem.split("-")[-1]) >= n_shards:
            raise SpecRLError(f"{stray} is not a shard of this build ({n_shards} shards of {shard_size} prompts); "
                              f"the directory {root} belongs to another recipe: use a new build directory")
    infos: dict[int, ShardInfo] = {}
    for i in range(n_shards):
        p = shard_path(root, i)
        if p.exists():
            expect = min(shard_size, len(prompts) - i * shard_size)
            try:
                infos[i] = check_shard(p, expect)
            except CorruptShard as e:
                log(f"[specrl] {e}: rebuilding it")
                p.unlink()
    todo = [i for i in range(n_shards) if i not in infos]
    bar = None
    if progress and todo:
        from tqdm import tqdm

        bar = tqdm(total=len(prompts), initial=sum(s.rows for s in infos.values()), desc="rollouts", unit="seq",
                   smoothing=0.05)
    engine = None
    for i in todo:
        lo, hi = i * shard_size, min(len(prompts), (i + 1) * shard_size)
        if engine is None:
            longest = max(len(p) for p in prompts)
            engine = RolloutEngine(target, max_batch_size=batch_size, max_seq_len=longest + params.max_new_tokens + 1)
        reqs = [RolloutRequest(list(prompts[j]), request_id=j) for j in range(lo, hi)]
        outs = engine.generate(reqs, params, progress=bar).outputs
        rows = [{"id": j, "prompt_ids": list(prompts[j]), "response_ids": o.token_ids, "finish": o.finish_reason}
                for j, o in zip(range(lo, hi), outs, strict=True)]
        infos[i] = write_shard(root, i, rows)
        if bar is not None:
            bar.set_postfix(shards=f"{len(infos)}/{n_shards}", tokens=sum(s.tokens for s in infos.values()))
    if bar is not None:
        bar.close()
    return [infos[i] for i in range(n_shards)]
