"""The data ledger: which samples every rank trained on at every step, in append-only files that survive a kill.

One JSON line per micro-batch in ``<run_dir>/ledger/rank-<r>.jsonl``, in the
file's page cache at every step (written through a shared mapping,
``harness.core.mapped_lines``: a ``kill -9`` loses at most the step in
flight, and the step pays no system call) and fsynced every
``fsync_every`` steps and at every checkpoint. Each process that trains
starts an *attempt* with a header line (the step it starts from), so a
resumed run's ledger holds both the interrupted run's steps past the
checkpoint and the steps that replaced them: exactly what a resume check
needs to compare. Attempts are numbered by the run, not by the rank: a rank
that first trains at a resume (the world grew) takes the run's next number,
so one number names one attempt in every rank's file, and ``continuation``
reads what an interrupted attempt trained after a checkpoint over all its
ranks (a step's samples are one set, whatever the world size).

``read_ledger`` turns the files into one pandas DataFrame, one row per sample.
"""
from __future__ import annotations

import itertools
import json
import os
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterator

from harness.core.mapped_lines import MappedLines
from harness.core.strictjson import dumps

LEDGER_DIR = "ledger"


def ledger_path(run_dir: Path, rank: int) -> Path:
    return Path(run_dir) / LEDGER_DIR / f"rank-{rank}.jsonl"


def _lines(path: Path, start: int = 0) -> Iterator[tuple[int, int, dict[str, Any] | None]]:
    """(offset, end offset, record or None when unreadable) of every complete line from byte ``start``."""
    with open(path, "rb") as handle:
        handle.seek(start)
        offset = start
        for line in handle:
            end = offset + len(line)
            if not line.endswith(b"\n"):
                return  # the last line of a killed process may be incomplete
            try:
                record = json.loads(line)
            except ValueError:
                record = None  # a torn line that a later writer closed with a newline
            yield offset, end, record if isinstance(record, dict) else None
            offset = end


def iter_records(path: Path) -> Iterator[dict[str, Any]]:
    """Every intact line of one rank's ledger (a line cut short by a kill is skipped)."""
    if not path.exists():
        return
    for _, _, record in _lines(path):
        if record is not None:
            yield record


def ledger_files(run_dir: Path) -> dict[int, Path]:
    """rank -> its ledger file (``ledger/rank-<r>.jsonl``); none through a symbolic link (a received run is data)."""
    folder = Path(run_dir) / LEDGER_DIR
    if folder.is_symlink() or not folder.is_dir():
        return {}
    files = {}
    for path in folder.glob("rank-*.jsonl"):
        rank = path.stem.split("-", 1)[1]
        if rank.isdigit() and not path.is_symlink() and path.is_file():
            files[int(rank)] = path
    return dict(sorted(files.items()))


def _attempt_of(record: dict[str, Any]) -> int:
    value = record.get("attempt", 0)
    return value if isinstance(value, int) else 0


def last_attempt(path: Path) -> int:
    """The highest attempt number in a rank's ledger (0 when there is none).

    Every line carries its attempt, so a start line lost to a kill does not
    make the next attempt reuse its number.
    """
    return max((_attempt_of(r) for r in iter_records(path)), default=0)


