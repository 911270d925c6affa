"""The run directory before the first step: writable (checked by writing), and held by one run at a time.

``check_writable`` creates ``<output_dir>/harness`` and writes and removes a
small file there: ``os.access`` answers "yes" for root on read-only mounts
and on paths it cannot create, so only a real write tells.

The lock is a POSIX record lock (``fcntl.lockf``) on ``<output_dir>/harness/.lock``,
taken by rank 0 for the length of each ``train()`` call (``attach`` only
checks that it is free, so a second run is refused before it writes
anything). A record lock belongs to the process, is not inherited by forked
children (data-loader workers, ``datasets.map`` pools: with ``flock`` an
orphaned worker of a killed run would keep holding it) and the kernel drops
it when the process dies, so a killed run never leaves a stale lock behind;
the lock file keeps the pid of its holder only so that the error can name
it. Within one process the lock is shared: several trainers attached to the
same output directory one after the other (a resume in the same script, the
stage runner's rollback) do not lock each other out. (A record lock is also
dropped when the process closes any descriptor of the file, so nothing but
this module opens it.)
"""
from __future__ import annotations

import errno
import json
import logging
import os
import socket
import stat
import time
from pathlib import Path
from typing import Any

from harness.core.errors import RunDirLinkedError, RunDirLockedError, RunDirNotWritableError

log = logging.getLogger("harness")
LOCK_NAME = ".lock"

# lock file (real path) -> (open descriptor, ids of the holders in this process)
_HELD: dict[str, tuple[int, set[int]]] = {}


def check_writable(run_dir: Path) -> None:
    """Create ``run_dir`` and prove it writable by writing a file; else a ``RunDirNotWritableError``."""
    run_dir = Path(run_dir)
    probe = run_dir / f".write-test.{os.getpid()}.{socket.gethostname()}"
    try:
        run_dir.mkdir(parents=True, exist_ok=True)
        probe.write_bytes(b"ok")
        probe.unlink()
    except OSError as exc:
        blocker = _first_non_directory(run_dir)
        why = (
            f"{blocker} is a file, not a folder" if blocker is not None
            else f"{type(exc).__name__}: {exc.strerror or exc}"
        )
        raise RunDirNotWritableError(
            f"the harness cannot write its run directory {run_dir} ({why}). Every finding, the ledger, captures and the "
            "report go there, so training does not start without it. Fix: choose a writable output_dir (TrainingArguments"
            ".output_dir, or `output_dir` in the harness config), or make the folder writable for this user "
            f"(e.g. `chown -R $(id -u) {run_dir.parent}`), or free the disk / remount it read-write."
        ) from exc


LINK_WALK_ENTRIES = 50_000  # entries of a run directory looked at for links at attach, at most


def refuse_links(run_dir: Path) -> None:
    """A ``RunDirLinkedError`` when the run directory (copied or received, resumed into) holds a symbolic link or a
    hard-linked file: appending findings or step records, or rewriting the ledger, would write through it into a file
    outside the run or into another copy of it. Folders are not followed; the walk stops after ``LINK_WALK_ENTRIES``."""
    run_dir = Path(run_dir)
    if not run_dir.is_dir() or run_dir.is_symlink():
        return
    found: list[str] = []
    seen = 0
    for root, dirs, files in os.walk(run_dir):  # does not descend into linked folders (followlinks=False)
        for name in dirs + files:
            seen += 1
            path = Path(root) / name
            try:
                info = os.lstat(path)
            except OSError:
                continue
            if stat.S_ISLNK(info.st_mode):
                found.append(f"{path.relative_to(run_dir)} (a symbolic link to {os.readlink(path)})")
            elif stat.S_ISREG(info.st_mode) and info.st_nlink > 1:
                found.append(f"{path.relative_to(run_dir)} (a hard link: {info.st_nlink} names share it)")
        if seen >= LINK_WALK_ENTRIES or len(found) >= 5:
            break
    if found:
        raise RunDirLinkedError(
            f"the run directory {run_dir} holds links where the harness writes: {'; '.join(found[:5])}. Appending to them "
            "would change files outside this run (or another copy of it), so training does not start. Fix: replace each "
            "link with a real copy of its file (`cp --remove-destination \"$(readlink -f FILE)\" FILE`), or copy the run "
            "with `cp -r` rather than `cp -al` or `cp -s`, or start in a fresh output_dir."
        )


