"""The cross-rank loss trap: a loss the Trainer multiplies by the world size though it was never normalised across ranks.

With ``average_tokens_across_devices`` (transformers' default) and a model
that accepts loss kwargs (or a ``compute_loss_func``), HF's
``Trainer.compute_loss`` (transformers 5.25) passes ``num_items_in_batch``,
the label count of the whole step summed over EVERY rank, and multiplies
the loss by the number of processes, taking the loss as ``label sum /
num_items_in_batch``: the mean over ranks is then the true loss. A head
whose loss ignores ``num_items_in_batch`` returns its own micro-batch mean
instead, so every rank's loss, every gradient and the logged loss are world
size times too large. In transformers 5.25 that is every head with its own
``CrossEntropyLoss`` or a loss function called without the kwargs: BERT's
sequence and token classification, masked LM and multiple choice,
T5ForConditionalGeneration, the generic ``...ForSequenceClassification``
and ``...ForTokenClassification`` heads (Llama, Qwen, Mistral ...);
causal LMs (``ForCausalLMLoss``) and the generic question answering head
normalise by it.

The judge tells the two apart from one micro-batch: its loss as
``compute_loss`` returned it, its own mean recomputed without
``num_items_in_batch``, its label count on this rank and the Trainer's
``num_items_in_batch``. Normalised, ``loss = scale * mean * local /
global``; the micro-batch's own mean, ``loss = scale * mean``. The two
differ by ``global / local`` (about world size times accumulation); the
loss is judged nearer one of them on a log scale, and not at all when they
are too close to tell (this rank held nearly every label of the step).
"""
from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch

from harness.lib.sample_grads import IGNORE_INDEX, row_inputs
from harness.lib.sample_rows import DATASET_INDEX_KEY, DATASET_INDEX_NOTE_KEY, NUM_ITEMS_KEY

HARNESS_KEYS = (DATASET_INDEX_KEY, DATASET_INDEX_NOTE_KEY, NUM_ITEMS_KEY)  # what the tap added to the Trainer's inputs
# on_step_end's metrics hold a WorldScaling under this key at the step whose micro-batch the bridge recomputed
WORLD_SCALING_KEY = "world_scaling"
MIN_SPREAD = 1.25  # global / local below this: the two readings lie within 12% of each other, too close to tell