class _Scan:
    """One pass over a rank's ledger around a resume, kept so that every reader of the resume shares it."""

    def __init__(self, path: Path, resume_step: int | None, before_running: bool) -> None:
        """``before_running``: the attempt about to start has not written its start line yet (the writer's view)."""
        self.resume_step = resume_step
        self.highest = 0  # the highest attempt number in the file
        self.highest_trained = 0  # ... of a line that is no start line (an attempt that trained at least one step)
        self._best: dict[tuple[int, int], dict[str, Any]] = {}
        self._after_any: list[dict[str, Any]] = []  # after the resume step: the newest attempt's records
        self._after_writer: list[dict[str, Any]] = []  # ... the newest attempt's that trained the resume step itself
        self._writers: set[int] = set()  # attempts with a record at the resume step (they saved, or could save, its checkpoint)
        self.trained_after: dict[int, list[dict[str, Any]]] = {}  # earlier attempt -> its records after the resume step
        self.worlds: dict[int, int] = {}  # attempt -> its world size (start lines)
        tail: list[dict[str, Any]] = []  # records of the newest started attempt (left out when it is the running one)
        newest_start, self.boundary = 0, 0
        stat = os.stat(path) if path.exists() else None
        self.ident = (stat.st_dev, stat.st_ino) if stat is not None else None
        end = 0
        if stat is not None:
            for offset, end, record in _lines(path):
                if record is None:
                    continue
                attempt = _attempt_of(record)
                self.highest = max(self.highest, attempt)
                if record.get("event") is None:
                    self.highest_trained = max(self.highest_trained, attempt)
                elif record.get("event") == "start" and isinstance(record.get("world_size"), int):
                    self.worlds[attempt] = record["world_size"]
                if before_running:
                    if record.get("event") is None:
                        self._settle(record)
                elif record.get("event") == "start":
                    if attempt > newest_start:
                        for r in tail:
                            if _attempt_of(r) < attempt:
                                self._settle(r)
                        tail = [r for r in tail if _attempt_of(r) >= attempt]
                        newest_start, self.boundary = attempt, offset
                elif attempt >= newest_start:
                    tail.append(record)
                else:
                    self._settle(record)
        if before_running:
            self.current, self.boundary = self.highest + 1, end  # the running attempt's start line goes at ``end``
        else:
            self.current = newest_start
        # what the interrupted run trained next: the continuation of the attempt that trained the resume step (the one that
        # saved its checkpoint), not of a later attempt that resumed from that checkpoint too and may have been wrong (one the
        # harness stopped at its first step for a bad data position); without such an attempt, the newest one's
        self.after = self._after_writer if self._writers else self._after_any
        # the file's (size, mtime) when last known to hold nothing newer than the running attempt
        self.known: tuple[int, int] | None = (stat.st_size, stat.st_mtime_ns) if stat is not None and end == stat.st_size else None

    def _settle(self, record: dict[str, Any]) -> None:
        if self.resume_step is None or not isinstance(record.get("step"), int) or not isinstance(record.get("micro_batch"), int):
            return
        attempt = _attempt_of(record)
        if record["step"] <= self.resume_step:
            key = (record["step"], record["micro_batch"])
            if key not in self._best or _attempt_of(self._best[key]) < attempt:
                self._best[key] = record
            if record["step"] == self.resume_step:
                self._writers.add(attempt)
            return
        self.trained_after.setdefault(attempt, []).append(record)
        _keep_newest(self._after_any, record, attempt)
        if attempt in self._writers:
            _keep_newest(self._after_writer, record, attempt)

    @property
    def writers(self) -> set[int]:
        return self._writers

    @property
    def before(self) -> list[dict[str, Any]]:
        return list(self._best.values())

    def still_valid(self, path: Path) -> bool:
        """The file is the one read, and nothing but the running attempt was appended since (read from there if it grew)."""
        try:
            stat = os.stat(path)
        except OSError:
            return False
        if (stat.st_dev, stat.st_ino) != self.ident or stat.st_size < self.boundary:
            return False
        if (stat.st_size, stat.st_mtime_ns) == self.known:
            return True
        if any(r is not None and _attempt_of(r) != self.current for _, _, r in _lines(path, self.boundary)):
            return False
        self.known = (stat.st_size, stat.st_mtime_ns)
        return True


def _keep_newest(records: list[dict[str, Any]], record: dict[str, Any], attempt: int) -> None:
    """``records`` holds one attempt's records, the newest attempt's seen: a newer one replaces them, the same one adds."""
    if not records or attempt > _attempt_of(records[0]):
        records[:] = [record]
    elif attempt == _attempt_of(records[0]):
        records.append(record)


_SCANS: dict[str, _Scan] = {}  # ledger path -> the scan around this process's latest resume (dropped when its writer closes)
_MAX_SCANS = 4


def _key(path: Path) -> str:
    return os.path.abspath(path)


