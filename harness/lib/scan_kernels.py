"""The C inner loops of `harness scan` (``_scan_kernels.c``) when they were built, else ``None``.

The extension is optional: ``pip install`` compiles it where a C compiler and
the Python headers are present, and every caller keeps the numpy code that
gives the same arrays, bit for bit (``tests/lib/test_scan_kernels.py``), for
when it is not. ``HARNESS_SCAN_KERNELS=0`` turns it off (to compare, or to
rule it out).
"""
from __future__ import annotations

import os
from types import ModuleType


def _load() -> ModuleType | None:
    if os.environ.get("HARNESS_SCAN_KERNELS", "1") == "0":
        return None
    try:
        from harness.lib import _scan_kernels
    except ImportError:
        return None
    return _scan_kernels


KERNELS = _load()
