"""Appending lines to a file through a shared memory mapping: no system call per line, nothing lost to a kill.

The data ledger gets a line per optimizer step on every rank. A ``write``
per line keeps every line through a ``kill -9``, but the system call runs
between two steps with the kernel's code and data out of the caches: about
35-40 us in place on a 2-core machine (0.5 us in a tight loop), the largest
single item of the harness's time per step. Buffering in the process would
lose the buffer to a kill. (``steps.jsonl`` buffers ten steps anyway: its
cost is the encoding, not the write.)

:class:`MappedLines` copies each line into a shared mapping of the file's
tail instead. The mapped pages are the file's own page-cache pages: another
process reads the line at once, and the kernel keeps it when the process is
killed (the same durability as a ``write`` without ``fsync``; ``sync`` is
the ``fsync``). A mapped page that cannot be written faults (``SIGBUS``, which kills the
process) where a ``write`` would return an error, so the mapping is kept to
where that cannot happen on a healthy disk: only pages this writer
allocated itself are mapped (``posix_fallocate`` first: a full disk or
quota fails there, as an error; the partly filled page the file already
had, which a reflink copy may share with another file, is written with
``write``), and only on the local file systems whose fault on an allocated
block needs no new space (ext2/3/4, XFS, tmpfs: ``MAPPABLE_FS``).
Elsewhere (btrfs reserves space at the fault; overlayfs may sit on it;
network file systems; no ``posix_fallocate``; a failed allocation) the file
gets one ``write`` per line, as before.

While the file is open, and after a kill, it ends in the unwritten rest of
the window: NUL bytes after the last line, without a newline. JSON text
never holds a raw NUL, and a reader of JSONL skips a last line without a
newline (a torn line), so the readers need no change; ``close`` cuts the
NULs off, and the next writer of the file cuts off what a killed one left.

Only the one writer that holds the file's lock (``flock``) maps and trims
it, and only in the process that opened it: a forked child (a DataLoader
worker) closes its inherited copy at the fork, so it neither trims the
file nor keeps the lock alive after its parent is killed. A second live
writer of the same file appends with one ``write`` per line at the file's
end and cuts nothing; the owner stops mapping when it sees the file grown
past its window, so no mapping reaches another writer's lines or past the
end of its file.
"""
from __future__ import annotations

import errno
import mmap
import os
from collections import deque
import weakref
from pathlib import Path

from harness.core.appendfile import attempt_write, ends_torn

try:
    import fcntl
except ImportError:  # not POSIX: no shared-mapping writer either (no posix_fallocate)
    fcntl = None  # type: ignore[assignment]

MAPPABLE_FS = frozenset({"ext2", "ext3", "ext4", "xfs", "tmpfs"})
WINDOW = 1 << 20  # bytes mapped (and allocated ahead) at a time: about 4,000 steps of ledger, one remap each
_BLOCK = 1 << 16  # bytes read at a time when looking for the end of a killed writer's lines


def written_end(fd: int) -> int:
    """The length of the file without the NUL bytes at its end (what a killed mapped writer did not fill)."""
    end = os.fstat(fd).st_size
    while end > 0:
        start = max(0, end - _BLOCK)
        block = os.pread(fd, end - start, start).rstrip(b"\0")
        if block:
            return start + len(block)
        end = start
    return 0


_OPEN: weakref.WeakSet[MappedLines] = weakref.WeakSet()  # the writers open in this process (for the fork handler)


def _after_fork_in_child() -> None:
    """A forked child drops its copies of the open writers: no trim of the parent's file, no lock kept alive by it."""
    for writer in list(_OPEN):
        writer._forget()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_after_fork_in_child)


def reopen_removed_lines() -> list[Path]:
    """Every line writer of this process whose file was removed (a run directory deleted mid-run), writing a new file
    at its path now; their paths."""
    return [writer.path for writer in list(_OPEN) if writer.reopen_if_removed()]


