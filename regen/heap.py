"""Giving the host memory a phase of `regen profile` freed back to the system before the next phase begins.

On Linux, glibc's malloc keeps the pages of freed heap blocks that lie between blocks still in use, and
raises its threshold for returning large blocks as a program frees them. The recorded step and the liveness
probe each allocate a step's worth of tensors, records and copies in their own pattern, so each phase met
the heap the one before left, full of free pages no later allocation of other sizes fitted: on a 32-layer
Llama profiling's resident memory grew 750 MiB past what the phases held at once (and the calibration's
solves leave their own heap to its planned steps). `malloc_trim` returns
those pages (torch's CPU tensors come from the same heap); elsewhere (another C library, macOS, Windows)
there is nothing to call and nothing is done.
"""

from __future__ import annotations

import ctypes
import functools


def give_back_freed_host_memory() -> None:
    """Return the heap's free pages to the system, where the C library can (glibc's malloc_trim)."""
    trim = _malloc_trim()
    if trim is not None:
        trim(0)


@functools.cache
def _malloc_trim():
    """glibc's malloc_trim from the C library already loaded in this process (no search for the library, which
    runs a subprocess on Linux), or None."""
    try:
        return ctypes.CDLL(None).malloc_trim
    except (OSError, AttributeError, TypeError):  # another C library; Windows, which has no process handle
        return None