def _first_non_directory(path: Path) -> Path | None:
    """The first existing component of ``path`` that is not a folder (a file where a folder must be)."""
    for part in reversed([path, *path.parents]):
        try:
            if part.exists() and not part.is_dir():
                return part
        except OSError:  # a folder this user cannot look into: the error itself says why
            return None
    return None


def lock_path(run_dir: Path) -> Path:
    return Path(run_dir) / LOCK_NAME


def acquire(run_dir: Path, holder: int) -> None:
    """Take (or share, within this process) the run directory's lock; ``RunDirLockedError`` if another process has it."""
    import fcntl

    path = lock_path(run_dir)
    key = os.path.realpath(path)
    held = _HELD.get(key)
    if held is not None:
        held[1].add(holder)
        return
    try:
        fd = os.open(key, os.O_RDWR | os.O_CREAT | getattr(os, "O_CLOEXEC", 0), 0o644)
    except OSError as exc:  # writability was checked before; a lock that cannot be made must not stop training
        log.warning("harness: could not create the run lock %s (%s); a second run on this directory will not be refused", path, exc)
        return
    try:
        fcntl.lockf(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError as exc:
        if exc.errno not in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):  # a filesystem without record locks
            os.close(fd)
            log.warning("harness: the file system of %s does not support file locks (%s); a second run on it will not be refused", path, exc)
            return
        owner = _read_owner(fd)
        os.close(fd)
        raise RunDirLockedError(
            f"another run is using {Path(run_dir)} ({owner} holds {path}). Two runs writing the same output directory "
            "overwrite each other's checkpoints, findings and ledger. Fix: wait for that run to end (or stop it: "
            f"`kill {owner.split()[1] if owner.startswith('pid ') else '<pid>'}`), or give this run another output_dir. "
            "A killed run does not hold the lock: the kernel drops it with the process."
        ) from None
    try:
        os.ftruncate(fd, 0)
        os.write(fd, json.dumps({"pid": os.getpid(), "host": socket.gethostname(), "since": time.time()}).encode())
    except OSError:
        pass
    _HELD[key] = (fd, {holder})


def retake(run_dir: Path) -> bool:
    """When the lock file this process holds was removed (the run directory deleted mid-run): take the lock again on a
    new lock file, for the same holders; True then. A second run that took the folder meanwhile is said, not fought."""
    key = os.path.realpath(lock_path(run_dir))
    held = _HELD.get(key)
    if held is None:
        return False
    fd, holders = held
    try:
        if os.fstat(fd).st_nlink > 0:
            return False
    except OSError:
        return False
    del _HELD[key]
    os.close(fd)
    try:
        for holder in sorted(holders):
            acquire(run_dir, holder)
    except RunDirLockedError as exc:
        log.warning("harness: could not take the run lock of %s again: %s", run_dir, exc)
        return False
    return True


def record_end(run_dir: Path, status: str, end_step: int | None) -> bool:
    """Write how this process's train() call ended into the run lock it holds (``end`` beside pid, host and since).

    The readers consult it when run.json still says the call is running (run.json could not be replaced at the end:
    a full disk, a read-only remount), so such a call is not taken for a killed one. The lock file exists and is
    open already, and its few hundred bytes stay within the block it has: this write needs no new space. False when
    this process holds no lock there or the write failed.
    """
    held = _HELD.get(os.path.realpath(lock_path(run_dir)))
    if held is None:
        return False
    fd = held[0]
    try:
        current = json.loads(os.pread(fd, 4096, 0).decode("utf-8").strip() or "{}")
        if not isinstance(current, dict):
            current = {}
        current["end"] = {"status": status, "end_step": end_step, "ended": time.time()}
        data = json.dumps(current).encode()
        old = os.fstat(fd).st_size
        os.pwrite(fd, data + b" " * max(0, old - len(data)), 0)  # padded over the old text: no truncation, no new block
        return True
    except (OSError, ValueError):
        return False


def release(run_dir: Path, holder: int) -> None:
    """Drop ``holder``'s share of the lock; the lock goes when the last holder in this process lets go."""
    import fcntl

    key = os.path.realpath(lock_path(run_dir))
    held = _HELD.get(key)
    if held is None:
        return
    fd, holders = held
    holders.discard(holder)
    if holders:
        return
    del _HELD[key]
    try:
        fcntl.lockf(fd, fcntl.LOCK_UN)
    finally:
        os.close(fd)


def _read_owner(fd: int) -> str:
    try:
        os.lseek(fd, 0, os.SEEK_SET)
        data = json.loads(os.read(fd, 4096).decode() or "{}")
        return f"pid {data['pid']} on {data.get('host', '?')}"
    except (OSError, ValueError, KeyError, TypeError):
        return "a process that has not written its pid yet"