def _remember(path: Path, scan: _Scan) -> None:
    _SCANS.pop(_key(path), None)
    _SCANS[_key(path)] = scan
    while len(_SCANS) > _MAX_SCANS:
        _SCANS.pop(next(iter(_SCANS)))


def around_resume(run_dir: Path, rank: int, resume_step: int, running_here: bool = True) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """Earlier attempts' records of one rank around a resume from ``resume_step``.

    Returns (for every step up to the resume, the record of the attempt that
    trained it last; the records the newest earlier attempt trained after
    the resume step, i.e. what the interrupted run did next). The attempt now
    running (the newest start line) is left out; with ``running_here`` False
    (the ledger of another run directory) none is.

    The ledger is read once per resume: the pass the ``LedgerWriter`` made to
    number its attempt (or the first call here) is kept and shared by every
    plugin that asks about the same resume, as long as only the running
    attempt has appended to the file since.
    """
    path = ledger_path(run_dir, rank)
    if not running_here:  # another run directory's ledger (a checkpoint resumed into a new one): every attempt is earlier
        scan = _Scan(path, resume_step, before_running=True)
        return scan.before, list(scan.after)
    scan = _SCANS.get(_key(path))
    if scan is None or scan.resume_step != resume_step or not scan.still_valid(path):
        scan = _Scan(path, resume_step, before_running=False)
        if scan.ident is not None:
            _remember(path, scan)
    return scan.before, list(scan.after)


TAIL_BYTES = 1 << 13  # read from the end of another rank's ledger for its newest attempt (grown until a record is found)


def _newest_trained(path: Path) -> int:
    """The attempt of the last intact line of ``path`` that is no start line (0: none), read from the end of the file.

    Attempt numbers only grow within a file, so that line holds the file's
    highest attempt that trained a step; start lines after it (an attempt
    starting now, or one killed before its first step) are left out. The NUL
    bytes of a writer's mapped window (open, or killed) are skipped.
    """
    try:
        with open(path, "rb") as handle:
            size = handle.seek(0, os.SEEK_END)
            while size > 0:  # the end of the written lines: before the unwritten rest of a mapped window
                start = max(0, size - (1 << 16))
                handle.seek(start)
                block = handle.read(size - start)
                kept = len(block.rstrip(b"\0"))
                size = start + kept
                if kept:
                    break
            chunk = TAIL_BYTES
            while True:
                start = max(0, size - chunk)
                handle.seek(start)
                lines = handle.read(size - start).split(b"\n")[:-1]  # the last piece is empty or cut by a kill
                for line in reversed(lines[1:] if start > 0 else lines):  # the first piece may be cut by the seek
                    try:
                        record = json.loads(line)
                    except ValueError:
                        continue
                    if isinstance(record, dict) and record.get("event") is None:
                        return _attempt_of(record)
                if start == 0:
                    return 0
                chunk *= 8
    except OSError:
        return 0


def run_attempt(run_dir: Path, rank: int, own_trained: int) -> int:
    """The number of an attempt starting now: one above the highest attempt that trained a step in any rank's ledger.

    ``own_trained``: that number in this rank's own file (already read). The
    other ranks' files are read from their ends. Start lines without a trained
    step after them are left out: the other ranks of this very attempt may have
    written theirs already (no rank writes a step before every rank started:
    the first step's gradients meet across the ranks), so every rank of one
    launch gets the same number, a rank that joins at a resume included.
    """
    highest = own_trained
    for other, path in ledger_files(run_dir).items():
        if other != rank:
            highest = max(highest, _newest_trained(path))
    return highest + 1


_RUNNING: dict[str, int] = {}  # run directory -> the attempt this process writes now (its earlier attempts are below it)
_RECORD_HEAD = re.compile(rb'\{"attempt":(\d+),"step":(-?\d+),')  # the start of every record line the writer formats


