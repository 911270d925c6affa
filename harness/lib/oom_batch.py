"""What an out-of-memory finding says about the batch and the training setup (after the OOM only).

Shapes are tensor metadata (free); the sequence lengths sum the attention
mask, which reads the device: done once, when the run has already failed.
"""
from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from harness.lib.sharding import trainer_sharding

MAX_ROWS_LISTED = 64


def ids_key(batch: Mapping[str, Any]) -> str | None:
    """The token-id tensor of a batch: ``input_ids``, else the first 2-D ``*input_ids`` (DPO's ``chosen_input_ids``)."""
    if torch.is_tensor(batch.get("input_ids")) and batch["input_ids"].dim() == 2:
        return "input_ids"
    return next((k for k, v in batch.items() if k.endswith("input_ids") and torch.is_tensor(v) and v.dim() == 2), None)


def padded_shape(batch: Any) -> tuple[int, int] | None:
    """(rows, padded length) of a batch's token ids, from metadata only (no device read); every step, so the common case first."""
    ids = batch.get("input_ids") if type(batch) is dict else None
    if ids is not None and type(ids) is torch.Tensor and ids.dim() == 2:
        return ids.shape[0], ids.shape[1]
    key = ids_key(batch) if isinstance(batch, Mapping) else None
    return (int(batch[key].shape[0]), int(batch[key].shape[1])) if key else None


def describe_micro_batch(micro: int, batch: Any) -> dict[str, Any]:
    """Shapes of every tensor, rows, padded length and each row's real length (from the attention mask)."""
    if not isinstance(batch, Mapping):
        return {"micro_batch": micro, "shapes": {}}
    shapes = {k: list(v.shape) for k, v in batch.items() if torch.is_tensor(v)}
    record: dict[str, Any] = {"micro_batch": micro, "shapes": shapes}
    key = ids_key(batch)
    if key is None:
        return record
    rows, length = padded_shape(batch) or (0, 0)
    record.update(rows=rows, padded_length=length, token_positions=rows * length)
    mask = batch.get(key.replace("input_ids", "attention_mask"))
    lengths = _row_lengths(mask) if torch.is_tensor(mask) and mask.shape == batch[key].shape else None
    if lengths is not None:
        record.update(sequence_lengths=lengths[:MAX_ROWS_LISTED], longest=max(lengths, default=0), shortest=min(lengths, default=0),
                      real_tokens=sum(lengths))
    else:
        record.update(sequence_lengths=None, longest=length, shortest=length, real_tokens=rows * length)
    return record


def _row_lengths(mask: torch.Tensor) -> list[int] | None:
    """Each row's real length (one device read); None when the device cannot answer after the OOM."""
    try:
        return [int(n) for n in mask.detach().to("cpu").sum(-1).tolist()]
    except Exception:  # noqa: BLE001
        return None


def sharding_text(trainer: Any) -> str | None:
    """How the weights and optimizer state are split over ranks ("ZeRO-2 over 4 ranks", "FSDP1, 8 shards"), or None."""
    world = int(getattr(getattr(trainer, "args", None), "world_size", 1) or 1)
    if getattr(trainer, "is_deepspeed_enabled", False):
        engine = getattr(trainer, "model_wrapped", None)
        stage = engine.zero_optimization_stage() if hasattr(engine, "zero_optimization_stage") else 0
        return f"DeepSpeed ZeRO-{stage} over {world} ranks" if stage else None
    layout = trainer_sharding(trainer)
    return layout.describe() if layout.sharded else None


def checkpointing(model: Any) -> bool:
    """Whether any module recomputes its activations (HF sets ``gradient_checkpointing`` on the layers it wraps)."""
    return any(getattr(m, "gradient_checkpointing", False) is True for m in getattr(model, "modules", lambda: ())())


def training_setup(trainer: Any) -> dict[str, Any]:
    """The settings the OOM causes turn on: batch sizes, checkpointing, attention, precision, sharding."""
    args = getattr(trainer, "args", None)
    model = getattr(trainer, "model", None)
    config = getattr(model, "config", None)
    first = next(iter(model.parameters()), None) if model is not None else None
    return {
        "per_device_train_batch_size": getattr(args, "per_device_train_batch_size", None),
        "per_device_eval_batch_size": getattr(args, "per_device_eval_batch_size", None),
        "gradient_accumulation_steps": getattr(args, "gradient_accumulation_steps", None),
        "gradient_checkpointing": bool(getattr(args, "gradient_checkpointing", False) or checkpointing(model)),
        "attn_implementation": getattr(config, "_attn_implementation", None),
        "vocab_size": getattr(config, "vocab_size", None),
        "param_dtype": str(first.dtype).replace("torch.", "") if first is not None else None,
        "bf16": bool(getattr(args, "bf16", False)),
        "fp16": bool(getattr(args, "fp16", False)),
        "sharding": sharding_text(trainer),
        "world_size": int(getattr(args, "world_size", 1) or 1),
    }


__all__ = ["describe_micro_batch", "ids_key", "padded_shape", "sharding_text", "training_setup"]
