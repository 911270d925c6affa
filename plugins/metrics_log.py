"""metrics_log: keeps every metric the Trainer logs in ``metrics.jsonl``, so reports need only the run directory."""
from __future__ import annotations

import json
from typing import IO, Any

from harness.hookspecs import hookimpl


class MetricsLog:
    """Appends the Trainer's logged metrics (loss, grad norm, LR, eval) to harness/metrics.jsonl on rank 0."""

    name = "metrics_log"

    def __init__(self) -> None:
        self._handle: IO[str] | None = None

    @hookimpl
    def on_run_start(self, ctx: Any) -> None:
        if ctx.is_main:
            self._handle = open(ctx.path("metrics.jsonl"), "a", encoding="utf-8")

    @hookimpl
    def on_log(self, ctx: Any, step: int, logs: dict[str, float]) -> None:
        if self._handle is not None:
            self._handle.write(json.dumps({"step": step, **logs}, default=float) + "\n")
            self._handle.flush()

    @hookimpl
    def on_run_end(self, ctx: Any) -> None:
        if self._handle is not None:
            self._handle.close()
            self._handle = None
