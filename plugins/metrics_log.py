"""metrics_log: keeps the run's numbers on disk, so reports need only the run directory.

Two files on rank 0: ``metrics.jsonl`` (what the Trainer logs: loss, grad
norm, LR, eval metrics, at ``logging_steps``) and ``steps.jsonl`` (one line
per optimizer step: loss, grad norm, LR, skips, tokens processed, step and
data time). The step loss and grad norm arrive as host floats (the step
guard read them in its one transfer), so no record costs a device sync; step
records still wait in a short buffer, to keep the file writes few, and are
written when the Trainer logs, at checkpoints, at the end, or every
``flush_every`` steps.

Both files are strict JSON: a non-finite number is written as the string
"nan", "inf" or "-inf" (:mod:`harness.core.strictjson`), so jq, JavaScript or
Go read a line with a NaN loss; readers take numbers through ``as_float``.
"""
from __future__ import annotations

import time
from typing import Any

from pydantic import BaseModel, ConfigDict, Field

from harness.core.appendfile import LineAppender
from harness.core.hookspecs import hookimpl
from harness.core.plugin import Plugin
from harness.core.strictjson import dumps


class MetricsLogOptions(BaseModel):
    """Options of the ``metrics_log`` plugin."""

    model_config = ConfigDict(extra="forbid")

    flush_every: int = Field(
        10, ge=1,
        description="Write buffered per-step records to steps.jsonl at least every this many steps (one file write each); "
        "a kill -9 loses at most the records since the last write.",
    )


class MetricsLog(Plugin):
    """Appends logged metrics to harness/metrics.jsonl and per-step records to harness/steps.jsonl on rank 0."""

    name = "metrics_log"
    Options = MetricsLogOptions
    options: MetricsLogOptions

    def __init__(self) -> None:
        self.options = MetricsLogOptions()
        self._logged: LineAppender | None = None  # never raise into training: a full disk holds the lines until it can write
        self._steps: LineAppender | None = None
        self._pending: list[tuple[Any, ...]] = []  # per step, until the next flush
        self._tokens = 0  # token positions processed by all ranks (rank 0's count x world size), restored at resume

    @hookimpl
    def on_run_start(self, ctx: Any) -> None:
        if ctx.is_main:
            self._logged = LineAppender(ctx.path("metrics.jsonl"))
            self._steps = LineAppender(ctx.path("steps.jsonl"))
        self._tokens = 0
        self._pending = []

    @hookimpl
    def on_resume(self, state: dict[str, Any] | None) -> None:
        if state:
            self._tokens = int(state.get("tokens", 0))

    @hookimpl
    def on_step_end(self, ctx: Any, step: int, metrics: dict[str, Any]) -> None:
        if self._steps is None:
            return
        step_tokens = int(metrics.get("tokens") or 0) * ctx.world_size
        self._tokens += step_tokens
        # the step's metrics dict by reference (the bridge builds a new one per step; the record is built at the flush, off
        # the per-step path); the wall time places a finding on the right record when a resume replays steps
        self._pending.append((step, self._tokens, step_tokens, metrics, time.time()))
        if len(self._pending) >= self.options.flush_every:
            self._flush()

    @hookimpl
    def on_log(self, ctx: Any, step: int, logs: dict[str, float]) -> None:
        if self._logged is not None:
            self._logged.write(dumps({"step": step, **logs}, default=float) + "\n")
        self._flush()

    @hookimpl
    def checkpoint_state(self, ctx: Any, step: int) -> dict[str, Any]:
        self._flush()
        return {"tokens": self._tokens}

    @hookimpl(tryfirst=True)
    def on_run_end(self, ctx: Any) -> None:
        self._flush()
        for handle in (self._logged, self._steps):
            if handle is not None:
                handle.close()
        self._logged = self._steps = None

    def _flush(self) -> None:
        if self._steps is None or not self._pending:
            return
        # strict JSON; a line with a NaN/Inf (rare) is encoded twice, the others once, with no per-value test of finiteness
        lines = [dumps({k: _host(v) for k, v in _record(pending).items()}) for pending in self._pending]
        self._pending = []
        self._steps.write("\n".join(lines) + "\n")


def _record(pending: tuple[Any, ...]) -> dict[str, Any]:
    """One line of steps.jsonl from the tuple ``on_step_end`` queued."""
    step, tokens, step_tokens, metrics, wall = pending
    get = metrics.get
    return {"step": step, "tokens": tokens, "step_tokens": step_tokens, "loss": get("loss"), "grad_norm": get("grad_norm"),
            "lr": get("lr"), "skipped": bool(get("skipped")), "optimizer_skipped": bool(get("optimizer_skipped")),
            "step_time": get("step_time"), "data_time": get("data_time"), "time": round(wall, 3)}


_PLAIN = frozenset({float, int, bool, str, type(None)})


def _host(value: Any) -> Any:
    """A JSON-ready value (non-finite floats stay floats: ``dumps`` writes them as "nan", "inf").

    Step metrics are host values already (the step guard's one read); scalars of numpy or torch are made numbers,
    anything else JSON cannot hold is left out.
    """
    if type(value) not in _PLAIN:  # nearly every value is plain (the step guard's read): one test, no conversion
        if hasattr(value, "item") and getattr(value, "ndim", 0) == 0:
            value = value.item()  # a numpy scalar, or a 0-d tensor a third-party hook put into the metrics (rare: a read)
        if value is not None and not isinstance(value, (bool, int, float, str)):
            return None
    return value
