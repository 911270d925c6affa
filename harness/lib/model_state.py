"""Whether a model's weights are trained or fresh from their initialisation (what its first loss should look like).

A model that knows nothing scores about ln(vocab) at its first step; a
trained one (``from_pretrained``, a checkpoint, weights trained earlier in
the same process) starts lower, legitimately. ``config.name_or_path`` says
where a model was loaded from, but ``from_config`` on a hub config sets it
too, for fresh weights. The normalisation layers tell the two apart without
a reference: every initialisation sets their weights to one constant (1 for
LayerNorm/RMSNorm, 0 for Gemma-style ``1 + w``), and any training moves
them apart. So "trained" means some norm weight is not constant.
"""
from __future__ import annotations

from typing import Any, Literal

import torch

WeightsState = Literal["trained", "fresh", "unknown"]
MAX_NORMS = 16  # the first norm layers suffice: training moves all of them


def norm_weights(model: Any, limit: int = MAX_NORMS) -> list[torch.Tensor]:
    """Up to ``limit`` 1-D weights of normalisation layers (modules named ``*Norm*``), local and non-empty."""
    found: list[torch.Tensor] = []
    modules = getattr(model, "modules", None)
    if modules is None:
        return found
    for module in modules():
        weight = getattr(module, "weight", None)
        if "norm" not in type(module).__name__.lower() or not isinstance(weight, torch.Tensor) or weight.dim() != 1:
            continue
        if type(weight).__name__ == "DTensor" or weight.numel() == 0 or weight.device.type == "meta":
            continue  # sharded (FSDP2, ZeRO-3 partitions): judged from the name alone
        found.append(weight.detach())
        if len(found) >= limit:
            break
    return found


def weights_state(model: Any) -> WeightsState:
    """'trained' when a norm weight is not constant, 'fresh' when every one is, 'unknown' without readable norms.

    One small device read (the spread of up to 16 norm weights), once at the
    start of a run: not on an ordinary step.
    """
    from harness.lib.sharding import model_sharding

    try:
        if model_sharding(model).sharded:
            return "unknown"  # FSDP: a module's weight may be a view into a freed flat parameter
        weights = norm_weights(model)
        if not weights:
            return "unknown"
        spread = torch.stack([(w.float().max() - w.float().min()).abs() for w in weights]).max()
        return "trained" if float(spread) > 0 else "fresh"
    except Exception:  # noqa: BLE001 - an unusual model: say "unknown" rather than guess
        return "unknown"


def loaded_from(model: Any) -> str | None:
    """Where the model says it came from (``config.name_or_path``), or None for a model built from a config in code."""
    config = getattr(model, "config", None)
    name = getattr(config, "name_or_path", None) or getattr(config, "_name_or_path", None)
    return str(name) if name else None
