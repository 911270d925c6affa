"""The step guard: what happens between backward and the optimizer update, on every rank.

In order: the step's one device-to-host read (the step loss, the grad norm
and every tensor plugins deferred), ``on_before_optimizer_step`` with host
floats, the LR this update uses, then ``ctx.agree()`` (the step's one
collective) to get the action every rank takes. The optimizer adapters in
:mod:`harness.hf.optimizers` call :meth:`StepGuard.guard` from inside the
optimizer's ``step`` and skip the update unless the answer is ``continue``.
"""
from __future__ import annotations

import time
from typing import Any, Callable

from harness.core.actions import Action
from harness.core.codes import SKIP_NOT_APPLIED
from harness.core.context import RunContext
from harness.hf.step_record import StepRecord

HARNESS = "harness"  # the owner of the bridge's own deferred values


class StepGuard:
    """Runs the guard once per optimizer step and keeps its outcome in the current step's record."""

    def __init__(
        self,
        ctx: RunContext,
        record: Callable[[], StepRecord],
        *,
        rollback_available: bool = False,
        in_training_step: Callable[[], bool] = lambda: False,
        current_lr: Callable[[], float | None] = lambda: None,
    ) -> None:
        self.ctx = ctx
        self._record = record
        self.rollback_available = rollback_available  # without a handler a rollback becomes save_and_stop
        self._in_training_step = in_training_step
        self._current_lr = current_lr

    def guard(self, model: Any, optimizer: Any) -> Action:
        """Fire the pre-step hook, agree the action with every rank, remember it for step end."""
        started = time.perf_counter()
        try:
            return self._guard(model, optimizer)
        finally:
            if not self._in_training_step():  # under DeepSpeed the guard runs inside training_step, already timed
                self._record().guard_time += time.perf_counter() - started

    def _guard(self, model: Any, optimizer: Any) -> Action:
        ctx, record = self.ctx, self._record()
        self.read_step_values(record)
        ctx.manager.hooks.on_before_optimizer_step(ctx, ctx.step, model, optimizer, record.grad_norm, record.step_loss)
        record.lr = self._current_lr()  # the LR this update uses, before the scheduler moves
        action = ctx.agree()
        if action is Action.ROLLBACK and not self.rollback_available:
            action = Action.SAVE_AND_STOP
        record.agreed = action
        return action

    def read_step_values(self, record: StepRecord) -> None:
        """The step's one device-to-host copy: the step loss, the grad norm and every tensor plugins deferred.

        At most once per record; step end calls it too, for a Trainer that
        never stepped the optimizer in this step.
        """
        ctx = self.ctx
        if record.values_read:
            return
        record.values_read = True
        loss = record.step_loss if record.step_loss is not None else record.loss_sum
        for key, value in (("loss", loss), ("grad_norm", record.grad_norm)):
            if value is not None and hasattr(value, "detach"):
                ctx.defer(key, value, owner=HARNESS)
        ctx.read_deferred()
        got_loss = ctx.deferred("loss", owner=HARNESS)
        got_norm = ctx.deferred("grad_norm", owner=HARNESS)
        if got_loss:
            record.step_loss = float(got_loss[-1])
        elif loss is not None:
            record.step_loss = float(loss)
        if got_norm:
            record.grad_norm = float(got_norm[-1])
        elif record.grad_norm is not None:
            record.grad_norm = float(record.grad_norm)

    # -- what the optimizer adapters tell the guard ----------------------------------------------------

    def note_optimizer_skip(self, skipped: bool) -> None:
        """The optimizer (DeepSpeed's overflow check, an fp16 GradScaler) skipped an update the harness let through."""
        self._record().optimizer_skipped = skipped

    def skip_not_applied(self, detail: str) -> None:
        self.ctx.report(
            SKIP_NOT_APPLIED.code,
            f"the harness could not skip the optimizer update at step {self.ctx.step}: {detail}. "
            "The update was applied; parameters moved.",
            evidence={"optimizer": detail},
            plugin=HARNESS,
        )


def forget_late_skip(ctx: RunContext) -> None:
    """At step begin: a skip asked after the last guard came too late for that update, which is done."""
    if ctx.pending_action is Action.SKIP_STEP:
        ctx.pending_action = Action.CONTINUE


def current_lr(trainer: Any) -> float | None:
    """The learning rate of the first parameter group (the scheduler's view when there is one)."""
    scheduler = getattr(trainer, "lr_scheduler", None)
    try:
        if scheduler is not None:
            return float(scheduler.get_last_lr()[0])
        return float(trainer.optimizer.param_groups[0]["lr"])
    except Exception:  # noqa: BLE001 - a missing LR must not break a step
        return None
