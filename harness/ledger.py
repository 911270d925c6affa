"""The data ledger: which samples every rank trained on at every step, in append-only files that survive a kill.

One JSON line per micro-batch in ``<run_dir>/ledger/rank-<r>.jsonl``, flushed
every step (a ``kill -9`` loses at most the step in flight) and fsynced every
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
from typing import IO, Any, Iterator

LEDGER_DIR = "ledger"


def ledger_path(run_dir: Path, rank: int) -> Path:
    return Path(run_dir) / LEDGER_DIR / f"rank-{rank}.jsonl"


def iter_records(path: Path) -> Iterator[dict[str, Any]]:
    """Every intact line of one rank's ledger (a line cut short by a kill is skipped)."""
    if not path.exists():
        return
    with open(path, encoding="utf-8") as handle:
        for line in handle:
            if not line.endswith("\n"):
                return  # the last line of a killed process may be incomplete
            try:
                yield json.loads(line)
            except json.JSONDecodeError:
                continue


def last_attempt(path: Path) -> int:
    """The highest attempt number in a rank's ledger (0 when there is none)."""
    return max((r.get("attempt", 0) for r in iter_records(path) if r.get("event") == "start"), default=0)


def around_resume(run_dir: Path, rank: int, resume_step: int) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """Earlier attempts' records of one rank around a resume from ``resume_step``.

    Returns (for every step up to the resume, the record of the attempt that
    trained it last; the records the newest earlier attempt trained after
    the resume step, i.e. what the interrupted run did next). The attempt now
    running (the newest start line) is left out.
    """
    records = list(iter_records(ledger_path(run_dir, rank)))
    current = max((r.get("attempt", 0) for r in records if r.get("event") == "start"), default=0)
    earlier = [r for r in records if r.get("event") is None and r["attempt"] < current]
    before: dict[tuple[int, int], dict[str, Any]] = {}
    for record in earlier:
        key = (record["step"], record["micro_batch"])
        if record["step"] <= resume_step and (key not in before or before[key]["attempt"] < record["attempt"]):
            before[key] = record
    after = [r for r in earlier if r["step"] > resume_step]
    newest = max((r["attempt"] for r in after), default=None)
    return list(before.values()), [r for r in after if r["attempt"] == newest]


class LedgerWriter:
    """Appends one rank's records; flushes each step, fsyncs every ``fsync_every`` steps."""

    def __init__(self, run_dir: Path, rank: int, fsync_every: int = 100) -> None:
        self.path = ledger_path(run_dir, rank)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.attempt = last_attempt(self.path) + 1
        self.fsync_every = max(1, fsync_every)
        self._handle: IO[str] | None = open(self.path, "a", encoding="utf-8")
        self._steps = 0

    def start(self, step: int, world_size: int, resumed_from: str | None) -> None:
        self._write({"event": "start", "attempt": self.attempt, "step": step, "world_size": world_size, "resumed_from": resumed_from})
        self.sync()

    def write_step(self, records: list[dict[str, Any]]) -> None:
        for record in records:
            self._write({"attempt": self.attempt, **record})
        if self._handle is not None:
            self._handle.flush()
        self._steps += 1
        if self._steps % self.fsync_every == 0:
            self.sync()

    def _write(self, record: dict[str, Any]) -> None:
        if self._handle is not None:
            self._handle.write(json.dumps(record, separators=(",", ":")) + "\n")

    def sync(self) -> None:
        if self._handle is not None:
            self._handle.flush()
            os.fsync(self._handle.fileno())

    def close(self) -> None:
        if self._handle is not None:
            self.sync()
            self._handle.close()
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
