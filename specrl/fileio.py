"""Atomic file and directory writes: readers see the old content or the new one, never a half-written file.

`atomic_write(path)` opens a temporary file next to `path` (same directory, so the rename stays on one file
system), and renames it over `path` with `os.replace` when the block finishes; if the block raises, the temporary
file is removed and `path` is untouched. `write_text_atomic` is the one-line form. `replace_dir(tmp, final)`
installs a directory that was built under a temporary name. Errors are the plain `OSError`s; callers turn them
into messages that say what to do.
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import IO, Any


def temp_path(path: str | Path) -> Path:
    """The temporary name `atomic_write` uses for `path`: hidden, next to it, unique per process."""
    path = Path(path)
    return path.with_name(f".{path.name}.tmp-{os.getpid()}")


@contextmanager
def atomic_write(path: str | Path, mode: str = "w", **open_kwargs: Any) -> Iterator[IO]:
    """Write `path` through a temporary file that replaces it only when the block completes."""
    path = Path(path)
    tmp = temp_path(path)
    try:
        with tmp.open(mode, **open_kwargs) as f:
            yield f
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def write_text_atomic(path: str | Path, text: str) -> None:
    """`Path.write_text`, atomically."""
    with atomic_write(path) as f:
        f.write(text)


def replace_dir(tmp: str | Path, final: str | Path) -> None:
    """Install the directory built at `tmp` as `final`, removing what was there."""
    shutil.rmtree(final, ignore_errors=True)
    os.replace(tmp, final)
