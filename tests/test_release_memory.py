"""`specrl.cpu.release_free_memory` hands freed heap pages back to the kernel: after freeing every other one of many
small tensors (free chunks inside the heap, which glibc keeps), the process's RSS drops only when it runs."""

from __future__ import annotations

import sys

import psutil
import pytest
import torch

from specrl.cpu import release_free_memory

MB = 2**20


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's malloc_trim")
def test_freed_heap_pages_go_back_to_the_kernel():
    proc = psutil.Process()
    release_free_memory()
    keep, drop = [], []
    for i in range(4096):  # 64 KiB each, below glibc's mmap threshold: heap chunks, touched
        (keep if i % 2 else drop).append(torch.ones(16 * 1024))
    del drop  # 128 MiB of free chunks between live ones: glibc cannot shrink the heap's top over them
    before = proc.memory_info().rss
    assert release_free_memory() is True
    after = proc.memory_info().rss
    assert before - after > 64 * MB, (before / MB, after / MB)
    assert all(float(t[0]) == 1.0 for t in keep)  # the live tensors are untouched
