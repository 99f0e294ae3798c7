"""The calling thread's OpenMP helper threads, released: :func:`release_openmp_pool`.

Why it matters (``benchmarks/serving.py``: the fast decode path ~1.6x slower in a thread other than the main one):
GNU OpenMP (libgomp, which PyTorch's CPU builds ship) keeps a pool of helper threads *per thread* that has opened a
parallel region, and counts the helpers of every pool. When that count exceeds the CPUs the process may use, every
barrier of every parallel region spins 1,000 times instead of 300,000 before it sleeps in the kernel (libgomp's
"throttled" spin count, meant for oversubscribed machines). Decoding runs thousands of small parallel operators per
token, so its threads then sleep and wake at nearly every one: on 2 cores, one pool of the main thread (say, after a
rollout or a training step there) and one of the server's worker thread are already 3 threads, even while the main
thread waits. ``torch.set_num_threads`` in the worker changes nothing (the count is the pools', not the team's).

Releasing the pools that are idle brings the count back under the CPUs: OpenMP 5's ``omp_pause_resource_all``
frees the calling thread's pool (libgomp frees only the caller's own), and the thread's next parallel region
starts a new one (one thread started: microseconds).
"""

from __future__ import annotations

import ctypes
import functools
import os

OMP_PAUSE_SOFT = 1  # omp_pause_resource_t: free the threads, keep the settings


@functools.cache
def _libgomp() -> ctypes.CDLL | None:
    """The GNU OpenMP runtime already loaded in this process (torch's), or None (Intel's or LLVM's runtime, a build
    without OpenMP, another OS): never loaded here."""
    try:
        library = ctypes.CDLL("libgomp.so.1", mode=os.RTLD_NOLOAD | getattr(os, "RTLD_GLOBAL", 0))
        library.omp_pause_resource_all.argtypes = [ctypes.c_int]
        return library
    except (OSError, AttributeError):
        return None


def release_openmp_pool() -> bool:
    """Free the calling thread's idle OpenMP helper threads (its next parallel operator starts them again). True
    when they were freed; False where the runtime is not libgomp or refused (inside a parallel region)."""
    library = _libgomp()
    return library is not None and library.omp_pause_resource_all(OMP_PAUSE_SOFT) == 0
