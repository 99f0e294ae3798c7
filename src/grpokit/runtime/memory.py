"""The C allocator's settings for training."""

from __future__ import annotations

import ctypes
import sys


def keep_freed_memory() -> bool:
    """Have glibc's malloc keep freed memory for reuse; True if it took the settings (Linux with glibc).

    A training step allocates and frees the same large tensors every step. By default glibc returns
    the top of its heap to the system when much of it is free, and serves allocations above a moving
    threshold (128 KB at first) with fresh mappings, so the next step takes the memory back one zeroed
    4 KB page at a time: thousands of page faults per update (docs/memory.md). Here allocations up to
    32 MB (glibc's largest threshold) come from the heap, and the heap is trimmed only beyond 1 GB free.
    """
    if not sys.platform.startswith("linux"):
        return False
    try:
        mallopt = ctypes.CDLL(None).mallopt  # the C library the process already runs
    except (OSError, AttributeError):  # a C library without mallopt (musl)
        return False
    trim_threshold, mmap_threshold = -1, -3  # M_TRIM_THRESHOLD, M_MMAP_THRESHOLD in malloc.h
    # Both, or neither: setting one stops glibc from raising the mmap threshold by itself.
    return bool(mallopt(mmap_threshold, 32 << 20)) and bool(mallopt(trim_threshold, 1 << 30))
