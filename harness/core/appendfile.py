"""Opening an append-only JSONL file so that the first new line never lands on a torn one.

A process killed in the middle of a write leaves the file's last line cut
short (no trailing newline). Every reader skips such a line, but a writer
that appends straight onto it glues its first record to the fragment, and
the reader then drops both: the resumed run's first finding, the ledger's
attempt header. :class:`LineAppender` closes the fragment with a newline
first, so the fragment stays one unreadable line on its own and the new
records start on a fresh one. Every appender of the harness writes through it
(the ledger's mapped writer, ``harness.core.mapped_lines``, does the same).

A full disk, a quota or an I/O error under the run directory must never stop
training: :class:`LineAppender` (findings, metrics, the tracker's journal)
holds what it cannot write, in order and bounded, and writes it once the
folder takes writes again; :data:`OUTAGES` says so on the console and keeps
the outage for the run's findings.
"""
from __future__ import annotations

import errno as errno_module
import logging
import os
import threading
import time
import weakref
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

log = logging.getLogger("harness")


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


# -- appending that never raises into training ---------------------------------------------------------------------

HOLD_BYTES = 8 << 20  # unwritten bytes one file holds in memory at most while its folder cannot be written (then: dropped)
RETRY_S = 5.0  # how often the step guard retries the held lines of a folder that could not be written


class Holder(Protocol):
    """A file writer that holds what it could not write (``LineAppender``, the ledger's ``MappedLines``)."""

    path: Path
    failure: OSError | None  # the error of the last write, while it failed

    @property
    def holding(self) -> int: ...

    def drain(self) -> bool: ...


@dataclass
class Outage:
    """A folder the harness could not write to, from the first failed write to the first one that succeeded again."""

    folder: str
    errno: int | None
    error: str
    since: float  # wall time of the first failure
    until: float | None = None  # wall time of the first write that succeeded again
    dropped: int = 0  # lines given up (more than HOLD_BYTES held by one file)
    files: set[str] = field(default_factory=set)


class Outages:
    """The process's write outages: held lines retried together, and outages over for the run to record as a finding."""

    def __init__(self) -> None:
        self.active: dict[str, Outage] = {}  # folder -> the outage going on there
        self.over: list[Outage] = []  # outages that ended, not yet recorded as findings (``take_over``)
        self._holding: weakref.WeakSet[Holder] = weakref.WeakSet()
        self._next_retry = 0.0
        self._lock = threading.RLock()  # appenders write from the training thread and from helper threads

    def failed(self, appender: Holder, exc: OSError) -> None:
        with self._lock:
            self._failed(appender, exc)

    def _failed(self, appender: Holder, exc: OSError) -> None:
        folder = str(appender.path.parent)
        outage = self.active.get(folder)
        if outage is None:
            outage = self.active[folder] = Outage(folder, exc.errno, exc.strerror or str(exc), time.time())
            if os.environ.get("RANK", "0") == "0":
                log.warning("harness: cannot write to %s (%s); training goes on, and the harness keeps what it writes "
                            "there in memory (up to %d MB a file) until it can write again.", folder, _errno_text(exc),
                            HOLD_BYTES >> 20)
        outage.files.add(appender.path.name)
        self._holding.add(appender)

    def dropped(self, appender: Holder, lines: int) -> None:
        outage = self.active.get(str(appender.path.parent))
        if outage is not None:
            outage.dropped += lines

    def written(self, appender: Holder) -> None:
        """A write to this folder succeeded: its outage is over once no file there holds lines."""
        with self._lock:
            self._written(appender)

    def _written(self, appender: Holder) -> None:
        self._holding.discard(appender)
        folder = str(appender.path.parent)
        outage = self.active.get(folder)
        if outage is None or any(str(a.path.parent) == folder for a in list(self._holding)):
            return
        del self.active[folder]
        outage.until = time.time()
        self.over.append(outage)
        if os.environ.get("RANK", "0") == "0":
            log.warning("harness: %s can be written again after %.0f s; the lines held meanwhile are written%s.", folder,
                        outage.until - outage.since, f" ({outage.dropped} dropped)" if outage.dropped else "")

    def retry(self, force: bool = False) -> None:
        """Write what the files hold (every ``RETRY_S`` at most, unless ``force``); a no-op when nothing is held."""
        if not self.active:
            return
        now = time.monotonic()
        if not force and now < self._next_retry:
            return
        self._next_retry = now + RETRY_S
        for appender in list(self._holding):
            appender.drain()

    def take_over(self) -> list[Outage]:
        with self._lock:
            over, self.over = self.over, []
        return over


OUTAGES = Outages()


def attempt_write(holder: Holder, action: Callable[[], None]) -> bool:
    """Run ``action`` (a write of ``holder``'s); an ``OSError`` is kept as ``holder.failure`` and told to ``OUTAGES``
    (once, as the outage begins), never raised; the first success after one ends it. True when ``action`` succeeded."""
    try:
        action()
    except OSError as exc:
        if holder.failure is None:
            OUTAGES.failed(holder, exc)
        holder.failure = exc
        return False
    if holder.failure is not None:
        holder.failure = None
        OUTAGES.written(holder)
    return True


def _errno_text(exc: OSError) -> str:
    name = errno_module.errorcode.get(exc.errno or 0)
    return f"[Errno {exc.errno}{' ' + name if name else ''}] {exc.strerror or exc}"


