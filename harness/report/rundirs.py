"""Finding run directories on disk: only folders this harness wrote count, and no symlink below is followed.

Used by ``harness report`` and ``harness explain`` to find the runs under a
path (the demo writes several nested runs).
"""
from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from harness.core.received import read_received_json
from harness.lib.runinfo import RUN_FILE, RUN_FORMAT
from harness.report.record import read_run_config


def find_run_dirs(path: Path) -> list[Path]:
    """Run directories at or below ``path``: ``path/harness``, or ``path`` itself, and nested runs (depth 3)."""
    return scan_run_dirs(path)[0]


def scan_run_dirs(path: Path) -> tuple[list[Path], list[Path]]:
    """(run directories at or below ``path``, symlinks that were not followed).

    Only real harness run directories count (:func:`is_run_dir`); no symlink
    below ``path`` is followed (``path`` itself is the user's own choice), and
    checkpoints are not searched.
    """
    path = Path(path)
    found: list[Path] = []
    links: list[Path] = []
    for candidate in [path, path / "harness"]:
        if candidate != path and candidate.is_symlink():
            links.append(candidate)
            break
        if is_run_dir(candidate):
            found.append(candidate)
            break
    level = [path]
    for _ in range(3):  # <path>/*/harness, */*/harness, */*/*/harness
        below: list[Path] = []
        for folder in level:
            try:
                entries = sorted(os.scandir(folder), key=lambda e: e.name)
            except OSError:
                continue
            for entry in entries:
                child = Path(entry.path)
                if entry.name.startswith("checkpoint-"):
                    continue
                if entry.is_symlink():
                    if entry.name == "harness" or (child / "harness").exists():
                        links.append(child)
                    continue
                if not entry.is_dir(follow_symlinks=False):
                    continue
                below.append(child)
        for folder in below:
            candidate = folder / "harness"
            if candidate.is_symlink():
                if candidate not in links:
                    links.append(candidate)
            elif candidate not in found and is_run_dir(candidate):
                found.append(candidate)
        level = below
    return found, links


def is_run_dir(candidate: Path) -> bool:
    """Whether ``candidate`` is a run directory this harness wrote (and so one ``harness report`` may rebuild).

    Its run.json carries ``"format": "train-harness-run/..."``; or (runs from
    before the marker) it is named ``harness`` and holds the harness's resolved
    config.yaml (``plugins`` and ``max_plugin_errors`` at the top level) and
    either findings.jsonl or a run.json whose attempts are the harness's. A
    user's folder that merely has a run.json is not one.
    """
    candidate = Path(candidate)
    if not candidate.is_dir():
        return False
    info = _read_json_object(candidate / RUN_FILE)
    if isinstance(info.get("format"), str) and info["format"].startswith(RUN_FORMAT.split("/")[0] + "/"):
        return True
    if candidate.name != "harness":
        return False
    config, _ = read_run_config(candidate)
    if not {"plugins", "max_plugin_errors"} <= set(config):
        return False
    attempts = info.get("attempts")
    harness_attempts = isinstance(attempts, list) and bool(attempts) and all(
        isinstance(a, dict) and {"status", "start_step"} <= set(a) for a in attempts)
    return (candidate / "findings.jsonl").is_file() or harness_attempts


def _read_json_object(path: Path) -> dict[str, Any]:
    try:
        data = read_received_json(path)  # never a link, a FIFO or a device; capped
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}
