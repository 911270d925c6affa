"""Which learning rate won at a resume: the one configured now, or the one restored from the checkpoint.

HF's ``Trainer._load_optimizer_and_scheduler`` (transformers 5.24) loads
``optimizer.pt`` and ``scheduler.pt`` together, and only when both exist.
``LambdaLR.load_state_dict`` then restores ``base_lrs`` (the peak the schedule
scales) and ``optimizer.load_state_dict`` the param groups' ``lr`` and
``initial_lr``: the schedule keeps the saved peak and a new
``--learning_rate`` is ignored without a word. Without ``scheduler.pt``
neither file is loaded: the new LR takes effect, with a fresh optimizer and a
schedule restarted at step 0. Everything here is host Python floats read from
the optimizer and the scheduler: no device value, no sync.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Literal

Winner = Literal["configured", "restored", "neither"]


@dataclass(frozen=True)
class LrAtResume:
    """The LR values of the first update after a resume, and which setting they follow."""

    saved: float  # --learning_rate of the interrupted run (stored at the save)
    configured: float  # --learning_rate now
    restored_base: float | None  # the scheduler's base_lrs[0] after the Trainer restored scheduler.pt
    applied: float  # param_groups[0]["lr"] of the first update after the resume
    factor: float | None  # the schedule's multiplier at that position (LambdaLR), when known
    winner: Winner

    @property
    def configured_would_give(self) -> float | None:
        return None if self.factor is None else self.configured * self.factor

    def evidence(self) -> dict[str, Any]:
        return {
            "configured_lr": self.configured, "saved_lr": self.saved, "restored_base_lr": self.restored_base,
            "applied_lr": self.applied, "schedule_factor": self.factor, "configured_would_give": self.configured_would_give,
            "winner": self.winner,
        }


def schedule_factor(scheduler: Any) -> float | None:
    """The LambdaLR multiplier at the scheduler's current position (what the next update's LR is base_lr times), or None."""
    lambdas = getattr(scheduler, "lr_lambdas", None)
    position = getattr(scheduler, "last_epoch", None)
    if not isinstance(lambdas, list) or not lambdas or not callable(lambdas[0]) or not isinstance(position, int):
        return None
    try:
        return float(lambdas[0](position))
    except Exception:  # noqa: BLE001 - a user's lambda that fails here must not cost the check
        return None


def base_lr(scheduler: Any) -> float | None:
    """The scheduler's first base LR (restored from scheduler.pt at a resume)."""
    base = getattr(scheduler, "base_lrs", None)
    try:
        return float(base[0]) if base else None
    except (TypeError, ValueError, IndexError):
        return None


def judge_lr_at_resume(saved: float, configured: float, restored_base: float | None, applied: float, factor: float | None,
                       rtol: float = 1e-4) -> LrAtResume:
    """Say which learning rate the run follows after a resume.

    The scheduler's base LR decides when it equals one of the two values:
    every update after the first scales it (the first one's LR may still be
    the stale value ``optimizer.pt`` restored, e.g. 0 at the end of a decay
    that was then extended). Otherwise the applied LR is compared with
    ``configured * factor`` and ``saved * factor``; neither is "neither"
    (an LR set by hand, a scaled rollback, another scheduler).
    """

    def close(a: float | None, b: float | None) -> bool:
        return a is not None and b is not None and math.isclose(a, b, rel_tol=rtol, abs_tol=1e-15)

    if factor is None and restored_base:
        factor = applied / restored_base  # the schedule applied to the restored base
    winner: Winner = "neither"
    if close(restored_base, configured):
        winner = "configured"
    elif close(restored_base, saved):
        winner = "restored"
    elif factor and close(applied, configured * factor):
        winner = "configured"
    elif factor and close(applied, saved * factor):
        winner = "restored"
    return LrAtResume(saved, configured, restored_base, applied, factor, winner)


def describe(lr: LrAtResume) -> str:
    """One sentence for RESUME_CONFIG_CHANGED: whether the new learning rate is the one in effect."""
    if lr.winner == "configured":
        return f"learning_rate {lr.saved:g} -> {lr.configured:g} (in effect: the first update after the resume used {lr.applied:.3g})"
    if lr.winner == "restored":
        return f"learning_rate {lr.saved:g} -> {lr.configured:g} (NOT in effect: see LR_CHANGE_IGNORED_ON_RESUME)"
    return f"learning_rate {lr.saved:g} -> {lr.configured:g} (the first update after the resume used {lr.applied:.3g}: follows neither value)"
