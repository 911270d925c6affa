"""Carrying out an agreed action on the Trainer, and the ``ACTION_TAKEN`` finding that says so.

``TrainerControl`` can save and stop but not skip: the skip itself happens in
the optimizer adapters (:mod:`harness.hf.optimizers`); here the step's
agreed action becomes ``should_save``/``should_training_stop``. A rollback
needs someone who can restart training from an older checkpoint (a stage
runner): that is a :class:`RollbackHandler` handed to ``attach(...,
rollback=handler)``. Without one a rollback saves and stops instead.
"""
from __future__ import annotations

from typing import Any, Protocol, runtime_checkable

from harness.core.actions import Action
from harness.core.codes import ACTION_TAKEN
from harness.core.context import RunContext
from harness.core.findings import Finding


@runtime_checkable
class RollbackHandler(Protocol):
    """Told when every rank agreed to roll back; restarts training after ``train()`` returns (stages/runner.py)."""

    def request(self, step: int, cause: Finding | None) -> None: ...


class ActionExecutor:
    """Applies agreed actions to ``TrainerControl``; knows whether this ``train()`` call was stopped by one."""

    def __init__(self, ctx: RunContext, rollback: RollbackHandler | None = None) -> None:
        self.ctx = ctx
        self.rollback = rollback
        self.stopped = False  # an action ended the current train() call (reset by the lifecycle per call)

    def apply(self, action: Action, control: Any) -> None:
        if action is Action.ROLLBACK and self.rollback is not None:
            control.should_training_stop = True  # the runner resumes from the last good checkpoint
            self.stopped = True
            causes = [f for f in self.ctx.findings if f.action == Action.ROLLBACK.value]
            self.rollback.request(self.ctx.step, causes[-1] if causes else None)
            return
        if action in (Action.SAVE_AND_STOP, Action.ROLLBACK):
            control.should_save = True
            control.should_training_stop = True
            self.stopped = True
        elif action is Action.STOP:
            control.should_training_stop = True
            self.stopped = True

    def late_stop(self, step: int) -> Action | None:
        """One process: a stop asked after the guard (in ``on_step_end``) still stops at this step.

        Returns the action to apply instead of the agreed one, or None. With
        several processes the next guard agrees it, so every rank stops alike.
        """
        ctx = self.ctx
        if ctx.world_size != 1 or not ctx.pending_action.stops_training:
            return None
        action, ctx.pending_action = ctx.pending_action, Action.CONTINUE
        self.record(action, step)
        return action

    def record(self, action: Action, step: int) -> None:
        """The ``ACTION_TAKEN`` finding: what the harness did at ``step`` and the finding that caused it."""
        ctx = self.ctx
        causes = [f for f in ctx.findings if f.action not in (None, "continue") and f.code not in ("ACTION_TAKEN",)]
        recent = [f for f in causes if f.step is not None and f.step >= step - 1]
        cause = recent[-1] if recent else (causes[-1] if causes else None)
        because = f" after {cause.code} from plugin '{cause.plugin}' on rank {cause.rank}" if cause else ""
        what = {
            Action.SKIP_STEP: "skipped the optimizer update",
            Action.SAVE_AND_STOP: "skipped the optimizer update, saved a checkpoint and stopped",
            Action.STOP: "stopped training",
            Action.ROLLBACK: "skipped the update and stopped to roll back to the last good checkpoint"
            if self.rollback is not None
            else "skipped the update and stopped (rollback needs a stage runner; saved a checkpoint)",
        }[action]
        ctx.report(
            ACTION_TAKEN.code,
            f"harness {what} at step {step}{because}.",
            step=step,
            evidence={"action": action.value, "cause": cause.id if cause else None},
            plugin="harness",
        )
