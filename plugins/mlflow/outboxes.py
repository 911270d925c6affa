"""Journals that earlier processes of a run directory left undelivered: found at start, delivered first when they belong
to the run this job logs to, named in a finding when they do not.

Each process journals to its own outbox (``harness/mlflow/outbox-<session>.jsonl``) and keeps its target beside it
(``.target``: tracking URI and run). A process killed while the tracker was down leaves records after its cursor;
without this, nothing ever delivered them and the run's history in MLflow kept a hole where the outage was.
"""
from __future__ import annotations

import os
import stat
from dataclasses import dataclass
from pathlib import Path

from harness.core.received import RefusedFile, read_received_json
from harness.core.strictjson import dumps
from harness.lib.journal import Journal
from harness.lib.safe_paths import UnsafePathError, safe_open_write

OUTBOX_GLOB = "outbox-*.jsonl"


def target_file(journal: Path) -> Path:
    return journal.with_name(journal.name + ".target")


def write_target(journal: Path, tracking_uri: str, run_id: str | None) -> None:
    """Record where a journal's records go (atomically, never through a link: the run directory's safe writer); a
    failed write leaves the target unknown, nothing else."""
    try:
        with safe_open_write(journal.parent.parent, target_file(journal), make_parent=False) as handle:
            handle.write(dumps({"tracking_uri": tracking_uri, "run_id": run_id}).encode("utf-8"))
    except (OSError, UnsafePathError):
        pass  # a full disk or a link in the way: a later job treats this journal as another run's and names it


@dataclass(frozen=True)
class Leftover:
    """An earlier process's journal with records after its cursor."""

    path: Path
    unsent_bytes: int
    tracking_uri: str | None  # None: its target was never recorded
    run_id: str | None  # None: its process never made its run (the tracker was down from its start)

    def belongs_to(self, tracking_uri: str, run_id: str | None, resumed: bool) -> bool:
        """Whether its records go to the run this job logs to: the same tracker and run; or the same tracker, a run the
        earlier process never made, and this job resuming it (the same training run, one run in MLflow)."""
        if self.tracking_uri != tracking_uri:
            return False
        return resumed if self.run_id is None else self.run_id == run_id

    def describe(self) -> str:
        run = f"run {self.run_id}" if self.run_id else "a run it never made"
        where = f" at {self.tracking_uri}" if self.tracking_uri else " (target unknown)"
        return f"{self.path.name} ({self.unsent_bytes:,} bytes for {run}{where})"


def leftovers(folder: Path, current: Path) -> list[Leftover]:
    """The outboxes in ``folder`` other than ``current`` with records after their cursor, oldest session first. Only
    regular files: a received run directory may hold links or FIFOs under those names."""
    found = []
    for path in sorted(folder.glob(OUTBOX_GLOB)):
        if path == current:
            continue
        try:
            info = os.lstat(path)
        except OSError:
            continue
        if not stat.S_ISREG(info.st_mode):
            continue
        unsent = info.st_size - Journal(path, writable=False).cursor
        if unsent <= 0:
            continue
        try:
            target = read_received_json(target_file(path), max_bytes=64 * 1024)
        except (OSError, RefusedFile, ValueError):
            target = None
        target = target if isinstance(target, dict) else {}
        uri, run_id = target.get("tracking_uri"), target.get("run_id")
        found.append(Leftover(path, unsent, uri if isinstance(uri, str) else None, run_id if isinstance(run_id, str) else None))
    return found