# -- reading the lock (``harness report``, ``explain``, wrap's summary): is the run still training? ----------------------

HOST_CHARS = 64  # of a host name a lock file names, as shown (a received run directory is data)


class LockHolder:
    """Who the lock file of a run directory names, and whether that process holds the lock now on this host."""

    __slots__ = ("pid", "host", "since", "here", "alive", "end")

    def __init__(self, pid: int, host: str | None, since: float | None, here: bool, alive: bool,
                 end: dict[str, Any] | None = None) -> None:
        self.pid, self.host, self.since, self.here, self.alive = pid, host, since, here, alive
        self.end = end  # how that process's last train() call ended, when it recorded it here (``record_end``)

    def __repr__(self) -> str:
        return f"LockHolder(pid={self.pid}, host={self.host!r}, here={self.here}, alive={self.alive})"


def read_holder(run_dir: Path) -> LockHolder | None:
    """The holder that ``<run_dir>/.lock`` names, with whether it is a live process of this host holding the lock now;
    None when there is no lock file, it is not a regular file, a symbolic link (never followed: a received run
    directory is data), unreadable, or names no pid.

    Reading never disturbs a holder: a record lock is dropped when its process closes *any* descriptor of the file, so
    a lock this process holds is answered from memory, without opening the file. Another process's lock is tested
    with ``F_GETLK`` on a read-only descriptor (the kernel's word: held or not, whatever pid the file names, so a
    recycled pid of a killed run does not read as alive); only where that cannot be asked (a file system without
    record locks, not Linux) does a live pid on this host count.
    """
    path = lock_path(run_dir)
    key = os.path.realpath(path)
    if key in _HELD and not os.path.islink(path):  # this process trains there now
        return LockHolder(os.getpid(), socket.gethostname(), None, here=True, alive=True)
    try:
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_CLOEXEC", 0))
    except OSError:  # missing, a symbolic link (ELOOP), a FIFO without writer, no permission
        return None
    try:
        import stat

        if not stat.S_ISREG(os.fstat(fd).st_mode):
            return None
        data = json.loads(os.read(fd, 4096).decode("utf-8") or "{}")
        if not isinstance(data, dict):
            return None
        pid, host, since = data.get("pid"), data.get("host"), data.get("since")
        if not isinstance(pid, int) or isinstance(pid, bool) or pid <= 0:
            return None
        host = host if isinstance(host, str) else None
        since = float(since) if isinstance(since, (int, float)) and not isinstance(since, bool) else None
        here = host is not None and host == socket.gethostname()
        alive = here and _holds_lock(fd, pid)
        end = data.get("end")
        end = end if isinstance(end, dict) and isinstance(end.get("status"), str) else None
        return LockHolder(pid, _shown_host(host), since, here=here, alive=alive, end=end)
    except (OSError, ValueError, RecursionError):
        return None
    finally:
        os.close(fd)  # this process holds no lock on the file (checked above): closing drops nothing


def _holds_lock(fd: int, pid: int) -> bool:
    """Whether the file's lock is held now (``F_GETLK``); where that cannot be asked, whether ``pid`` is alive."""
    held = _lock_held(fd)
    if held is not None:
        return held
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's live process
        return True
    except OSError:
        return False
    return True


def _lock_held(fd: int) -> bool | None:
    """``F_GETLK`` for a write lock on the whole file: True when another process holds a conflicting lock, False when
    none does, None when it cannot be asked (not Linux on 64 bits, a file system without record locks)."""
    import struct
    import sys

    if not sys.platform.startswith("linux") or struct.calcsize("P") != 8:  # struct flock's layout below is Linux's, 64-bit
        return None
    try:
        import fcntl

        query = struct.pack("hhqqi4x", fcntl.F_WRLCK, os.SEEK_SET, 0, 0, 0)
        answer = fcntl.fcntl(fd, fcntl.F_GETLK, query)
        kind = struct.unpack("hhqqi4x", answer)[0]
    except (OSError, ImportError, struct.error):
        return None
    return kind != fcntl.F_UNLCK


def _shown_host(host: str | None) -> str | None:
    """A host name as a report may show it: printable name characters only, clipped."""
    if host is None:
        return None
    kept = "".join(c for c in host if c.isascii() and (c.isalnum() or c in ".-_"))[:HOST_CHARS]
    return kept or None
