"""The reference-batch value of a model in memory and of the same model rebuilt from a checkpoint's weights.

Readable, finite tensors of the right shapes can still be the wrong weights
(another run's file, a stale shard, a save of the wrong module). One small
fixed batch, run at save time with the model in memory and again on a copy
rebuilt from the weights on disk (:mod:`harness.lib.checkpoint_rebuild`:
transformers' own key conversion), says whether the file IS the model that was
training. The batch is any micro-batch the model accepts, cut to a few rows
and tokens and to the inputs its ``forward`` takes: a causal or masked LM's
token labels, a classifier's one label per row, a seq2seq model's target
sequence, or, for batches of several texts per row (a SentenceTransformer's
``<column>_input_ids``, a reward model's ``input_ids_chosen``), one column's
inputs. With labels the value is the loss; a model that returns no loss (a
base model inside a wrapper, a batch without labels) is compared by the mean
square of its first output (hidden states or logits). Both sides run in eval
mode without gradients, so dropout and the RNG play no part.
"""
from __future__ import annotations

import copy
import inspect
import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from harness.lib.sample_rows import DATASET_INDEX_KEY, DATASET_INDEX_NOTE_KEY, NUM_ITEMS_KEY, SAMPLE_ID_KEYS

IGNORE_INDEX = -100
HARNESS_KEYS = frozenset((*SAMPLE_ID_KEYS, DATASET_INDEX_KEY, DATASET_INDEX_NOTE_KEY, NUM_ITEMS_KEY))
INPUT_IDS = "input_ids"  # batches of several texts name theirs "<column>_input_ids" (SentenceTransformer) or "input_ids_<column>" (TRL)


@dataclass
class Reference:
    """What the rebuilt copy needs: the model class and a copy of its config, the batch (CPU) and its value at save time."""

    model_class: Any
    config: Any
    batch: dict[str, Any]
    loss: float  # the value at the save: the loss, or the output's mean square (``kind``)
    half: bool  # the in-memory forward ran in bf16/fp16 (weights or autocast): a looser tolerance
    buffers: dict[str, Any]  # the model's non-persistent buffers (rotary frequencies ...): no file holds them
    kind: str = "loss"  # "loss", or "output" for a model that returned none

    def describe(self) -> str:
        return "a loss" if self.kind == "loss" else "an output mean square"


def accepted_inputs(model: Any) -> frozenset[str] | None:
    """The argument names of ``model.forward`` (None when it takes only ``**kwargs``: any tensor is passed)."""
    try:
        parameters = inspect.signature(model.forward).parameters.values()
    except (TypeError, ValueError, AttributeError):
        return None
    names = frozenset(p.name for p in parameters if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY))
    return names or None


def reference_batch(batch: Any, rows: int, tokens: int, accepted: frozenset[str] | None = None) -> dict[str, Any] | None:
    """A small CPU copy of a micro-batch the model accepts (``rows`` rows, token dimensions cut at ``tokens``), or None.

    Only tensors the model's ``forward`` takes (``accepted``) are kept, the harness's own keys never. Every kept tensor
    must have the same first (row) dimension. Integer 2-D tensors (ids, masks, token labels) are cut at ``tokens``
    unless some input has three or more dimensions (a 4-D mask, images), which is then cut by rows only. Integer labels
    must label something (not all -100).
    """
    import torch

    if not isinstance(batch, Mapping):
        return None
    tensors = {k: v for k, v in batch.items() if isinstance(k, str) and torch.is_tensor(v) and k not in HARNESS_KEYS}
    if INPUT_IDS not in tensors:
        tensors = _one_column(tensors)
    if accepted is not None:
        tensors = {k: v for k, v in tensors.items() if k in accepted}
    if not tensors or any(v.dim() == 0 for v in tensors.values()) or len({v.shape[0] for v in tensors.values()}) != 1:
        return None
    by_tokens = all(v.dim() <= 2 for v in tensors.values())
    cut = {}
    for key, value in tensors.items():
        part = value[:rows]
        if by_tokens and part.dim() == 2 and not part.is_floating_point():
            part = part[:, :tokens]
        cut[key] = part.detach().to("cpu", copy=True).contiguous()
    labels = cut.get("labels")
    if labels is not None and not labels.is_floating_point() and not bool((labels != IGNORE_INDEX).any()):
        return None
    return cut


