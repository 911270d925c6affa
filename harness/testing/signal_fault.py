"""A preemption notice delivered to one rank in the middle of a step, for tests of the ``preemption`` plugin.

The process signals itself (``os.kill(os.getpid(), ...)``) in ``inspect_batch``
of the chosen step, before that step's forward pass, as a scheduler's SIGTERM
reaching one rank of a job would. Once per run directory: a resumed run that
passes the step again is not signalled twice.
"""
from __future__ import annotations

import os
import signal
from pathlib import Path


def send_signal_once(run_dir: Path, rank: int, name: str) -> bool:
    """Signal this process with ``name`` (e.g. ``SIGTERM``) unless this rank already did in ``run_dir``; True if sent."""
    marker = Path(run_dir) / f"signalled.rank-{rank}"
    if marker.exists():
        return False
    marker.parent.mkdir(parents=True, exist_ok=True)
    marker.write_text(name, encoding="utf-8")
    os.kill(os.getpid(), getattr(signal, name))
    return True
