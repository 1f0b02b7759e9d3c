"""The process's C heap: a large block goes back to the system when it is freed.

glibc serves a block below its mmap threshold from its heaps, and raises that threshold
to the largest block freed so far (up to 32 MiB), keeping up to twice as much freed heap
untrimmed.  A port that once read a 30 MiB request body so kept about 64 MiB it no
longer used (measured: `serve` went from 61 to 122 MiB over twenty such requests, and
stayed there; 62 MiB with the threshold fixed).  A fixed threshold turns that off:
blocks of `MMAP_THRESHOLD` or more are mapped when made and unmapped when freed (a page
fault per 4 KiB, about 0.2 ms a MiB, on bodies that take longer than that to arrive).
Elsewhere than glibc, nothing is changed.
"""

from __future__ import annotations

import ctypes
import sys

__all__ = ["MMAP_THRESHOLD", "return_large_blocks"]

#: Blocks of this many bytes or more are given back to the system when freed.
MMAP_THRESHOLD = 1 << 20
#: glibc's `mallopt` parameter for it (malloc.h).
_M_MMAP_THRESHOLD = -3


def return_large_blocks() -> bool:
    """Fix glibc's mmap threshold at `MMAP_THRESHOLD` for this process; whether it was
    (False with another C library)."""
    if not sys.platform.startswith("linux"):
        return False
    try:
        mallopt = ctypes.CDLL(None).mallopt  # the process's own C library
    except (OSError, AttributeError):
        return False
    mallopt.argtypes = (ctypes.c_int, ctypes.c_int)
    mallopt.restype = ctypes.c_int
    return bool(mallopt(_M_MMAP_THRESHOLD, MMAP_THRESHOLD))