def _one_column(tensors: dict[str, Any]) -> dict[str, Any]:
    """The inputs of one text column of a batch holding several, under the names the model takes (``anchor_input_ids`` ->
    ``input_ids``, ``attention_mask_chosen`` -> ``attention_mask``); the batch as it is when it holds no such column."""
    for key in tensors:
        if key.endswith("_" + INPUT_IDS):
            prefix = key[: -len(INPUT_IDS)]
            return {k[len(prefix):]: v for k, v in tensors.items() if k.startswith(prefix)}
        if key.startswith(INPUT_IDS + "_"):
            suffix = key[len(INPUT_IDS):]
            return {k[: -len(suffix)]: v for k, v in tensors.items() if k.endswith(suffix)}
    return tensors


def _first_float(output: Any) -> Any:
    import torch

    values = output.values() if isinstance(output, Mapping) else output if isinstance(output, (tuple, list)) else [output]
    for value in values:
        if torch.is_tensor(value) and value.is_floating_point():
            return value
    return None


def batch_value(model: Any, batch: dict[str, Any]) -> tuple[float, str] | None:
    """``(value, kind)`` of ``model`` on ``batch`` in eval mode without gradients (train/eval flag restored): the loss, else
    the mean square of the first floating output; None when the output holds neither."""
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
    if torch.is_tensor(loss):
        return float(loss), "loss"
    first = _first_float(out)
    return (float(first.double().pow(2).mean()), "output") if first is not None else None


def is_half(model: Any, trainer: Any) -> bool:
    import torch

    args = getattr(trainer, "args", None)
    first = next(model.parameters(), None)
    return bool(getattr(args, "bf16", False) or getattr(args, "fp16", False)
                or (first is not None and first.dtype in (torch.bfloat16, torch.float16)))


def take_reference(model: Any, trainer: Any, batch: dict[str, Any]) -> Reference | None:
    """On the training thread, at a save: ``batch``'s value with the transformers model ``model`` in memory, and what a
    rebuild needs; None when ``model`` has no config or gives no value."""
    config = getattr(model, "config", None)
    if config is None or not hasattr(type(model), "config_class"):
        return None
    value = batch_value(model, batch)
    if value is None:
        return None
    saved = set(model.state_dict())
    buffers = {name: b.detach().to("cpu", copy=True) for name, b in model.named_buffers() if name not in saved}
    return Reference(type(model), copy.deepcopy(config), batch, value[0], is_half(model, trainer), buffers, kind=value[1])


def rebuilt_loss(reference: Reference, tensors: dict[str, Any]) -> tuple[float | None, list[str]]:
    """The reference batch's value (of the reference's kind) on a CPU copy rebuilt from its config with ``tensors``.

    Returns (value, the model's tensors the weights did not fill); with any left unfilled, no forward pass runs (None).
    """
    from harness.lib.checkpoint_rebuild import rebuild

    model, missing = rebuild(reference.model_class, reference.config, tensors, reference.buffers)
    if model is None:
        return None, missing
    value = batch_value(model, reference.batch)
    return (value[0] if value is not None and value[1] == reference.kind else None), []


def tolerance(reference: Reference, rtol: float | None) -> float:
    """The relative difference allowed: ``rtol``, else 1e-4 in fp32 and 2e-2 when the model trained in bf16/fp16."""
    if rtol is not None:
        return rtol
    return 2e-2 if reference.half else 1e-4


def matches(saved: float, recomputed: float, rtol: float) -> bool:
    if not (math.isfinite(saved) and math.isfinite(recomputed)):
        return False
    return abs(saved - recomputed) <= rtol * max(abs(saved), 1e-6)