class LineAppender:
    """An append-only text file whose writes never raise into training.

    A write that fails (a full disk or quota, an I/O error, a folder gone) is
    held in memory, in order, and written before the next line once a write
    succeeds again: at the file's next write, at the step guard's retry
    (``OUTAGES.retry``) or at ``close``. One console line says when a folder
    cannot be written and one when it can again; the run records the outage
    as a finding. A write the disk took only in part leaves a torn line,
    which the next write ends with a newline before the whole line again
    (readers skip a torn line). Past ``HOLD_BYTES`` a file drops new lines and
    counts them. Each write is one ``write`` system call, as before.
    """

    def __init__(self, path: str | os.PathLike[str], fsync: bool = False) -> None:
        self.path = Path(path)
        self.fsync = fsync
        self.failure: OSError | None = None
        self._fd: int | None = None
        self._held: deque[bytes] = deque()
        self._held_bytes = 0
        self._torn = False
        self._lock = threading.Lock()
        with self._lock:
            self._try(self._open)
        _APPENDERS.add(self)

    def reopen_if_removed(self) -> bool:
        """When the file was removed under this writer (its folder deleted by hand mid-run): a new one at the same
        path (folders made again), written from now on; True then. One ``fstat``, at checkpoints and at the end only."""
        with self._lock:
            if self._fd is None:
                return False
            try:
                if os.fstat(self._fd).st_nlink > 0:
                    return False
                os.close(self._fd)
            except OSError:
                return False
            self._fd = None
            self._torn = False
            self._try(self._open)
            return True

    def write(self, text: str) -> bool:
        """Append ``text`` (whole lines); False when it is held (not written yet) or dropped."""
        data = text.encode("utf-8")
        with self._lock:
            if self._held or self._fd is None:
                if self._held_bytes + len(data) > HOLD_BYTES:
                    OUTAGES.dropped(self, data.count(b"\n"))
                    return False
                self._held.append(data)
                self._held_bytes += len(data)
                return self._try(self._write_held)
            return self._try(self._write, data)

    def drain(self) -> bool:
        """Write what is held; True when nothing is held any more."""
        with self._lock:
            return self._try(self._write_held)

    def close(self) -> None:
        with self._lock:
            if self._held:
                self._try(self._write_held)
            if self._fd is not None:
                try:
                    os.close(self._fd)
                except OSError:
                    pass
                self._fd = None

    @property
    def holding(self) -> int:
        """Lines held, not yet written."""
        return sum(chunk.count(b"\n") for chunk in self._held)

    def _try(self, action: Any, *args: Any) -> bool:
        return attempt_write(self, lambda: action(*args))

    def _open(self) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        # never through a link (a received run may plant one: the write would land outside the run); a hard-linked
        # file is another copy's too (refused at attach, ``harness.lib.rundir.refuse_links``; here it is an outage)
        self._fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_CLOEXEC | getattr(os, "O_NOFOLLOW", 0), 0o644)
        if os.fstat(self._fd).st_nlink > 1:
            os.close(self._fd)
            self._fd = None
            raise OSError(errno_module.EMLINK, f"{self.path.name} is a hard link shared with another file: not written")
        self._torn = self._torn or ends_torn(self.path)

    def _write(self, data: bytes) -> None:
        """Write ``data`` or hold it (from its first unwritten line) and raise."""
        try:
            if self._fd is None:
                self._open()
            assert self._fd is not None
            if self._torn:
                os.write(self._fd, b"\n")
                self._torn = False
        except OSError:
            self._held.appendleft(data)
            self._held_bytes += len(data)
            raise
        done = 0
        try:
            while done < len(data):
                done += os.write(self._fd, data[done:])  # a short count: the rest raises the disk's error next
        except OSError:
            whole = data.rfind(b"\n", 0, done) + 1  # lines written whole; a line written in part is torn, written again
            self._torn = whole < done
            self._held.appendleft(data[whole:])
            self._held_bytes += len(data) - whole
            raise
        if self.fsync:
            os.fsync(self._fd)

    def _write_held(self) -> None:
        while self._held:
            data = self._held.popleft()
            self._held_bytes -= len(data)
            self._write(data)


_APPENDERS: weakref.WeakSet[LineAppender] = weakref.WeakSet()  # every appender of this process (``reopen_removed``)


def reopen_removed() -> list[Path]:
    """Every appender of this process whose file was removed (a run directory deleted mid-run), writing a new file at
    its path now; their paths."""
    return [appender.path for appender in list(_APPENDERS) if appender.reopen_if_removed()]


SHARED_OPEN = 32  # files kept open by ``shared_appender`` (then the least recently used one that holds nothing is closed)
_shared: dict[Path, LineAppender] = {}
_shared_lock = threading.Lock()


def shared_appender(path: str | os.PathLike[str]) -> LineAppender:
    """The process's :class:`LineAppender` of ``path``, for a file written now and then (a record per check): lines a
    full disk held stay held between the writes, where an appender opened per write would lose them at its close."""
    key = Path(path)
    with _shared_lock:
        appender = _shared.pop(key, None)
        if appender is None:
            appender = LineAppender(key)
            idle = [p for p, a in _shared.items() if not a.holding]
            for old in idle[: max(0, len(_shared) + 1 - SHARED_OPEN)]:
                _shared.pop(old).close()
        _shared[key] = appender  # the most recently used last
        return appender
