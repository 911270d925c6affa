"""The data ledger: which samples every rank trained on at every step, in append-only files that survive a kill.

One JSON line per micro-batch in ``<run_dir>/ledger/rank-<r>.jsonl``, in the
file's page cache at every step (written through a shared mapping,
``harness.core.mapped_lines``: a ``kill -9`` loses at most the step in
flight, and the step pays no system call) and fsynced every
``fsync_every`` steps and at every checkpoint. Each process that trains
starts an *attempt* with a header line (the step it starts from), so a
resumed run's ledger holds both the interrupted run's steps past the
checkpoint and the steps that replaced them: exactly what a resume check
needs to compare.

``read_ledger`` turns the files into one pandas DataFrame, one row per sample.
"""
from __future__ import annotations

import json
import os
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
        self._best: dict[tuple[int, int], dict[str, Any]] = {}
        self._after_any: list[dict[str, Any]] = []  # after the resume step: the newest attempt's records
        self._after_writer: list[dict[str, Any]] = []  # ... the newest attempt's that trained the resume step itself
        self._writers: set[int] = set()  # attempts with a record at the resume step (they saved, or could save, its checkpoint)
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
        _keep_newest(self._after_any, record, attempt)
        if attempt in self._writers:
            _keep_newest(self._after_writer, record, attempt)

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


class LedgerWriter:
    """Appends one rank's records; each step is in the page cache at once, fsynced every ``fsync_every`` steps."""

    def __init__(self, run_dir: Path, rank: int, fsync_every: int = 100, resume_step: int | None = None) -> None:
        """``resume_step``: this attempt resumes from that step; the one pass that numbers the attempt also
        answers ``around_resume`` for it, so the plugins checking the resume do not read the ledger again."""
        self.path = ledger_path(run_dir, rank)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._handle: MappedLines | None = MappedLines(self.path)  # a torn last line is closed first: the start line stays readable
        self._scan: _Scan | None = _Scan(self.path, resume_step, before_running=True)
        self.attempt = self._scan.highest + 1
        if resume_step is not None:
            _remember(self.path, self._scan)
        else:
            self._scan = None
        self.fsync_every = max(1, fsync_every)
        self._steps = 0

    def start(self, step: int, world_size: int, resumed_from: str | None) -> None:
        self._write({"event": "start", "attempt": self.attempt, "step": step, "world_size": world_size, "resumed_from": resumed_from})
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
    checkpoint that a later attempt resumed from: their updates were lost).
    """
    import pandas as pd

    rows: list[dict[str, Any]] = []
    starts: dict[tuple[int, int], int] = {}
    for file in sorted(_run_dir(Path(path)).joinpath(LEDGER_DIR).glob("rank-*.jsonl")):
        rank = int(file.stem.split("-", 1)[1])
        for record in iter_records(file):
            if record.get("event") == "start":
                starts[(rank, record["attempt"])] = int(record["step"])
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
    later_start = {
        (rank, attempt): min((s for (r, a), s in starts.items() if r == rank and a > attempt), default=None)
        for (rank, attempt) in starts
    }
    for row in rows:
        cut = later_start.get((row["rank"], row["attempt"]))
        row["superseded"] = cut is not None and row["step"] > cut
    columns = ["attempt", "rank", "step", "micro_batch", "epoch", "row", "sample_id", "sample_hash", "batch_hash", "superseded"]
    return pd.DataFrame(rows, columns=columns)
