"""A plugin for a training process under test, enabled as ``stop_server:StopServerAtStep`` (tests/ on PYTHONPATH):
the tracking server goes down mid-run, after the mlflow plugin made its run."""
from __future__ import annotations

import os
import signal
import time
from pathlib import Path
from typing import Any

from harness import hookimpl


class StopServerAtStep:
    """At the end of step ``$STOP_SERVER_AT_STEP``: wait for the mlflow plugin's run (its ``run.json``), then kill the
    tracking server's process group ``$STOP_SERVER_PGID``."""

    name = "stop_server_at_step"

    @hookimpl
    def on_step_end(self, ctx: Any, step: int) -> None:
        if step != int(os.environ["STOP_SERVER_AT_STEP"]):
            return
        made = Path(ctx.run_dir) / "mlflow" / "run.json"
        deadline = time.time() + 60
        while not made.exists() and time.time() < deadline:
            time.sleep(0.1)
        os.killpg(int(os.environ["STOP_SERVER_PGID"]), signal.SIGKILL)