@dataclass(frozen=True)
class Continuation:
    """What one earlier attempt trained after a checkpoint, over all its ranks: the interrupted run's next steps."""

    attempt: int | None = None  # the run's number of that attempt; None when no earlier attempt got past the checkpoint
    world_size: int | None = None  # its processes (from its start lines, else the ranks that wrote its records)
    records: list[dict[str, Any]] = field(default_factory=list)  # its records after the checkpoint, "rank" added, by step, rank, micro-batch

    def steps(self) -> dict[int, list[str]]:
        """step -> the sample hashes every rank of that attempt trained at it (one set per step, whatever the world size)."""
        out: dict[int, list[str]] = {}
        for record in self.records:
            out.setdefault(record["step"], []).extend(str(h) for h in record.get("sample_hashes") or [])
        return out


_CONTINUATIONS: dict[tuple[Any, ...], Continuation] = {}  # the last few reads, keyed by the files' sizes and times
BACK_BLOCK = 1 << 16  # bytes read at a time from the end of a ledger


class _LinesFromEnd:
    """The lines of a ledger, the last first, each with its newline, read backwards in blocks of ``BACK_BLOCK``.

    The NUL bytes of a writer's mapped window (open, or killed) end no line and
    are skipped; a last line without a newline (cut by a kill) is yielded as
    it is, and a reader leaves it out. The read stops where the caller stops
    asking (a file's early steps are never read for a resume from a late one)
    and goes on from there at the next ``lines`` call, on the file opened again.
    """

    def __init__(self) -> None:
        self.pos: int | None = None  # the file's bytes before ``pos`` are not read yet
        self.buf, self.right = b"", 0  # buf[:right] is not yielded yet; its first line may begin before ``pos``

    def lines(self, handle: Any) -> Iterator[bytes]:
        if self.pos is None:
            pos = handle.seek(0, os.SEEK_END)
            while pos > 0 and not self.buf:  # the end of the written lines: before the unwritten rest of a mapped window
                start = max(0, pos - BACK_BLOCK)
                handle.seek(start)
                self.buf = handle.read(pos - start).rstrip(b"\0")
                pos = start
            self.pos, self.right = pos, len(self.buf)
        while True:
            cut = self.buf.rfind(b"\n", 0, self.right - 1) if self.right > 0 else -1
            if cut >= 0:
                line, self.right = self.buf[cut + 1:self.right], cut + 1
                yield line
                continue
            if self.pos == 0:
                if self.right:
                    line, self.right = self.buf[:self.right], 0
                    yield line
                return
            start = max(0, self.pos - BACK_BLOCK)
            handle.seek(start)
            self.buf = handle.read(self.pos - start) + self.buf[:self.right]
            self.right, self.pos = len(self.buf), start


def _head(line: bytes) -> tuple[int, Any, dict[str, Any] | None] | None:
    """(attempt, step, the start line's record or None) of a ledger line; None for a line that is none (torn, damaged).

    Record lines are matched by their first bytes, not parsed."""
    head = _RECORD_HEAD.match(line)
    if head is not None:
        return int(head.group(1)), int(head.group(2)), None
    try:
        record = json.loads(line)
    except ValueError:
        return None
    if not isinstance(record, dict):
        return None
    if record.get("event") == "start":
        return _attempt_of(record), record.get("step"), record
    return _attempt_of(record), record.get("step"), None


@dataclass
class _Found:
    """What the backward reads of a continuation found so far, over every rank's file."""

    resume_step: int
    running: int | None
    writers: set[int] = field(default_factory=set)  # attempts with a record at the resume step
    wrote: set[tuple[int, int]] = field(default_factory=set)  # (attempt, rank) of those records
    after: dict[int, list[tuple[int, bytes | dict[str, Any]]]] = field(default_factory=dict)  # attempt -> (rank, line)
    worlds: dict[int, int] = field(default_factory=dict)  # attempt -> its world size, from the start lines read


