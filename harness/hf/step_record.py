"""Everything the bridge knows about the optimizer step in flight, in one record.

The bridge replaces the record at every step begin
(``StepRecord(data_time=carried)``) instead of resetting fields by hand, so a
value can never leak from one step into the next. The one thing carried over
is the data-loader wait: the Trainer fetches a step's micro-batches before
that step begins, so the time measured then belongs to the step about to
begin (see :class:`harness.hf.tap.MicroBatchTap`).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from harness.core.actions import Action
from harness.lib.world_scaling import WORLD_SCALING_KEY


@dataclass
class StepRecord:
    """One optimizer step as the bridge saw it; ``metrics()`` is what ``on_step_end`` gets."""

    data_time: float = 0.0  # seconds this step waited for its batches (fetched before the step began)
    loss_sum: Any = None  # sum of training_step's returned losses (device tensor), the fallback step loss
    step_loss: Any = None  # the step loss as the Trainer logs it (device tensor until read, then a host float)
    micro_batches: int = 0
    micro_losses: list[Any] = field(default_factory=list)  # compute_loss's loss per micro-batch (tensors until read, then floats)
    tokens: int = 0  # token positions fed to the model in this step
    logged_loss: float | None = None  # loss_sum as a host float: the step loss the Trainer logs (on_step_end's "loss")
    grad_norm: Any = None  # the Trainer's clipped-gradient norm (device tensor until read, then a host float)
    lr: float | None = None  # the LR this update used, read before the scheduler moved
    agreed: Action = Action.CONTINUE  # the action every rank agreed at this step's guard
    values_read: bool = False  # the step's one device-to-host transfer happened
    optimizer_skipped: bool = False  # the optimizer itself skipped an update the harness let through (fp16 overflow)
    model_time: float = 0.0  # seconds in training_step (forward, backward, and under DeepSpeed the update)
    # several ranks with average_tokens_across_devices: each rank's loss is its label sum over EVERY rank's label count,
    # times the world size (the Trainer's rule); this rank's label count (device) turns it back into this rank's mean
    local_items: Any = None
    global_items: Any = None  # the Trainer's num_items_in_batch: every rank's label count of the step
    items_scale: int = 1  # what the Trainer multiplied the loss by
    # the loss is each micro-batch's own mean times items_scale (a head that ignores num_items_in_batch): this rank's mean
    # is the loss over items_scale, no label count needed
    loss_is_own_mean: bool = False
    probe: Any = None  # a LossProbe: the micro-batch whose own mean was recomputed at this step (once per train() call)
    guard_time: float = 0.0  # seconds in the step guard outside training_step

    def add_micro_batch_loss(self, loss: Any) -> None:
        """training_step returned ``loss`` (kept on the device: summed, not read)."""
        self.loss_sum = loss if self.loss_sum is None else self.loss_sum + loss
        self.micro_batches += 1

    def add_step_loss_part(self, part: Any, loss: Any) -> None:
        """compute_loss's share of the step loss (already divided as the Trainer divides it), and its own ``loss``."""
        self.step_loss = part if self.step_loss is None else self.step_loss + part
        self.micro_losses.append(loss)

    def add_local_items(self, count: Any, global_items: Any, scale: int) -> None:
        """A micro-batch's label count on this rank (device tensor, summed, not read), with the Trainer's step count and scale."""
        self.local_items = count if self.local_items is None else self.local_items + count
        self.global_items, self.items_scale = global_items, scale

    def add_own_mean_share(self, scale: int) -> None:
        """A micro-batch whose loss is its own mean times ``scale`` (the head ignores ``num_items_in_batch``)."""
        self.loss_is_own_mean, self.items_scale = True, scale

    def metrics(self, step_time: float | None) -> dict[str, Any]:
        """The ``on_step_end`` metrics; loss and grad norm are host floats once ``values_read``."""
        agreed = self.agreed
        metrics = {
            "loss": self.logged_loss if self.logged_loss is not None else self.step_loss,
            "grad_norm": self.grad_norm,
            "lr": self.lr,
            "skipped": agreed is not Action.CONTINUE,
            "optimizer_skipped": self.optimizer_skipped and agreed is Action.CONTINUE,
            "action": agreed._value_,  # the value, without the enum property's cost
            "micro_batches": self.micro_batches,
            "tokens": self.tokens,
            "step_time": step_time,
            "data_time": self.data_time,
            "model_time": self.model_time + self.guard_time,
        }
        if self.probe is not None and self.probe.judged is not None:  # how the recomputed micro-batch's loss stood to its mean
            metrics[WORLD_SCALING_KEY] = self.probe.judged
        return metrics
