"""Whether the loss the Trainer scales across ranks was normalised by ``num_items_in_batch``: asked once per train() call.

With several ranks averaging tokens the Trainer multiplies each rank's loss
by the world size (:func:`harness.lib.world_scaling.world_loss_scale`). The
step record turns that back into this rank's own mean loss, and how depends
on the head: a loss normalised by ``num_items_in_batch`` (every rank's label
count) needs this rank's label count; a head that ignores it returned its
own mean, which the world size alone scaled. The first micro-batch of a
train() call tells which: its own mean is recomputed (one forward pass
without gradients, in eval mode) on every rank, each for its own record, and
read in that step's one transfer, before the record is corrected. No
collective: each rank judges its own micro-batch.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from harness.lib.world_scaling import WorldScaling, judge_world_scaling


@dataclass
class LossProbe:
    """One micro-batch's loss beside its own mean (device values until the guard's read, then ``judged``)."""

    mean: Any  # the micro-batch's own mean loss (device tensor)
    local_items: Any  # its label count on this rank (device tensor)
    global_items: Any  # num_items_in_batch (device tensor or number)
    scale: int  # what the Trainer multiplied the loss by
    source: str  # what computed the loss (harness.lib.world_scaling.loss_source)
    loss: Any = None  # compute_loss's loss for the micro-batch (device tensor), once it returned
    judged: WorldScaling | None = None

    def values(self) -> Any:
        """The four values as one float tensor on the loss's device: one entry in the step's read."""
        import torch

        device = self.loss.device
        return torch.stack([torch.as_tensor(v).detach().float().to(device).reshape(()) for v in
                            (self.loss, self.mean, self.local_items, self.global_items)])

    def settle(self, read: list[float]) -> WorldScaling:
        """Judge the read values (loss, mean, local count, global count); kept in ``judged`` for the step's metrics."""
        loss, mean, local, total = (float(v) for v in read)
        self.judged = WorldScaling(judge_world_scaling(loss, mean, local, total, self.scale), self.scale, loss, mean, local,
                                   total, self.source)
        return self.judged
