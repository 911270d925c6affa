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
from pathlib import Path
from typing import Mapping

from harness.lib.stops import STOP_DIR_ENV

RUN_MARKER_FORMAT = "train-harness-wrapped-run/1"
RUN_MARKER_GLOB = "run.*.json"


def write_run_marker(run_dir: Path, env: Mapping[str, str] | None = None) -> Path | None:
    """Name ``run_dir`` in ``$HARNESS_STOP_DIR`` (atomically, once per directory); None when not under ``harness wrap``."""
    directory = (os.environ if env is None else env).get(STOP_DIR_ENV)
    if not directory or not Path(directory).is_dir():
        return None
    resolved = str(Path(run_dir).resolve())
    path = Path(directory) / f"run.{hashlib.sha1(resolved.encode()).hexdigest()[:16]}.json"
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        tmp.write_text(json.dumps({"format": RUN_MARKER_FORMAT, "run_dir": resolved, "pid": os.getpid()}), encoding="utf-8")
        os.replace(tmp, path)
    except OSError:
        return None
    return path


def read_run_markers(directory: Path | str) -> list[Path]:
    """The run directories named in ``directory``, each once, in the order their markers were written; damage skipped."""
    found: list[tuple[float, Path]] = []
    for path in Path(directory).glob(RUN_MARKER_GLOB):
        try:
            data = json.loads(path.read_text(encoding="utf-8"))
            if data.get("format") == RUN_MARKER_FORMAT and isinstance(data.get("run_dir"), str):
                found.append((path.stat().st_mtime, Path(data["run_dir"])))
        except (OSError, ValueError, AttributeError):
            continue
    runs: list[Path] = []
    for _, run_dir in sorted(found, key=lambda item: item[0]):
        if run_dir not in runs:
            runs.append(run_dir)
    return runs
