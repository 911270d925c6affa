"""What the benchmarks share: the environment set before the HF stack is imported (offline, the harness's defaults only)
and the timing of plugin hook calls."""
from __future__ import annotations

import ctypes
import ctypes.util
import os
import time
from typing import Any, Callable

# glibc's mallopt parameters (malloc.h)
_M_TRIM_THRESHOLD, _M_TOP_PAD, _M_MMAP_THRESHOLD = -1, -2, -3
_HEAP_BYTES = 1 << 30  # activations of the benchmark model are a few MB each: all stay on the heap


def offline_defaults() -> None:
    """No hub access, no tokenizer threads, and no harness config or plugin list leaking in from the shell."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    for var in ("HARNESS_CONFIG", "HARNESS_PLUGINS"):
        os.environ.pop(var, None)


def steady_allocator() -> str:
    """Keep every tensor allocation on glibc's heap, so that step times stop jumping between two levels.

    glibc serves large blocks with mmap below a threshold that it moves as
    blocks are freed. A run whose activations land above it maps and
    faults in fresh pages every step; one below reuses the heap. Which of
    the two a run gets depends on what was allocated and freed before it,
    so consecutive runs of the same Trainer differed by 10-20% (two levels,
    about 21.5 and 25.5 ms a step), far more than the overhead to measure. A
    fixed threshold and no trimming put both sides on the heap alike (one
    run here: per-round ratios' interquartile range 1.022-1.050 instead of
    0.97-1.10). Returns what was set, for the header.
    """
    name = ctypes.util.find_library("c")
    try:
        libc = ctypes.CDLL(name) if name else None
        mallopt = getattr(libc, "mallopt", None)
    except OSError:
        mallopt = None
    if mallopt is None:
        return "allocator: as the platform has it (no glibc mallopt)"
    for parameter, value in ((_M_MMAP_THRESHOLD, _HEAP_BYTES), (_M_TRIM_THRESHOLD, _HEAP_BYTES), (_M_TOP_PAD, 256 << 20)):
        mallopt(parameter, value)
    return "allocator: glibc heap only (mmap threshold fixed at 1 GiB, no trimming)"


def time_hook_calls(manager: Any, record: Callable[[str, str, dict[str, Any], float], None]) -> None:
    """Time every plugin hook call of ``manager`` through its call monitor: ``record(hook, plugin, kwargs, seconds)``
    after each, with the clock stopped before the benchmark's own bookkeeping."""
    manager.monitor_calls(record)
