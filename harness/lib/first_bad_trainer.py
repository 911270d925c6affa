"""The first-bad-tensor search (:mod:`harness.lib.first_bad`) under a Trainer: on which model, and when it must not run.

- Gradients: the unwrapped model's ``.grad``, this rank's shard only under
  FSDP (``local_tensor``); when the Trainer clipped by a NaN norm (every
  gradient is NaN then) a rerun of the step's backward instead, where one
  rank may run it alone. Under DeepSpeed ZeRO the reduced gradients live in
  the engine's partitions, not in ``.grad``: "unavailable", never a wrong
  list.
- Forward: one rerun of a micro-batch, only where one rank may run a forward
  pass alone (:func:`harness.lib.capture.can_recompute`), with the batch's
  labels (so that a NaN made by the loss itself shows at the model's own
  output) and without the harness's bookkeeping keys.
"""
from __future__ import annotations

import logging
import math
from functools import partial
from typing import Any

import torch

from harness.lib.capture import NOT_MODEL_INPUTS, can_recompute
from harness.lib.first_bad import locate_forward
from harness.lib.first_bad_grads import GradScan, locate_backward, scan_gradients
from harness.lib.sharding import local_tensor, trainer_sharding

log = logging.getLogger("harness.lib.first_bad")


def zero_stage(trainer: Any) -> int:
    """The DeepSpeed ZeRO stage of the Trainer's engine, 0 without DeepSpeed."""
    if not getattr(trainer, "is_deepspeed_enabled", False):
        return 0
    engine = getattr(trainer, "model_wrapped", None)
    return int(engine.zero_optimization_stage()) if hasattr(engine, "zero_optimization_stage") else 0


def _inputs(batch: dict[str, Any]) -> dict[str, Any]:
    """The model's own inputs and the labels (the harness's bookkeeping keys stripped)."""
    return {k: v for k, v in batch.items() if torch.is_tensor(v) and (k == "labels" or k not in NOT_MODEL_INPUTS)}


def _loss(model: Any, inputs: dict[str, Any]) -> torch.Tensor:
    loss = getattr(model(**inputs), "loss", None)
    if loss is None:
        raise ValueError("the model's forward returned no loss for this batch")
    return loss


def trainer_grad_scan(trainer: Any, rank: int, grad_norm: float | None, batches: list[dict[str, Any]]) -> GradScan:
    """Which gradients of the Trainer's model are non-finite on this rank (one device read, or a rerun of backward)."""
    stage = zero_stage(trainer)
    if stage >= 1:
        return GradScan(unavailable=f"DeepSpeed ZeRO-{stage} keeps the reduced gradients in the engine's partitions, not in .grad")
    model = getattr(trainer, "model", None)
    if model is None:
        return GradScan(unavailable="no model")
    scope = f"local shard of rank {rank}" if trainer_sharding(trainer).sharded else "whole model"
    clipped_by_nan = grad_norm is not None and math.isnan(grad_norm) and bool(getattr(trainer.args, "max_grad_norm", 0))
    why_not = can_recompute(trainer) if clipped_by_nan else None
    if why_not:
        return GradScan(unavailable=f"clipping by a NaN norm made every gradient NaN, and no rerun: {why_not}")
    try:
        if clipped_by_nan:
            return locate_backward(model, [partial(_loss, model, _inputs(b)) for b in batches], scope)
        return scan_gradients(model, local_tensor, scope)
    except Exception as exc:  # noqa: BLE001 - a diagnosis must never cost the skip
        log.warning("nan_guard: could not find which gradients are non-finite: %s", exc)
        return GradScan(unavailable=f"{type(exc).__name__}: {exc}")


def trainer_locate(trainer: Any, batch: dict[str, Any], rank: int | None = None) -> tuple[dict[str, Any], str]:
    """(evidence, sentence) of a traced rerun of ``batch`` on the Trainer's model (``rank``: named where a weight of the
    first non-finite module holds NaN/Inf), or why it was skipped."""
    why_not = can_recompute(trainer)
    model = getattr(trainer, "model", None)
    if why_not is None and model is None:
        why_not = "no model"
    if why_not is None:
        try:
            found = locate_forward(model, _inputs(batch), rank)
            return found.evidence(), found.describe()
        except Exception as exc:  # noqa: BLE001 - an odd model or batch: the finding and the skip matter more
            why_not = f"the rerun failed: {type(exc).__name__}: {exc}"
            log.warning("nan_guard: %s", why_not)
    skipped = {"reproduced_in_forward": None, "first_nonfinite_module": None, "locate": f"skipped: {why_not}"}
    return skipped, f"no rerun to find the first non-finite module ({why_not})"
