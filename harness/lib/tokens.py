"""Token counts read from tensor shapes only (no device sync): what throughput and the step records count."""
from __future__ import annotations

from collections.abc import Mapping
from typing import Any


def token_positions(batch: Any) -> int:
    """Token positions in a micro-batch, padding included: every ``*input_ids`` tensor (DPO's chosen, rejected, prompt)."""
    if not isinstance(batch, Mapping):  # BatchEncoding (the HF collators) is a Mapping, not a dict
        return 0
    return sum(int(v.numel()) for k, v in batch.items() if isinstance(k, str) and k.endswith("input_ids") and hasattr(v, "numel"))


def count_parameters(model: Any) -> tuple[int, int]:
    """(all, trainable) parameters, also when ZeRO-3 has partitioned them away (``ds_numel``)."""
    total = trainable = 0
    for param in model.parameters():
        n = int(getattr(param, "ds_numel", 0) or param.numel())
        total += n
        trainable += n if param.requires_grad else 0
    return total, trainable
