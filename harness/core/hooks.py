"""The typed facade over the plugin manager: one method per hook (as tox's plugin manager has).

Callers write ``manager.hooks.on_loss(ctx, loss, batch, step, micro_step)``,
never a hook name in a string, so a reader (or a type checker) can follow a
micro-batch from the Trainer into every plugin. Each method keeps the
manager's isolation: an exception inside one plugin becomes an
``INTERNAL_PLUGIN_ERROR`` finding and the others still run.
"""
from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from pydantic import BaseModel

    from harness.core.findings import Finding
    from harness.core.protocols import HookCaller, PluginContext


class Hooks:
    """Calls the hooks of ``harness.core.hookspecs`` on every enabled plugin, in the order the loop runs them."""

    def __init__(self, manager: "HookCaller") -> None:
        self._manager = manager

    # -- per plugin, at set-up and around checkpoints ---------------------------------------

    def configure(self, name: str, ctx: "PluginContext", options: "BaseModel | None") -> None:
        self._manager.call_plugin(name, "configure", ctx=ctx, options=options)

    def checkpoint_state(self, name: str, ctx: "PluginContext", step: int) -> Any:
        return self._manager.call_plugin(name, "checkpoint_state", ctx=ctx, step=step)

    def on_resume(self, name: str, ctx: "PluginContext", checkpoint_dir: Path, state: dict[str, Any] | None) -> None:
        self._manager.call_plugin(name, "on_resume", ctx=ctx, checkpoint_dir=checkpoint_dir, state=state)

    def report_sections(self, name: str, run: Any, options: "BaseModel | None") -> Any:
        """Unisolated: the report builder catches a failing section itself (and notes it in the report)."""
        return self._manager.call_plugin_unisolated(name, "report_sections", run=run, options=options)

    # -- the run ---------------------------------------------------------------------------------

    def on_run_start(self, ctx: "PluginContext", trainer: Any) -> None:
        self._manager.call("on_run_start", ctx=ctx, trainer=trainer)

    def inspect_dataset(self, ctx: "PluginContext", dataset: Any, split: str) -> None:
        self._manager.call("inspect_dataset", ctx=ctx, dataset=dataset, split=split)

    def inspect_batch(self, ctx: "PluginContext", batch: dict[str, Any], step: int, micro_step: int) -> None:
        self._manager.call("inspect_batch", ctx=ctx, batch=batch, step=step, micro_step=micro_step)

    def on_loss(self, ctx: "PluginContext", loss: Any, batch: dict[str, Any], step: int, micro_step: int) -> None:
        self._manager.call("on_loss", ctx=ctx, loss=loss, batch=batch, step=step, micro_step=micro_step)

    def on_before_optimizer_step(
        self, ctx: "PluginContext", step: int, model: Any, optimizer: Any, grad_norm: float | None, loss: float | None,
        micro_losses: list[float] | None = None,
    ) -> None:
        self._manager.call(
            "on_before_optimizer_step", ctx=ctx, step=step, model=model, optimizer=optimizer, grad_norm=grad_norm, loss=loss,
            micro_losses=micro_losses if micro_losses is not None else [],
        )

    def on_step_agreed(self, ctx: "PluginContext", step: int, action: Any, model: Any, optimizer: Any) -> None:
        self._manager.call("on_step_agreed", ctx=ctx, step=step, action=action, model=model, optimizer=optimizer)

    def on_step_end(self, ctx: "PluginContext", step: int, metrics: dict[str, Any]) -> None:
        self._manager.call("on_step_end", ctx=ctx, step=step, metrics=metrics)

    def on_log(self, ctx: "PluginContext", step: int, logs: dict[str, float]) -> None:
        self._manager.call("on_log", ctx=ctx, step=step, logs=logs)

    def on_metrics(self, ctx: "PluginContext", step: int, metrics: dict[str, Any]) -> None:
        self._manager.call("on_metrics", ctx=ctx, step=step, metrics=metrics)

    def on_evaluate(self, ctx: "PluginContext", step: int, metrics: dict[str, float]) -> None:
        self._manager.call("on_evaluate", ctx=ctx, step=step, metrics=metrics)

    def on_checkpoint_save(self, ctx: "PluginContext", step: int, checkpoint_dir: Path) -> None:
        self._manager.call("on_checkpoint_save", ctx=ctx, step=step, checkpoint_dir=checkpoint_dir)

    def on_run_end(self, ctx: "PluginContext", status: str, error: BaseException | None) -> None:
        self._manager.call("on_run_end", ctx=ctx, status=status, error=error)

    def on_report(self, ctx: "PluginContext", report: Any) -> None:
        self._manager.call("on_report", ctx=ctx, report=report)

    # -- findings ---------------------------------------------------------------------------------

    def on_finding(self, ctx: "PluginContext", finding: "Finding") -> None:
        self._manager.call("on_finding", ctx=ctx, finding=finding)

    def decide_action(self, ctx: "PluginContext", finding: "Finding") -> tuple[str, Any] | None:
        """firstresult: ``(plugin, answer)`` of the first plugin that answers, or None."""
        return self._manager.call_first("decide_action", ctx=ctx, finding=finding)