def file_system(path: str | os.PathLike[str]) -> str | None:
    """The type of the file system holding ``path`` (Linux's ``/proc/self/mountinfo``; None where it cannot be told)."""
    target = os.path.realpath(path)
    best, found = -1, None
    try:
        with open("/proc/self/mountinfo", encoding="utf-8", errors="replace") as handle:
            for line in handle:
                fields, _, tail = line.partition(" - ")
                parts = fields.split()
                if len(parts) < 5 or not tail:
                    continue
                mount = parts[4].replace("\\040", " ").replace("\\011", "\t").replace("\\012", "\n").replace("\\134", "\\")
                inside = target == mount or target.startswith(mount.rstrip("/") + "/")
                if inside and len(mount) >= best:  # the longest (and, among equals, the last mounted) mount point wins
                    best, found = len(mount), tail.split()[0]
    except OSError:
        return None
    return found


def _lock(fd: int) -> bool:
    """Take the file's writer lock without waiting; False when another live writer holds it."""
    if fcntl is None:
        return False
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:  # held by another writer, or a file system without flock: one write per line, nothing cut
        return False
    return True


class MappedLines:
    """An append-only line file written through a shared mapping of its tail (or one ``write`` per line where none can be made)."""

    def __init__(self, path: str | os.PathLike[str], window: int = WINDOW) -> None:
        """Opens ``path`` for appending: a killed writer's unwritten NULs are cut off and a torn last line is closed with a
        newline first, so the first new line starts on a line of its own (``appendfile.LineAppender`` does the same)."""
        self.path = Path(path)
        self._window = max(mmap.ALLOCATIONGRANULARITY, window - window % mmap.ALLOCATIONGRANULARITY)
        # never through a link, never a hard-linked file (refused at attach: ``harness.lib.rundir.refuse_links``)
        self._fd: int | None = os.open(self.path, os.O_RDWR | os.O_CREAT | getattr(os, "O_CLOEXEC", 0) | getattr(os, "O_NOFOLLOW", 0), 0o644)
        if os.fstat(self._fd).st_nlink > 1:
            os.close(self._fd)
            self._fd = None
            raise OSError(errno.EMLINK, f"{self.path} is a hard link shared with another file: the ledger does not write it")
        self._map: mmap.mmap | None = None
        self._base = 0  # file offset of the mapping's first byte
        self._room = 0  # bytes the mapping holds
        self._pid = os.getpid()
        self._held: deque[bytes] = deque()  # lines a full disk refused, in order
        self.failure: OSError | None = None  # the last write's error, while writes fail (a full disk)
        _OPEN.add(self)
        self.owner = _lock(self._fd)  # the file's only live writer: it may map and trim
        # False where a fault could SIGBUS, and once a mapping could not be made
        self.mapped = self.owner and hasattr(os, "posix_fallocate") and file_system(self.path) in MAPPABLE_FS
        size = os.fstat(self._fd).st_size
        end = written_end(self._fd) if self.owner else size
        if end != size:
            os.ftruncate(self._fd, end)
        if ends_torn(self.path):  # the file is ``end`` long now
            os.pwrite(self._fd, b"\n", end)
            end += 1
        self.end = end  # bytes of lines in the file (the owner's count; a second writer appends at the file's end)
        self._own_pages_from = -(-end // mmap.ALLOCATIONGRANULARITY) * mmap.ALLOCATIONGRANULARITY  # allocated by this writer

    def write(self, data: bytes) -> None:
        """Append ``data`` (whole lines, newline-terminated): a copy into the mapping on the common path."""
        start = self.end - self._base
        stop = start + len(data)
        if self._map is not None and stop <= self._room and not self._held:
            self._map[start:stop] = data
            self.end += len(data)
            return
        self._held.append(data)
        self.drain()

    def _put(self, data: bytes) -> None:
        """``write`` without holding: into the mapping, or elsewhere; raises what the disk raises."""
        start = self.end - self._base
        if self._map is not None and start + len(data) <= self._room:
            self._map[start : start + len(data)] = data
            self.end += len(data)
            return
        self._write_elsewhere(data)

    @property
    def holding(self) -> int:
        """Lines a failed write (a full disk) left in memory, written by the next write or ``drain`` that succeeds."""
        return sum(chunk.count(b"\n") for chunk in self._held)

    def drain(self) -> bool:
        """Write what is held; never raises an ``OSError`` into training (``harness.core.appendfile.OUTAGES`` says it)."""
        return attempt_write(self, self._write_held)

    def _write_held(self) -> None:
        while self._held:
            before = self.end
            try:
                self._put(self._held[0])
            except OSError:
                if self.owner and self.end > before:  # a head written before the error: not written twice
                    self._held[0] = self._held[0][self.end - before :]
                raise
            self._held.popleft()

    def _write_elsewhere(self, data: bytes) -> None:
        """The mapping is full (or there is none yet): map the next window, else write to the file."""
        if self._fd is None:
            raise ValueError(f"{self.path}: write to a closed line file")
        if self.mapped and self.end < self._own_pages_from:
            head, data = data[:self._own_pages_from - self.end], data[self._own_pages_from - self.end:]
            self._write_plainly(head)  # the page the file had: never mapped (a reflink copy may share its block)
            if not data:
                return
        if self.mapped and self._remap(len(data)):
            self._put(data)
            return
        self._write_plainly(data)

    def _write_plainly(self, data: bytes) -> None:
        assert self._fd is not None
        at = self.end if self.owner else os.lseek(self._fd, 0, os.SEEK_END)
        written = 0
        while written < len(data):
            written += os.pwrite(self._fd, data[written:], at + written)
        self.end = at + len(data)

    def _remap(self, need: int) -> bool:
        """Map a window from the page holding the end, allocated on disk first; False (and no mapping from now on) if it fails."""
        assert self._fd is not None
        expected = self._base + self._room if self._map is not None else self.end  # the file's size if nobody else wrote
        self._unmap()
        if os.fstat(self._fd).st_size != expected:
            self.mapped, self.owner = False, False  # another writer appended: from now on, plain writes at the file's end
            return False
        base = self.end - self.end % mmap.ALLOCATIONGRANULARITY
        room = self._window
        while self.end - base + need > room:
            room += self._window
        try:
            os.posix_fallocate(self._fd, base, room)  # type: ignore[attr-defined]  # (guarded by self.mapped)
            self._map = mmap.mmap(self._fd, room, access=mmap.ACCESS_WRITE, offset=base)
        except (OSError, ValueError):
            self.mapped = False
            os.ftruncate(self._fd, self.end)  # the allocation may have grown the file (checked above: only this writer's)
            return False
        self._base, self._room = base, room
        return True

    def _unmap(self) -> None:
        if self._map is not None:
            self._map.close()
            self._map, self._room = None, 0

    def reopen_if_removed(self) -> bool:
        """When the file was removed under this writer (its folder deleted mid-run): close it and write a new one at
        the same path from now on (folders made again); True then. What the removed file held is gone with it."""
        if self._fd is None or os.getpid() != self._pid:
            return False
        try:
            if os.fstat(self._fd).st_nlink > 0:
                return False
        except OSError:
            return False
        held, self._held = self._held, deque()
        self.close()
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.__init__(self.path, self._window)  # type: ignore[misc]  # the same writer, on the new file
        self._held = held
        return True

    def sync(self) -> None:
        """Everything written is on disk (``fsync``; the mapped pages are the file's own)."""
        if self._fd is None:
            return
        if self._map is not None:
            self._map.flush()
        os.fsync(self._fd)

    def close(self, sync: bool = False) -> None:
        """Unmap, cut the unwritten rest of the window off, close (``fsync`` first with ``sync``)."""
        if self._fd is None:
            return
        if self._held and os.getpid() == self._pid:
            self.drain()  # the last chance for what a full disk held (lost if it still cannot be written)
        if os.getpid() != self._pid:  # a forked child's copy (where the fork handler did not run): not its file to cut
            self._forget()
            return
        fd, self._fd = self._fd, None
        _OPEN.discard(self)
        try:
            mapped_to = self._base + self._room if self._map is not None else None
            self._unmap()
            if mapped_to is not None and os.fstat(fd).st_size == mapped_to:
                os.ftruncate(fd, self.end)  # the unwritten rest of the window (nobody appended after it)
            if sync:
                os.fsync(fd)
        finally:
            os.close(fd)  # and the lock with it

    def _forget(self) -> None:
        """Drop this process's copy without touching the file (a forked child's: the parent still writes it)."""
        fd, self._fd, self._map, self._room = self._fd, None, None, 0
        _OPEN.discard(self)
        if fd is not None:
            os.close(fd)  # the child's reference only: the parent's lock and mapping stay

    def __del__(self) -> None:
        try:
            self.close()
        except Exception:  # noqa: BLE001 - at interpreter exit the modules may be gone; the next writer trims
            pass
