"""The gradient-accumulation loss trap: a step loss scaled by the number of accumulated micro-batches.

HF's ``Trainer.training_step`` (transformers 5.24) divides the loss that
``compute_loss`` returns by ``gradient_accumulation_steps`` unless it counts
as "already scaled for GA": ``loss_is_scaled_for_ga`` when set, else
``model_accepts_loss_kwargs and num_items_in_batch is not None`` (or a
``compute_loss_func``). A causal LM accepts loss kwargs, so the Trainer
passes ``num_items_in_batch`` (the label tokens of the whole step) and
does NOT divide: a ``compute_loss`` override that ignores it and returns its
micro-batch's own mean makes the step loss, and every gradient, GA times too
large; so does a head whose own loss ignores it (BERT's classifiers, T5's
conditional generation: see :mod:`harness.lib.world_scaling`). The check
compares the step loss with one micro-batch's own mean
(:func:`harness.lib.world_scaling.own_mean_loss`), recomputed once by a
forward pass without gradients at the start of training: the ratio is about
1 when the loss is right, about GA in the trap (1/GA for the mirror: a loss
normalised twice).
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class GaScaling:
    """A step loss that is off by the accumulation factor."""

    factor: float  # step loss / the micro-batch's own per-token mean: ~GA (or ~1/GA)
    accumulation: int
    step_loss: float
    micro_loss: float  # what compute_loss returned for micro-batch 0
    recomputed: float  # micro-batch 0's own per-token mean, recomputed without gradients

    @property
    def scale(self) -> float:
        """What the step loss is multiplied by: GA or 1/GA."""
        return float(self.accumulation) if self.factor > 1 else 1.0 / self.accumulation

    def evidence(self) -> dict[str, Any]:
        return {"factor": self.factor, "gradient_accumulation_steps": self.accumulation, "step_loss": self.step_loss,
                "micro_batch_loss": self.micro_loss, "recomputed_micro_batch_mean": self.recomputed, "scale": self.scale}


def judge_ga_scaling(step_loss: float, micro_loss: float, recomputed: float, accumulation: int) -> GaScaling | None:
    """A :class:`GaScaling` when the step loss is nearer GA (or 1/GA) times the recomputed mean than the mean itself.

    Judged on a log scale: the step loss counts as scaled when its ratio to
    the recomputed mean lies closer to GA than to 1 (``ratio > sqrt(GA)``), so
    micro-batches whose losses differ by less than that cannot trigger it.
    """
    if accumulation < 2 or not all(math.isfinite(v) for v in (step_loss, micro_loss, recomputed)) or recomputed <= 0 or step_loss <= 0:
        return None
    ratio = step_loss / recomputed
    if abs(math.log(ratio)) <= math.log(accumulation) / 2:
        return None
    return GaScaling(ratio, accumulation, step_loss, micro_loss, recomputed)
