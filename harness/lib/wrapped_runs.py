"""Which run directories a job under ``harness wrap`` produced, told to wrap through its private folder.

The same channel as the stop markers (:mod:`harness.lib.stops`): rank 0
leaves a small JSON marker per run directory in ``$HARNESS_STOP_DIR`` when a
``train()`` call begins, and wrap reads them after the command ended, for its
closing summary. Written at the start, so a crashed or killed run is still
named; nothing is written outside ``harness wrap`` (the folder must exist).
Standard library only: wrap reads markers without importing torch.
"""
from __future__ import annotations

import hashlib
import json
import os
import time
from pathlib import Path
from typing import Mapping

from harness.lib.stops import STOP_DIR_ENV

RUN_MARKER_FORMAT = "train-harness-wrapped-run/1"
RUN_MARKER_GLOB = "run.*.json"


def write_run_marker(run_dir: Path, env: Mapping[str, str] | None = None, since: float | None = None) -> Path | None:
    """Name ``run_dir`` in ``$HARNESS_STOP_DIR`` (atomically, once per directory); None when not under ``harness wrap``.

    The marker keeps ``since`` (the wall time this job attached the harness
    there; now when not given) from its first write: the closing summary
    counts only the findings made from then on, not those of earlier jobs
    that trained into the same output_dir.
    """
    directory = (os.environ if env is None else env).get(STOP_DIR_ENV)
    if not directory or not Path(directory).is_dir():
        return None
    resolved = str(Path(run_dir).resolve())
    path = Path(directory) / f"run.{hashlib.sha1(resolved.encode()).hexdigest()[:16]}.json"
    first = _since(path)
    since = first if first is not None else since if since is not None else time.time()
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        body = {"format": RUN_MARKER_FORMAT, "run_dir": resolved, "pid": os.getpid(), "since": since}
        tmp.write_text(json.dumps(body), encoding="utf-8")
        os.replace(tmp, path)
    except OSError:
        return None
    return path


def _since(path: Path) -> float | None:
    try:
        value = json.loads(path.read_text(encoding="utf-8")).get("since")
    except (OSError, ValueError, AttributeError):
        return None
    return float(value) if isinstance(value, (int, float)) and not isinstance(value, bool) else None


def read_run_markers(directory: Path | str) -> list[Path]:
    """The run directories named in ``directory``, each once, in the order their markers were written; damage skipped."""
    return list(read_run_markers_since(directory))


def read_run_markers_since(directory: Path | str) -> dict[Path, float | None]:
    """:func:`read_run_markers`, each with the time this job began training there (None: a marker without one)."""
    found: list[tuple[float, Path, float | None]] = []
    for path in Path(directory).glob(RUN_MARKER_GLOB):
        try:
            data = json.loads(path.read_text(encoding="utf-8"))
            if data.get("format") == RUN_MARKER_FORMAT and isinstance(data.get("run_dir"), str):
                since = data.get("since")
                found.append((path.stat().st_mtime, Path(data["run_dir"]),
                              float(since) if isinstance(since, (int, float)) and not isinstance(since, bool) else None))
        except (OSError, ValueError, AttributeError):
            continue
    runs: dict[Path, float | None] = {}
    for _, run_dir, since in sorted(found, key=lambda item: item[0]):
        runs.setdefault(run_dir, since)
    return runs
