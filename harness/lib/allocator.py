"""Keep freed memory in the process for reuse, instead of handing it back to the OS after every scan range.

Each range of `harness scan` allocates a few arrays of about a megabyte and
frees them. glibc's malloc serves such sizes with fresh mappings or trims
them off the heap top once freed, so every range faults its pages in again:
in a virtual machine that was a third of the scan's time. Raising the mmap
and trim thresholds lets the next range reuse the same pages. Elsewhere than
glibc (musl, macOS) this does nothing.
"""
from __future__ import annotations

import ctypes
import platform

_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3  # mallopt parameters, from glibc's malloc.h
_KEEP_BYTES = 64 << 20  # free memory kept at the heap top (the scan's working set is a few MB per range)
_LARGEST_FROM_HEAP = 32 << 20  # glibc's upper limit for the mmap threshold on 64-bit
_done: list[bool] = []


def keep_freed_memory() -> bool:
    """Raise glibc's trim and mmap thresholds once per process; True when they were set."""
    if _done:
        return _done[0]
    ok = False
    if platform.system() == "Linux" and platform.libc_ver()[0] == "glibc":
        try:
            libc = ctypes.CDLL("libc.so.6")
            ok = bool(libc.mallopt(_M_MMAP_THRESHOLD, _LARGEST_FROM_HEAP)) and bool(libc.mallopt(_M_TRIM_THRESHOLD, _KEEP_BYTES))
        except (OSError, AttributeError):
            ok = False
    _done.append(ok)
    return ok