class _Backward:
    """One rank's ledger read from its end, down to the checkpoint's step (further only where an older attempt may matter).

    Attempt numbers only grow along a file and steps within an attempt, so
    reading from the end meets the attempts newest first. The read stops at the
    first record of the checkpoint's step (the attempt that saved it: what
    came before is older), at any record older than the newest such attempt
    found in any file, or, first time round, at a record before the checkpoint's
    step (``hold``: read on only when no file showed the attempt that saved it,
    e.g. a later attempt that went back to an older checkpoint came in between).
    """

    def __init__(self, rank: int, path: Path) -> None:
        self.rank, self.path = rank, path
        self.source = _LinesFromEnd()
        self.held: bytes | None = None
        self.done = False

    def read(self, found: _Found, hold: bool) -> None:
        """Read on from where the last call stopped (the file is open only during a call: no handle per rank is kept)."""
        if self.done:
            return
        try:
            with open(self.path, "rb") as handle:
                self._read(handle, found, hold)
        except OSError:
            self.done = True

    def _read(self, handle: Any, found: _Found, hold: bool) -> None:
        pending, self.held = ([self.held] if self.held is not None else []), None
        for line in itertools.chain(pending, self.source.lines(handle)):
            if not line.endswith(b"\n"):
                continue  # the last line of a killed process may be incomplete
            head = _head(line)
            if head is None:
                continue
            attempt, step, start = head
            if found.running is not None and attempt >= found.running:
                continue  # the attempt this process writes now (and the other ranks' lines of it)
            newest = max(found.writers) if found.writers else None
            if newest is not None and attempt < newest:
                break  # older than the attempt that saved the checkpoint: nothing before it counts
            if start is not None:
                if isinstance(start.get("world_size"), int):
                    found.worlds.setdefault(attempt, start["world_size"])
                continue
            if not isinstance(step, int):
                continue
            if step == found.resume_step:
                found.writers.add(attempt)
                found.wrote.add((attempt, self.rank))
                break
            if step > found.resume_step:
                found.after.setdefault(attempt, []).append((self.rank, line))
                continue
            if newest is not None and attempt == newest:
                break  # the saving attempt's steps before the checkpoint
            if hold and newest is None:
                self.held = line  # judged again once every file was read down to the checkpoint's step
                return
        self.done = True


def continuation(run_dir: Path, resume_step: int, running_here: bool = True, ranks: set[int] | None = None) -> Continuation:
    """What the interrupted run trained after the checkpoint of ``resume_step``, over every rank's ledger (or ``ranks``).

    The interrupted run is the newest earlier attempt that trained the
    checkpoint's step itself (the one that saved it), not a later attempt that
    resumed from the same checkpoint and may have been wrong; without one, the
    newest earlier attempt that trained past it. With ``running_here`` the
    attempt this process writes now is left out (with False: the ledger of
    another run directory, every attempt is earlier). Each file is read from
    its end down to the checkpoint's step (:class:`_Backward`), not whole:
    at a resume every rank reads every rank's file, on the training thread,
    so the cost is the steps after the checkpoint, not the run's length. Lines
    are matched by their first bytes, not parsed; this rank's own file is not
    read again when its writer's pass for the resume still holds.
    """
    files = ledger_files(run_dir)
    if ranks is not None:
        files = {r: p for r, p in files.items() if r in ranks}
    running = _RUNNING.get(_key(Path(run_dir))) if running_here else None
    signature: list[Any] = [_key(Path(run_dir)), resume_step, running, tuple(sorted(ranks)) if ranks is not None else None]
    for rank, path in files.items():
        try:
            stat = path.stat()
        except OSError:
            continue
        signature.append((rank, stat.st_size, stat.st_mtime_ns))
    key = tuple(signature)
    if key in _CONTINUATIONS:
        return _CONTINUATIONS[key]
    found = _Found(resume_step, running)
    readers: list[_Backward] = []
    for rank, path in files.items():
        scan = _SCANS.get(_key(path)) if running_here else None
        if scan is not None and scan.resume_step == resume_step and scan.still_valid(path):
            # this process's own writer read the file for this resume already (every attempt in it is an earlier one)
            for attempt, world in scan.worlds.items():
                found.worlds.setdefault(attempt, world)
            earlier = {a for a in scan.writers if running is None or a < running}
            found.writers.update(earlier)
            found.wrote.update((a, rank) for a in earlier)
            for attempt, trained in scan.trained_after.items():
                if running is None or attempt < running:
                    found.after.setdefault(attempt, []).extend((rank, record) for record in trained)
            continue
        readers.append(_Backward(rank, path))
    for hold in (True, False):  # every file down to the checkpoint's step first, then on where no file showed its saver
        for reader in readers:
            reader.read(found, hold)
    chosen = max(found.writers) if found.writers else max(found.after, default=None)
    records = []
    for rank, item in found.after.get(chosen, []) if chosen is not None else []:
        try:
            record = item if isinstance(item, dict) else json.loads(item)
        except ValueError:
            continue
        if isinstance(record, dict) and isinstance(record.get("micro_batch"), int):
            records.append({**record, "rank": rank})
    records.sort(key=lambda r: (r["step"], r["rank"], r["micro_batch"]))
    world = found.worlds.get(chosen) if chosen is not None else None
    if world is None and chosen is not None:  # its start lines lie before the checkpoint's step (not read): its ranks
        trained = {r["rank"] for r in records} | {rank for attempt, rank in found.wrote if attempt == chosen}
        world = len(trained) or None
    result = Continuation(chosen, world, records)
    _CONTINUATIONS[key] = result
    while len(_CONTINUATIONS) > _MAX_SCANS:
        _CONTINUATIONS.pop(next(iter(_CONTINUATIONS)))
    return result


