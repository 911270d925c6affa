"""Filling the file system under a run directory, to test that a full disk never stops training.

Only a small file system is filled (a tmpfs a test mounted): a folder with
more than ``MAX_FILL_BYTES`` free is refused, so a mistaken config cannot
fill a real disk.
"""
from __future__ import annotations

import errno
import os
from pathlib import Path

MAX_FILL_BYTES = 256 << 20
FILLER = "disk_fault.fill"
CHUNK = 1 << 16


def fill_disk(folder: Path) -> int:
    """Write ``folder/disk_fault.fill`` until the file system is full; the bytes written."""
    stats = os.statvfs(folder)
    free = stats.f_bavail * stats.f_frsize
    if free > MAX_FILL_BYTES:
        raise RuntimeError(f"fault_injector: refusing to fill {folder}: {free >> 20} MB free (more than "
                           f"{MAX_FILL_BYTES >> 20} MB: not a test's small tmpfs)")
    written = 0
    zeros = b"\0" * CHUNK
    fd = os.open(folder / FILLER, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        for size in (CHUNK, 4096, 1):  # down to the last byte, so even a partly filled page has no room
            while True:
                try:
                    written += os.write(fd, zeros[:size])
                except OSError as exc:
                    if exc.errno not in (errno.ENOSPC, errno.EDQUOT):
                        raise
                    break
    finally:
        os.close(fd)
    return written


def free_disk(folder: Path) -> None:
    """Remove what ``fill_disk`` wrote."""
    try:
        (folder / FILLER).unlink()
    except FileNotFoundError:
        pass
