"""The reference-batch loss of a model in memory and of the same model rebuilt from a checkpoint's weights.

Readable, finite tensors of the right shapes can still be the wrong weights
(another run's file, a stale shard, a save of the wrong module). The loss of
one small fixed batch, computed at save time with the model in memory and
again from the weights on disk, says whether the file IS the model that was
training: the rebuilt copy is made from the model's config on the CPU (no
download), in eval mode and without gradients on both sides, so dropout and
the RNG play no part.
"""
from __future__ import annotations

import copy
import math
from dataclasses import dataclass
from typing import Any

MODEL_KEYS = ("input_ids", "attention_mask", "labels", "position_ids")


@dataclass
class Reference:
    """What the rebuilt copy needs: the model class and a copy of its config, the batch (CPU) and the loss at save time."""

    model_class: Any
    config: Any
    batch: dict[str, Any]
    loss: float
    half: bool  # the in-memory forward ran in bf16/fp16 (weights or autocast): a looser tolerance
    buffers: dict[str, Any]  # the model's non-persistent buffers (rotary frequencies ...): no file holds them


def reference_batch(batch: Any, rows: int, tokens: int) -> dict[str, Any] | None:
    """A small CPU copy of a causal-LM micro-batch (``rows`` x ``tokens``), or None when it is not one."""
    import torch

    if not hasattr(batch, "get"):
        return None
    ids, labels = batch.get("input_ids"), batch.get("labels")
    if not torch.is_tensor(ids) or not torch.is_tensor(labels) or ids.dim() != 2 or labels.shape != ids.shape:
        return None
    cut = {k: batch[k][:rows, :tokens].detach().to("cpu", copy=True) for k in MODEL_KEYS
           if torch.is_tensor(batch.get(k)) and batch[k].dim() == 2 and batch[k].shape[:1] == ids.shape[:1]}
    return cut if bool((cut["labels"][:, 1:] != -100).any()) else None


def batch_loss(model: Any, batch: dict[str, Any]) -> float | None:
    """The model's loss on ``batch`` in eval mode without gradients (train/eval flag restored); None without a loss."""
    import torch

    device = next(model.parameters()).device
    was_training = model.training
    model.eval()
    try:
        with torch.no_grad():
            out = model(**{k: v.to(device) for k, v in batch.items()})
    finally:
        model.train(was_training)
    loss = getattr(out, "loss", None)
    return float(loss) if loss is not None else None


def is_half(model: Any, trainer: Any) -> bool:
    import torch

    args = getattr(trainer, "args", None)
    first = next(model.parameters(), None)
    return bool(getattr(args, "bf16", False) or getattr(args, "fp16", False)
                or (first is not None and first.dtype in (torch.bfloat16, torch.float16)))


def take_reference(model: Any, trainer: Any, batch: dict[str, Any]) -> Reference | None:
    """On the training thread, at a save: the loss of ``batch`` with the model in memory, and what a rebuild needs."""
    config = getattr(model, "config", None)
    if config is None or not hasattr(type(model), "config_class"):
        return None
    loss = batch_loss(model, batch)
    if loss is None:
        return None
    saved = set(model.state_dict())
    buffers = {name: b.detach().to("cpu", copy=True) for name, b in model.named_buffers() if name not in saved}
    return Reference(type(model), copy.deepcopy(config), batch, loss, is_half(model, trainer), buffers)


def rebuilt_loss(reference: Reference, tensors: dict[str, Any]) -> tuple[float | None, list[str]]:
    """The reference batch's loss on a CPU copy of the model built from its config with ``tensors`` loaded.

    The copy is built on the meta device (no memory, and no initialisation that
    would draw from the training's global RNG from this thread), the saved
    tensors are assigned in fp32, the non-persistent buffers come from the
    model in memory. Returns (loss, the model's tensors the weights did not
    fill); with any left unfilled, no forward pass runs (loss None).
    """
    import torch

    with torch.device("meta"):  # a thread-local mode: the training thread is not affected
        model = reference.model_class(copy.deepcopy(reference.config))
    model.load_state_dict({k: v.to(torch.float32) if v.is_floating_point() else v for k, v in tensors.items()}, strict=False, assign=True)
    if hasattr(model, "tie_weights"):
        model.tie_weights()
    for name, buffer in reference.buffers.items():
        owner, _, leaf = name.rpartition(".")
        module = model.get_submodule(owner) if owner else model
        if leaf in module._buffers:
            module._buffers[leaf] = buffer.to(torch.float32) if buffer.is_floating_point() else buffer
    missing = [n for n, t in [*model.named_parameters(), *model.named_buffers()] if t.device.type == "meta"]
    if missing:
        return None, missing
    return batch_loss(model, reference.batch), []


def tolerance(reference: Reference, rtol: float | None) -> float:
    """The relative difference allowed: ``rtol``, else 1e-4 in fp32 and 2e-2 when the model trained in bf16/fp16."""
    if rtol is not None:
        return rtol
    return 2e-2 if reference.half else 1e-4


def matches(saved: float, recomputed: float, rtol: float) -> bool:
    if not (math.isfinite(saved) and math.isfinite(recomputed)):
        return False
    return abs(saved - recomputed) <= rtol * max(abs(saved), 1e-6)
