"""Recompute one optimizer step's micro-batches (forward and backward) on this rank, leaving training untouched.

The rerun plugin's engine. Each kept micro-batch goes through the Trainer's
own *unwrapped* ``compute_loss`` (``type(trainer).compute_loss``: the
harness's tap does not fire, so no plugin sees the rerun as a training
micro-batch) on the unwrapped ``trainer.model`` (DDP runs no all-reduce),
inside ``trainer.compute_loss_context_manager()``, its loss scaled for
gradient accumulation by the Trainer's own rule, and
``torch.autograd.grad`` takes the gradients: ``param.grad`` is never
touched, so the step's own gradients stay for its update. The RNG streams
(torch CPU and every CUDA device) are set to the state the step started
with and restored afterwards, and so is what a subclass's ``compute_loss``
adds to its logged metrics (TRL's ``_metrics``, its token count). With
several ranks an overridden ``compute_loss`` is refused: TRL's gathers its
metrics across ranks, which one rank alone would hang in.

Lives in ``harness.lib`` (not ``harness.hf``) because plugins may not import
``harness.hf``; it uses the Trainer by duck typing only.

Cost, on the steps it runs: one forward and one backward per micro-batch,
and one extra gradient-sized buffer (the summed gradients) while it runs.
"""
from __future__ import annotations

import contextlib
import copy
import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import torch

from harness.lib.capture import can_recompute
from harness.lib.sample_rows import DATASET_INDEX_KEY, DATASET_INDEX_NOTE_KEY, NUM_ITEMS_KEY
from harness.lib.rng_state import rng_state, set_rng_state

HARNESS_KEYS = (DATASET_INDEX_KEY, DATASET_INDEX_NOTE_KEY, NUM_ITEMS_KEY)  # what the tap added to the Trainer's inputs


@dataclass
class Recomputed:
    """What one recomputation of a step gave, as host values."""

    losses: list[float] = field(default_factory=list)  # per micro-batch, as compute_loss returned it
    grad_norm: float | None = None  # L2 norm of the summed (GA-scaled) gradients, this rank's own (not all-reduced)
    grads_finite: bool | None = None
    seconds: float = 0.0


def capture_rng() -> dict[str, Any]:
    """The RNG streams a forward pass may draw from, every CUDA device's included (host copies: no device sync)."""
    return rng_state(all_devices=True)


restore_rng = set_rng_state


METRIC_STATE = ("_metrics", "_stored_metrics", "_total_train_tokens")  # what TRL's compute_loss adds to (restored after a rerun)


def why_not(trainer: Any, world_size: int = 1) -> str | None:
    """None when this rank can recompute a step alone; else why not."""
    if getattr(trainer, "is_deepspeed_enabled", False):
        return "DeepSpeed: the guard runs inside the engine's step and its gradients live in the engine's partitions"
    if int(getattr(getattr(trainer, "args", None), "n_gpu", 1) or 1) > 1:
        return ("DataParallel over several GPUs in one process: the Trainer scales the loss by n_gpu and averages replicas, "
                "which a recomputation on the unwrapped model cannot match")
    own = getattr(type(trainer), "compute_loss", None)
    if world_size > 1 and not str(getattr(own, "__module__", "")).startswith("transformers."):
        return (f"{getattr(own, '__qualname__', 'compute_loss')} overrides the Trainer's compute_loss and may run collectives "
                "(TRL's gather its metrics): a recomputation on one rank alone could hang")
    return can_recompute(trainer)


def loss_scaled_for_ga(trainer: Any, num_items: Any) -> bool:
    """The Trainer's rule (as ``harness.hf.tap`` applies it): is the loss already normalised over the whole step?"""
    fixed = getattr(trainer, "loss_is_scaled_for_ga", None)
    if fixed is not None:
        return bool(fixed)
    accepts = bool(getattr(trainer, "model_accepts_loss_kwargs", False))
    return (accepts and num_items is not None) or getattr(trainer, "compute_loss_func", None) is not None


def model_inputs(batch: Mapping[str, Any]) -> tuple[dict[str, Any], Any]:
    """The Trainer's own inputs of a micro-batch (the tap's keys removed) and its ``num_items_in_batch``."""
    return {k: v for k, v in batch.items() if k not in HARNESS_KEYS}, batch.get(NUM_ITEMS_KEY)


def recompute_step(trainer: Any, batches: list[Mapping[str, Any]], rng: Mapping[str, Any] | None) -> Recomputed:
    """Forward and backward of every micro-batch of a step, from ``rng``; the gradients summed, never written to ``param.grad``.

    Reads the result at once (one device read): for flagged steps, whose verdict is due before the update.
    """
    pending = recompute_on_device(trainer, batches, rng)
    return pending.read(pending.values.tolist())  # one read


@dataclass
class PendingRecompute:
    """A recomputation whose numbers are still on the device: ``values`` holds the losses, then the grad norm if any."""

    values: Any
    count: int
    has_norm: bool
    seconds: float

    def read(self, values: list[float]) -> Recomputed:
        """The host values of ``values`` (read now, or with a later step's one transfer) as a :class:`Recomputed`."""
        grad_norm = float(values[self.count]) if self.has_norm else None
        return Recomputed(losses=[float(v) for v in values[: self.count]], grad_norm=grad_norm,
                          grads_finite=None if grad_norm is None else math.isfinite(grad_norm), seconds=self.seconds)


def recompute_on_device(trainer: Any, batches: list[Mapping[str, Any]], rng: Mapping[str, Any] | None) -> PendingRecompute:
    """:func:`recompute_step` without the read: the numbers stay on the device (the calibration defers them to the next step's read)."""
    import time

    started = time.perf_counter()
    model = trainer.model
    params = [p for p in model.parameters() if p.requires_grad]
    saved = capture_rng()
    ga = int(getattr(trainer, "current_gradient_accumulation_steps", None) or trainer.args.gradient_accumulation_steps or 1)
    totals: list[torch.Tensor | None] = [None] * len(params)
    losses: list[torch.Tensor] = []
    managed = getattr(trainer, "compute_loss_context_manager", None)
    metrics = {name: copy.deepcopy(getattr(trainer, name)) for name in METRIC_STATE if hasattr(trainer, name)}
    try:
        if rng is not None:
            restore_rng(rng)
        for batch in batches:
            inputs, num_items = model_inputs(batch)
            with managed() if callable(managed) else contextlib.nullcontext():
                kwargs = {"num_items_in_batch": num_items} if num_items is not None else {}
                loss = type(trainer).compute_loss(trainer, model, dict(inputs), **kwargs)
            loss = loss[0] if isinstance(loss, tuple) else loss
            loss = loss.mean() if loss.dim() > 0 else loss
            losses.append(loss.detach())
            scaled = loss if loss_scaled_for_ga(trainer, num_items) else loss / ga
            grads = torch.autograd.grad(scaled, params, allow_unused=True)
            for i, g in enumerate(grads):
                if g is not None:
                    totals[i] = g if totals[i] is None else totals[i] + g
            del grads, scaled, loss
    finally:
        restore_rng(saved)
        for name, value in metrics.items():  # the rerun's metrics (TRL's token count, rewards) must not reach the logs
            setattr(trainer, name, value)
    kept = [t for t in totals if t is not None]
    home = kept[0].device if kept else None  # a model spread over devices (device_map): norms meet on one device
    norm = torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(t.float()).to(home) for t in kept])) if kept else None
    values = torch.stack([*(loss.float().to(norm.device if norm is not None else loss.device) for loss in losses),
                          *([norm] if norm is not None else [])])
    return PendingRecompute(values, len(losses), norm is not None, time.perf_counter() - started)