class LedgerWriter:
    """Appends one rank's records; each step is in the page cache at once, fsynced every ``fsync_every`` steps."""

    def __init__(self, run_dir: Path, rank: int, fsync_every: int = 100, resume_step: int | None = None) -> None:
        """``resume_step``: this attempt resumes from that step; the one pass that numbers the attempt also
        answers ``around_resume`` for it, so the plugins checking the resume do not read the ledger again."""
        self.path = ledger_path(run_dir, rank)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._handle: MappedLines | None = MappedLines(self.path)  # a torn last line is closed first: the start line stays readable
        self._scan: _Scan | None = _Scan(self.path, resume_step, before_running=True)
        self.attempt = run_attempt(run_dir, rank, self._scan.highest_trained)  # the run's number, alike on every rank
        self._scan.current = self.attempt
        self._run_dir = _key(Path(run_dir))
        _RUNNING[self._run_dir] = self.attempt
        if resume_step is not None:
            _remember(self.path, self._scan)
        else:
            self._scan = None
        self.fsync_every = max(1, fsync_every)
        self._steps = 0

    def start(self, step: int, world_size: int, resumed_from: str | None, new_series: bool = False) -> None:
        """The attempt's start line; ``new_series``: a ``train()`` call from the start on weights an earlier call of the
        same process trained (its steps count again from 1 and supersede nothing of the earlier calls)."""
        record = {"event": "start", "attempt": self.attempt, "step": step, "world_size": world_size, "resumed_from": resumed_from}
        self._write({**record, "new_series": True} if new_series else record)
        self.sync()
        if self._scan is not None and self._handle is not None:
            stat = os.stat(self.path)
            self._scan.known = (stat.st_size, stat.st_mtime_ns)  # only this attempt's start line came after the shared pass

    def write_step(self, records: list[dict[str, Any]]) -> None:
        self._append_step("".join(dumps({"attempt": self.attempt, **record}, separators=(",", ":")) + "\n" for record in records))

    def write_hashes(self, step: int, epoch: int, batches: list[tuple[int, str, list[str], list[Any] | None]]) -> None:
        """One step's records, ``(micro-batch, batch hash, sample hashes, sample ids)`` each (hashes as hex64 strings),
        formatted directly: the per-step path, the same JSON a ``write_step`` record gives without a dict per micro-batch."""
        lines = []
        for micro, batch_hash, samples, ids in batches:
            listed = '["' + '","'.join(samples) + '"]' if samples else "[]"
            named = "null" if ids is None else dumps(ids, separators=(",", ":"))
            lines.append(f'{{"attempt":{self.attempt},"step":{step},"micro_batch":{micro},"epoch":{epoch},'
                         f'"batch_hash":"{batch_hash}","sample_hashes":{listed},"sample_ids":{named}}}\n')
        self._append_step("".join(lines))

    def _append_step(self, text: str) -> None:
        if self._scan is not None:
            self._forget_scan()  # every look at the resume happens before the first step of the attempt is written
        if self._handle is not None:
            self._handle.write(text.encode("utf-8"))  # into the mapped page cache: kept through a kill -9, no system call
        self._steps += 1
        if self._steps % self.fsync_every == 0:
            self.sync()

    def _write(self, record: dict[str, Any]) -> None:
        if self._handle is not None:
            self._handle.write((dumps(record, separators=(",", ":")) + "\n").encode("utf-8"))

    def sync(self) -> None:
        if self._handle is not None:
            self._handle.sync()

    def _forget_scan(self) -> None:
        """The resume is behind us: free the records kept for it (a later ``around_resume`` reads the file afresh)."""
        if self._scan is not None and _SCANS.get(_key(self.path)) is self._scan:
            del _SCANS[_key(self.path)]
        self._scan = None

    def close(self) -> None:
        self._forget_scan()
        if _RUNNING.get(self._run_dir) == self.attempt:
            del _RUNNING[self._run_dir]
        if self._handle is not None:
            self._handle.close(sync=True)
            self._handle = None


