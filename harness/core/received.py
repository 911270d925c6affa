"""Opening a file a run directory supplies: never a link, never a FIFO or a device, never more than a cap.

A run directory may come from elsewhere (a copy, a tarball, a colleague's
upload). Read with a plain ``open()``, a FIFO named ``steps.jsonl`` blocks
the reader forever, a link to ``/dev/zero`` grows it without end, and a link
to a file outside the run reads what the run does not hold. Every reader of
a run directory's files goes through :func:`open_received` (JSON:
:func:`read_received_json`; JSONL: ``harness.core.jsonl.read_jsonl``): the
file is opened without following a link and without blocking, and must be a
regular file within its size cap; anything else is :class:`RefusedFile`,
whose message the readers turn into a note (the command still exits 0).
"""
from __future__ import annotations

import json
import os
import stat
from pathlib import Path
from typing import IO, Any

JSON_MAX_BYTES = 64 << 20  # run.json, run_card.json, a capture's metadata: a few KB to a few MB when healthy
JSONL_MAX_BYTES = 16 << 30  # a JSONL file is streamed: this caps the time a reader spends, not its memory
_FLAGS = os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_CLOEXEC", 0)


class RefusedFile(OSError):
    """A run directory's file the harness does not read (a link, not a regular file, too large); the message says which."""


def open_received(path: str | os.PathLike[str], max_bytes: int = JSON_MAX_BYTES) -> IO[bytes]:
    """``path`` opened for reading in binary, refused (:class:`RefusedFile`) unless it is a regular file of at most
    ``max_bytes``, reached without a link at its last component; FileNotFoundError when missing."""
    name = Path(path).name
    try:
        fd = os.open(path, _FLAGS)
    except OSError as exc:
        if os.path.islink(path):
            raise RefusedFile(f"{name} is a symbolic link: not followed (a received run directory is data)") from None
        if isinstance(exc, FileNotFoundError):
            raise
        raise RefusedFile(f"{name} could not be opened ({type(exc).__name__}: {exc.strerror or exc})") from None
    try:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode):
            mode = info.st_mode
            kind = ("a directory" if stat.S_ISDIR(mode) else "a FIFO" if stat.S_ISFIFO(mode)
                    else "a device" if stat.S_ISCHR(mode) or stat.S_ISBLK(mode) else "not a regular file")
            raise RefusedFile(f"{name} is {kind}: not read (a received run directory is data)")
        if info.st_size > max_bytes:
            raise RefusedFile(f"{name} is {info.st_size / 2**20:,.0f} MB, more than the {max_bytes / 2**20:,.0f} MB "
                              "the harness reads of it: not read")
    except BaseException:
        os.close(fd)
        raise
    return os.fdopen(fd, "rb")


def read_received_bytes(path: str | os.PathLike[str], max_bytes: int = JSON_MAX_BYTES) -> bytes:
    """The bytes of a received file (see :func:`open_received`), at most ``max_bytes`` even if it grows meanwhile."""
    with open_received(path, max_bytes) as handle:
        return handle.read(max_bytes + 1)[:max_bytes]


def read_received_json(path: str | os.PathLike[str], max_bytes: int = JSON_MAX_BYTES) -> Any:
    """The JSON value of a received file; RefusedFile, FileNotFoundError, or ValueError (not UTF-8, not JSON, too deep)."""
    data = read_received_bytes(path, max_bytes)
    try:
        return json.loads(data.decode("utf-8"))
    except RecursionError:
        raise ValueError(f"{Path(path).name} is nested too deep to read") from None
