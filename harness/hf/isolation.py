"""What the manager's isolation reports: a plugin that raised, one switched off, one that asked to stop.

The manager catches the exception (training goes on without that call) and
calls these; they turn it into ``INTERNAL_PLUGIN_ERROR``, ``PLUGIN_DISABLED``
and ``PLUGIN_STOP`` findings. A stop becomes the pending action, agreed at
the next step guard like any other.
"""
from __future__ import annotations

from harness.core.actions import Action, strongest
from harness.core.codes import INTERNAL_PLUGIN_ERROR, PLUGIN_DISABLED, PLUGIN_STOP
from harness.core.context import RunContext


class IsolationReporter:
    """Installed as the manager's ``on_error`` and ``on_stop``."""

    def __init__(self, ctx: RunContext) -> None:
        self.ctx = ctx
        ctx.manager.on_error = self.plugin_failed
        ctx.manager.on_stop = self.plugin_stopped

    def plugin_failed(self, plugin: str, hook: str, exc: BaseException, tb: str) -> None:
        ctx, manager = self.ctx, self.ctx.manager
        count = manager.error_count(plugin)
        if count <= 3:
            pending = manager.wants_disabling(plugin)  # several processes: switched off on every rank at the next guard
            ctx.report(
                INTERNAL_PLUGIN_ERROR.code,
                f"plugin '{plugin}' raised {type(exc).__name__} in {hook}() at step {ctx.step}"
                f"{f' on rank {ctx.rank}' if ctx.world_size > 1 else ''}: {exc}. Training went on without this call."
                + (f" It reached max_plugin_errors ({manager.max_errors_per_plugin}) and is switched off on every rank at "
                   "the next step guard." if pending else ""),
                evidence={"hook": hook, "exception": repr(exc), "traceback": tb, "occurrence": count, "rank": ctx.rank},
                plugin=plugin,
            )
        if manager.is_disabled(plugin):  # one process: switched off at once (several: rank 0 reports the agreed switch-off)
            ctx.report(
                PLUGIN_DISABLED.code,
                f"plugin '{plugin}' raised {count} exceptions (last in {hook}()) and is switched off for the rest of the run.",
                evidence={"hook": hook, "errors": count},
                plugin=plugin,
            )

    def plugin_stopped(self, plugin: str, hook: str, stop: BaseException, _tb: str) -> None:
        self.ctx.report(
            PLUGIN_STOP.code,
            f"plugin '{plugin}' asked to stop training in {hook}() at step {self.ctx.step}: {stop}",
            evidence={"hook": hook, "reason": str(stop)},
            plugin=plugin,
        )
        self.ctx.pending_action = strongest(self.ctx.pending_action, Action.STOP)
