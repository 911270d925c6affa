"""Appending to a file through a shared memory map: every record reaches the kernel without a system call.

A per-step record written with ``os.write`` costs a system call on the
training thread, and between two forward passes a cold one costs tens of
microseconds (the file system's write path is out of every cache by then).
A ``MAP_SHARED`` mapping of the file's tail is the kernel's page cache itself:
a record copied into it is as safe from a ``kill -9`` as a written one (the
kernel writes the pages back whether or not the process lives), for the cost
of a memory copy.

The file is extended a window at a time (zeros on blocks reserved up front,
so that a full disk fails the reservation, an error handled here, and never
the copy into the map, which would be a SIGBUS), so a killed writer
leaves the records followed by a run of NUL bytes without a newline: readers
that skip a last line lacking its newline (every JSONL reader of the harness
does) skip it, and the next ``MappedAppender`` on the file cuts it off before
it appends. ``close`` cuts the file to what was written; a writer still open
at exit, or dropped unclosed, is closed then. Where a window
cannot be reserved or mapped (a full disk, a file system without
``posix_fallocate`` or shared mappings, macOS), records go through
``pwrite`` from then on. Only this appender may shorten the file while it is
open: a mapped page past a cut end faults.
"""
from __future__ import annotations

import atexit
import mmap
import os
import weakref
from pathlib import Path

WINDOW = 1 << 16  # bytes mapped at a time (rounded up for a record longer than that): the most a killed writer leaves
_PAGE = mmap.ALLOCATIONGRANULARITY
_OPEN: "weakref.WeakSet[MappedAppender]" = weakref.WeakSet()  # closed at exit: a writer nobody closed (a plugin switched
# off mid-run never gets its run end) still leaves its file cut to the records, readable by any JSONL reader


@atexit.register
def _close_all() -> None:
    for appender in list(_OPEN):
        try:
            appender.close()
        except OSError:
            pass


class MappedAppender:
    """Appends bytes to one file; ``sync`` makes them durable, ``close`` cuts the file to its written length."""

    def __init__(self, path: str | os.PathLike[str]) -> None:
        self.path = Path(path)
        flags = os.O_RDWR | os.O_CREAT | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_CLOEXEC", 0)
        self._fd: int | None = os.open(self.path, flags, 0o644)  # never through a symlink
        self._map: mmap.mmap | None = None
        self._base = 0  # file offset of the mapped window
        self._mapped = True  # False once mapping failed: plain writes from then on
        self._pid = os.getpid()  # a forked child that exits normally must not cut the file its parent is still writing
        self.end = self._trim_tail()
        _OPEN.add(self)

    def _trim_tail(self) -> int:
        """The written length: the file without the NUL run a killed writer left; a torn last line gets its newline."""
        assert self._fd is not None
        size = os.fstat(self._fd).st_size
        end = size
        while end > 0:
            start = max(0, end - WINDOW)
            block = os.pread(self._fd, end - start, start)
            stripped = block.rstrip(b"\0")
            end = start + len(stripped)
            if stripped:
                break
        if end != size:
            os.ftruncate(self._fd, end)
        if end and os.pread(self._fd, 1, end - 1) != b"\n":
            os.pwrite(self._fd, b"\n", end)  # a line cut by a kill stays one unreadable line; the next record starts afresh
            end += 1
        return end

    def write(self, data: bytes) -> None:
        if self._fd is None:
            raise ValueError(f"{self.path}: write after close")
        if self._mapped and (self._map is None or self.end + len(data) > self._base + len(self._map)):
            self._remap(len(data))
        if self._map is None:
            while data:
                written = os.pwrite(self._fd, data, self.end)
                data, self.end = data[written:], self.end + written
            return
        start = self.end - self._base
        self._map[start : start + len(data)] = data
        self.end += len(data)

    def _remap(self, needed: int) -> None:
        """Map a fresh window from the page that holds the end (the file grows to cover it)."""
        assert self._fd is not None
        self._unmap()
        base = self.end - self.end % _PAGE
        length = max(WINDOW, -(-(self.end - base + needed) // _PAGE) * _PAGE)
        try:
            os.posix_fallocate(self._fd, base, length)  # blocks reserved: the copies into the map cannot run out of disk
            self._map = mmap.mmap(self._fd, length, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE, offset=base)
            self._base = base
        except (OSError, ValueError, AttributeError):  # full disk, no fallocate or shared mappings: plain writes from here
            self._map, self._mapped = None, False
            os.ftruncate(self._fd, self.end)  # no zeros left behind

    def _unmap(self) -> None:
        if self._map is not None:
            self._map.close()
            self._map = None

    def sync(self) -> None:
        """The records written so far on disk (a machine crash keeps them)."""
        if self._map is not None:
            self._map.flush()
        if self._fd is not None:
            os.fsync(self._fd)

    def close(self) -> None:
        if self._fd is None:
            return
        _OPEN.discard(self)
        fd, self._fd = self._fd, None
        try:
            if os.getpid() != self._pid:  # the inherited copy in a forked child: let go, leave the file to its writer
                self._unmap()
                return
            if self._map is not None:
                self._map.flush()
            self._unmap()
            os.ftruncate(fd, self.end)
            os.fsync(fd)
        finally:
            os.close(fd)

    def __del__(self) -> None:  # dropped unclosed during the run: the same as at exit
        try:
            self.close()
        except Exception:  # noqa: BLE001 - never raise from a finaliser
            pass

    def fileno(self) -> int:
        if self._fd is None:
            raise ValueError(f"{self.path}: closed")
        return self._fd
