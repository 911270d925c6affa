"""What kind of loss a trainer optimises: a per-token cross-entropy, or a preference, reward or policy-gradient loss.

A token loss falls as the model learns and jumps when a batch is bad; the
others (DPO's sigmoid of reward margins, GRPO's policy-gradient surrogate)
move with the batch's preference margins and the policy's own samples, and
neither their level nor their jumps say what a token loss's would. Checks
built on the loss curve ask here first.
"""
from __future__ import annotations

from typing import Any

# TRL trainers whose loss is not a per-token cross-entropy (their subclasses too)
NOT_TOKEN_LOSS = frozenset({"DPOTrainer", "GRPOTrainer", "RLOOTrainer", "PPOTrainer", "KTOTrainer", "ORPOTrainer",
                            "CPOTrainer", "OnlineDPOTrainer", "RewardTrainer", "BCOTrainer", "NashMDTrainer", "XPOTrainer"})


def token_loss(trainer: Any) -> bool:
    """Whether ``trainer``'s loss is a token cross-entropy (by its class and every base class)."""
    return not any(cls.__name__ in NOT_TOKEN_LOSS for cls in type(trainer).__mro__)


def token_loss_named(trainer_class: str | None) -> bool:
    """:func:`token_loss` from a class name alone (a run directory's ``run.json``); an unknown name counts as one."""
    return trainer_class not in NOT_TOKEN_LOSS


def token_loss_stage(stage: str | None) -> bool:
    """Whether a run.json ``stage`` (``dpo``, ``grpo``, ``kto`` ... for those trainers) names a token-loss run."""
    return not isinstance(stage, str) or f"{stage}trainer" not in {name.lower() for name in NOT_TOKEN_LOSS}