def _run_dir(path: Path) -> Path:
    path = Path(path)
    if (path / LEDGER_DIR).is_dir():
        return path
    if (path / "harness" / LEDGER_DIR).is_dir():
        return path / "harness"
    raise FileNotFoundError(f"no ledger under {path}: expected {path / 'harness' / LEDGER_DIR} (is the data_hash plugin enabled?)")


def read_ledger(path: str | Path) -> Any:
    """The whole run's ledger as a pandas DataFrame, one row per sample.

    ``path`` is the Trainer's output_dir or its ``harness/`` run directory.
    Columns: ``attempt``, ``rank``, ``step``, ``micro_batch``, ``epoch``,
    ``row``, ``sample_id``, ``sample_hash``, ``batch_hash`` and
    ``superseded`` (True for steps an interrupted attempt trained past the
    checkpoint that a later attempt, on any rank, resumed from: their updates
    were lost; a later ``train()`` call of the same process that started over
    on the trained weights supersedes nothing).
    """
    import pandas as pd

    rows: list[dict[str, Any]] = []
    starts: dict[tuple[int, int], int] = {}
    series_starts: set[int] = set()  # attempts that began a new series (another train() call of the same process)
    for file in sorted(_run_dir(Path(path)).joinpath(LEDGER_DIR).glob("rank-*.jsonl")):
        rank = int(file.stem.split("-", 1)[1])
        for record in iter_records(file):
            if record.get("event") == "start":
                starts[(rank, record["attempt"])] = int(record["step"])
                if record.get("new_series") is True:
                    series_starts.add(record["attempt"])
                continue
            ids = record.get("sample_ids") or [None] * len(record["sample_hashes"])
            for i, (sample_hash, sample_id) in enumerate(zip(record["sample_hashes"], ids)):
                rows.append(
                    {
                        "attempt": record["attempt"],
                        "rank": rank,
                        "step": record["step"],
                        "micro_batch": record["micro_batch"],
                        "epoch": record["epoch"],
                        "row": i,
                        "sample_id": sample_id,
                        "sample_hash": sample_hash,
                        "batch_hash": record["batch_hash"],
                    }
                )
    # attempts are the run's (one number on every rank): a later attempt on any rank supersedes what this one trained past
    # its start (a rank left out of a resume on fewer processes has no start line of its own after its steps)
    attempts = {attempt for _, attempt in starts} | {row["attempt"] for row in rows}

    def series(attempt: int) -> int:  # a second train() call from step 0 on trained weights supersedes nothing before it
        return sum(1 for s in series_starts if s <= attempt)

    later_start = {
        attempt: min((s for (_, a), s in starts.items() if a > attempt and series(a) == series(attempt)), default=None)
        for attempt in attempts
    }
    for row in rows:
        cut = later_start.get(row["attempt"])
        row["superseded"] = cut is not None and row["step"] > cut
    columns = ["attempt", "rank", "step", "micro_batch", "epoch", "row", "sample_id", "sample_hash", "batch_hash", "superseded"]
    return pd.DataFrame(rows, columns=columns)
