"""Glibc's heap between phases of work: given back after one (`regen profile`), or kept for the next (benches).

On Linux, glibc's malloc keeps the pages of freed heap blocks that lie between blocks still in use, and
raises its threshold for returning large blocks as a program frees them. The recorded step and the liveness
probe each allocate a step's worth of tensors, records and copies in their own pattern, so each phase met
the heap the one before left, full of free pages no later allocation of other sizes fitted: on a 32-layer
Llama profiling's resident memory grew 750 MiB past what the phases held at once (and the calibration's
solves leave their own heap to its planned steps). `malloc_trim` returns
those pages (torch's CPU tensors come from the same heap); elsewhere (another C library, macOS, Windows)
there is nothing to call and nothing is done.

The other way round, a benchmark that times variants of a step one after another wants each step to meet
the heap alike: by default glibc returns large freed blocks to the system and maps them again, zeroed, at
the next step, and how much of that a step pays depends on the step before it (a CPU Mistral's
checkpointing step measured 6% apart from the same step of a second instance, by their places in the
round; the unplanned step paid ~10% in page faults). `keep_freed_host_memory` fixes the thresholds so freed
blocks stay in the heap, as a GPU's caching allocator keeps device memory: identical steps then measured
0.2-1.8% apart (three runs of 30 rounds).
"""

from __future__ import annotations

import ctypes
import functools


def give_back_freed_host_memory() -> None:
    """Return the heap's free pages to the system, where the C library can (glibc's malloc_trim)."""
    trim = _libc_function("malloc_trim")
    if trim is not None:
        trim(0)


MMAP_THRESHOLD_BYTES = 32 * 2**20  # glibc's largest: blocks above it are mapped on their own, whatever the setting
TRIM_THRESHOLD_BYTES = 2**31 - 1  # mallopt's largest (an int): the heap's free top stays, up to 2 GiB
_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3  # mallopt's parameter numbers (malloc.h)


def keep_freed_host_memory() -> bool:
    """From now on, keep freed host memory in the heap for the process's next allocations (fixed glibc
    thresholds); False where the C library has no `mallopt` (nothing changed)."""
    mallopt = _libc_function("mallopt")
    if mallopt is None:
        return False
    mallopt.argtypes = [ctypes.c_int, ctypes.c_int]
    return bool(mallopt(_M_MMAP_THRESHOLD, MMAP_THRESHOLD_BYTES)) and bool(
        mallopt(_M_TRIM_THRESHOLD, TRIM_THRESHOLD_BYTES))


@functools.cache
def _libc_function(name: str):
    """glibc's function `name` from the C library already loaded in this process (no search for the library,
    which runs a subprocess on Linux), or None."""
    try:
        return getattr(ctypes.CDLL(None), name)
    except (OSError, AttributeError, TypeError):  # another C library; Windows, which has no process handle
        return None
