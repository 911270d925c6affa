"""The step guard: what happens between backward and the optimizer update, on every rank.

In order: the step's one device-to-host read (the step loss, the grad norm
and every tensor plugins deferred), ``on_before_optimizer_step`` with host
floats, the LR this update uses, then ``ctx.agree()`` (the step's one
collective) to get the action every rank takes, and ``on_step_agreed`` with it. The optimizer adapters in
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
        ctx.manager.hooks.on_before_optimizer_step(ctx, ctx.step, model, optimizer, record.grad_norm, record.step_loss, record.micro_losses)
        record.lr = self._current_lr()  # the LR this update uses, before the scheduler moves
        action = ctx.agree()
        ctx.manager.hooks.on_step_agreed(ctx, ctx.step, action, model, optimizer)  # every rank, the shared view alike
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
            if record.logged_loss is None and record.step_loss is None and _is_tensor(record.loss_sum):
                record.logged_loss = float(record.loss_sum)  # rare: no compute_loss seen and the guard ran mid-step
            return
        record.values_read = True
        # under DeepSpeed the guard runs inside the last micro-batch's backward: loss_sum lacks that micro-batch yet
        sum_complete = not self._in_training_step()
        reads = ctx.reads  # the harness's own values join the plugins' queue under its own name (no owner lookup each)
        step_loss, grad_norm, loss_sum = record.step_loss, record.grad_norm, record.loss_sum if sum_complete else None
        if hasattr(step_loss, "detach"):  # a tensor (None and host floats have no detach)
            reads.defer(HARNESS, "step_loss", step_loss)
        if hasattr(grad_norm, "detach"):
            reads.defer(HARNESS, "grad_norm", grad_norm)
        if hasattr(loss_sum, "detach"):
            reads.defer(HARNESS, "loss_sum", loss_sum)
        micro = record.micro_losses
        # one micro-batch whose loss is the step loss itself (the tap's part of a step without accumulation): read once
        same = len(micro) == 1 and micro[0] is step_loss and hasattr(step_loss, "detach")
        if micro and not same and all(_is_tensor(m) for m in micro):
            reads.defer(HARNESS, "micro_losses", _stack(micro))
        local_items = record.local_items
        if hasattr(local_items, "detach"):  # several ranks averaging tokens (see MicroBatchTap._items_scale)
            reads.defer(HARNESS, "local_items", local_items)
            if hasattr(record.global_items, "detach"):
                reads.defer(HARNESS, "global_items", record.global_items)
        probe = record.probe  # once per train() call: a micro-batch's loss beside its own mean (harness.hf.loss_probe)
        if probe is not None:
            reads.defer(HARNESS, "probe", probe.values())
        ctx.read_deferred()
        values = reads.values
        step_loss_read = values(HARNESS, "step_loss")
        if same:
            record.micro_losses = [float(step_loss_read[-1])] if step_loss_read else [float(micro[0])]
        elif micro:
            read = values(HARNESS, "micro_losses")
            record.micro_losses = [float(v) for v in read[-1]] if read else [float(m) for m in micro]
        record.step_loss = _host(step_loss_read, step_loss)
        record.grad_norm = _host(values(HARNESS, "grad_norm"), grad_norm)
        if sum_complete:
            record.logged_loss = _host(values(HARNESS, "loss_sum"), record.loss_sum)
            if record.step_loss is None:
                record.step_loss = record.logged_loss  # a training_step that never called compute_loss
        elif record.step_loss is not None:
            record.logged_loss = record.step_loss  # the Trainer's own rule makes them equal (see harness.hf.tap)
        if probe is not None:
            read = values(HARNESS, "probe")
            own_mean = probe.settle([float(v) for v in read[-1]]).own_mean if read else None
            if own_mean is not None:  # judged before the record is corrected: this step is right already
                record.loss_is_own_mean = own_mean
        if local_items is not None or record.loss_is_own_mean:
            self._to_rank_mean(record, values(HARNESS, "local_items"), values(HARNESS, "global_items"))

    @staticmethod
    def _to_rank_mean(record: StepRecord, local_read: list[Any], global_read: list[Any]) -> None:
        """This rank's mean loss from the Trainer's scaled share: ``value * global_items / (scale * local_items)``, or
        ``value / scale`` for a head whose loss ignores ``num_items_in_batch`` (its own mean, scaled all the same).

        The Trainer's logged loss (the mean over ranks) is the true loss; one
        rank's own value is its label sum over every rank's label count times
        the world size, so a rank with fewer labels than the others shows a
        lower loss and one with more a higher one (a clean run with uneven
        label masks then looks spiky). A rank without a label keeps its value.
        """
        if record.loss_is_own_mean:
            factor = 1.0 / record.items_scale
        else:
            local = _host(local_read, record.local_items)
            total = _host(global_read, record.global_items)
            if not local or not total or local <= 0:
                return
            factor = total / (record.items_scale * local)
        # each micro-batch's loss becomes its share of this rank's step mean, as in one process under accumulation
        record.micro_losses = [m * factor if isinstance(m, float) else m for m in record.micro_losses]
        if record.step_loss is not None:
            record.step_loss *= factor
        if record.logged_loss is not None:
            record.logged_loss *= factor

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


def _is_tensor(value: Any) -> bool:
    return value is not None and hasattr(value, "detach")


def _stack(losses: list[Any]) -> Any:
    """The step's micro-batch losses as one float tensor: one entry in the step's read (devices differ only under device_map)."""
    import torch

    device = losses[0].device
    return torch.stack([m.float().to(device) for m in losses])


def _host(read: list[Any], value: Any) -> float | None:
    """The value from the step's read, or the value itself made a float (None stays None)."""
    if read:
        return float(read[-1])
    return None if value is None else float(value)


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
