"""Opening an append-only JSONL file so that the first new line never lands on a torn one.

A process killed in the middle of a write leaves the file's last line cut
short (no trailing newline). Every reader skips such a line, but a writer
that appends straight onto it glues its first record to the fragment, and
the reader then drops both: the resumed run's first finding, the ledger's
attempt header. ``open_append`` closes the fragment with a newline first, so
the fragment stays one unreadable line on its own and the new records start
on a fresh one. Every appender of the harness opens its file through it.
"""
from __future__ import annotations

import os
from pathlib import Path
from typing import IO


def ends_torn(path: str | os.PathLike[str]) -> bool:
    """True when ``path`` is a non-empty file whose last byte is not a newline."""
    try:
        with open(path, "rb") as handle:
            handle.seek(0, os.SEEK_END)
            if handle.tell() == 0:
                return False
            handle.seek(-1, os.SEEK_END)
            return handle.read(1) != b"\n"
    except (FileNotFoundError, IsADirectoryError):
        return False


def open_append(path: str | os.PathLike[str], encoding: str = "utf-8") -> IO[str]:
    """``open(path, "a")`` that first ends a torn last line with a newline (written and flushed at once)."""
    handle = open(Path(path), "a", encoding=encoding)
    if ends_torn(path):
        handle.write("\n")
        handle.flush()
    return handle
