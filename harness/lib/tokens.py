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
    """(all, trainable) parameters of the whole model: also under ZeRO-3 (``ds_numel``) and FSDP (not this rank's shard)."""
    from harness.lib.sharding import full_parameter_counts

    return full_parameter_counts(model)