def world_loss_scale(trainer: Any) -> int:
    """What ``Trainer.compute_loss`` multiplies the loss by when it averages tokens across devices (1: it does not).

    Its own rule: ``average_tokens_across_devices`` with several ranks and
    a model that accepts loss kwargs (or a ``compute_loss_func``); the
    factor is the number of processes over the tensor-parallel size, or
    ``n_gpu`` under DataParallel. (The Trainer also needs
    ``num_items_in_batch``, which the caller checks per micro-batch.)
    """
    args = getattr(trainer, "args", None)
    if not getattr(args, "average_tokens_across_devices", False) or int(getattr(args, "world_size", 1) or 1) <= 1:
        return 1
    if not (getattr(trainer, "model_accepts_loss_kwargs", False) or getattr(trainer, "compute_loss_func", None) is not None):
        return 1
    if int(getattr(args, "n_gpu", 1) or 1) > 1:
        return int(args.n_gpu)
    processes = int(getattr(getattr(trainer, "accelerator", None), "num_processes", args.world_size) or 1)
    tp_size = getattr(trainer, "get_tp_size", None)
    return max(1, processes // max(1, int(tp_size() if callable(tp_size) else 1)))


def label_count(batch: Mapping[str, Any], shifts_labels: bool) -> Any:
    """A micro-batch's label count as the Trainer counts ``num_items_in_batch`` (a device tensor, not read); None without labels."""
    labels = batch.get("shift_labels")
    if labels is None:
        labels = batch.get("labels")
        if labels is not None and shifts_labels and hasattr(labels, "dim") and labels.dim() > 0:
            labels = labels[..., 1:]
    if labels is None or not hasattr(labels, "ne"):
        return None
    return labels.ne(IGNORE_INDEX).sum()


def own_mean_loss(trainer: Any, batch: Mapping[str, Any]) -> torch.Tensor | None:
    """The micro-batch's own mean loss (device tensor, not read), whatever the head: by forward passes without gradients.

    The model's own loss without ``num_items_in_batch`` (every head then
    means over its own labels), or the Trainer's ``compute_loss_func`` given
    ``num_items_in_batch=None``; one row at a time (a row's logits only are
    held, next to training's activations), in eval mode (no dropout: no
    random numbers drawn, training's RNG streams stay as they were), the
    rows' means weighted by their label counts (counted as the Trainer
    counts ``num_items_in_batch``). None without labels, with sharded
    parameters (a forward pass on one rank alone would hang) or when the
    model returns no loss.
    """
    from harness.lib.capture import can_recompute  # the capture machinery, only when a micro-batch is recomputed

    labels = batch.get("labels") if isinstance(batch, Mapping) else None
    if not torch.is_tensor(labels) or labels.dim() == 0 or labels.shape[0] == 0 or can_recompute(trainer) is not None:
        return None
    model = trainer.model
    shifts = bool(getattr(trainer, "_loss_shifts_labels", False))
    loss_func = getattr(trainer, "compute_loss_func", None)
    inputs = {k: v for k, v in batch.items() if k not in HARNESS_KEYS and torch.is_tensor(v)}
    rows = labels.shape[0]
    was_training = model.training
    model.eval()
    try:
        with torch.no_grad():
            means, counts = [], []
            for r in range(rows):
                row = row_inputs(inputs, rows, r)
                mean = _row_loss(model, row, loss_func)
                count = label_count(row, shifts)
                if mean is None or count is None:
                    return None
                means.append(mean.detach().float().reshape(()))
                counts.append(count.to(means[-1].device, torch.float32))
    except Exception:  # noqa: BLE001 - a head or loss function this cannot call is no judgement, never a failed step
        return None
    finally:
        model.train(was_training)
    weights = torch.stack(counts)
    return (torch.nan_to_num(torch.stack(means)) * weights).sum() / weights.sum().clamp_min(1)


def _row_loss(model: Any, row: dict[str, Any], loss_func: Any) -> torch.Tensor | None:
    if loss_func is None:
        out = model(**row)
    else:
        labels = row.pop("labels")
        out = loss_func(model(**row), labels, num_items_in_batch=None)
        return out if torch.is_tensor(out) else None
    loss = out.get("loss") if isinstance(out, Mapping) else (out[0] if isinstance(out, (tuple, list)) and out else None)
    return loss if torch.is_tensor(loss) and loss.numel() == 1 else None


@dataclass(frozen=True)
class WorldScaling:
    """How one micro-batch's loss stood to its own mean under the Trainer's cross-rank scaling (host values)."""

    own_mean: bool | None  # True: the loss is scale x the micro-batch's own mean (num_items_in_batch ignored); None: not told
    scale: int  # what the Trainer multiplied the loss by (the number of processes)
    micro_loss: float  # compute_loss's loss for the micro-batch, the Trainer's scale included
    recomputed: float  # the micro-batch's own mean, recomputed without num_items_in_batch
    local_items: float  # the micro-batch's labels on this rank
    global_items: float  # num_items_in_batch: every rank's labels of the step
    loss_source: str = ""  # what computed the loss: the model's head, a compute_loss_func, a Trainer subclass's compute_loss

    @property
    def factor(self) -> float:
        """The micro-batch's loss over its own mean: ~scale when it ignores num_items_in_batch."""
        return self.micro_loss / self.recomputed if self.recomputed else math.nan

    def evidence(self) -> dict[str, Any]:
        return {"factor": self.factor, "loss_scale": self.scale, "micro_batch_loss": self.micro_loss,
                "recomputed_micro_batch_mean": self.recomputed, "local_items": self.local_items,
                "num_items_in_batch": self.global_items, "loss_source": self.loss_source}


def judge_world_scaling(micro_loss: float, recomputed: float, local_items: float, global_items: float, scale: int) -> bool | None:
    """True when the loss is ``scale`` times the micro-batch's own mean, False when it is normalised by
    ``num_items_in_batch``, None when neither holds or the two cannot be told apart.

    Each reading is accepted when the loss lies within half the log
    distance between them (``ln(global / local) / 2``), so a train-mode loss
    (dropout) that differs from the eval-mode recomputation by less than
    that cannot flip it.
    """
    values = (micro_loss, recomputed, local_items, global_items)
    if scale < 2 or not all(math.isfinite(v) and v > 0 for v in values):
        return None
    spread = math.log(global_items / local_items)
    if spread < math.log(MIN_SPREAD):
        return None
    if abs(math.log(micro_loss / (scale * recomputed))) < spread / 2:
        return True
    if abs(math.log(micro_loss * global_items / (scale * recomputed * local_items))) < spread / 2:
        return False
    return None


def loss_source(trainer: Any) -> str:
    """What computes the loss the Trainer scales: a ``compute_loss_func``, a Trainer subclass's ``compute_loss``, or the model's head."""
    func = getattr(trainer, "compute_loss_func", None)
    if func is not None:
        return f"compute_loss_func {getattr(func, '__qualname__', type(func).__name__)}"
    owner = next((c for c in type(trainer).__mro__ if "compute_loss" in vars(c)), None)
    if owner is not None and not owner.__module__.startswith(("transformers.", "trl.")):
        return f"{owner.__name__}.compute_loss"
    model = getattr(trainer, "model", None)
    base = getattr(getattr(model, "base_model", None), "model", None) if type(model).__name__.startswith("Peft") else None
    return f"{type(base or model).__name__}'s loss"
