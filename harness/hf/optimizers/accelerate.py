"""The optimizer guard of plain and accelerate runs: the Trainer calls ``AcceleratedOptimizer.step`` once per step."""
from __future__ import annotations

import functools
from typing import Any

from harness.core.actions import Action
from harness.hf.optimizers.gate import StepGate


def guard_accelerated_optimizer(optimizer: Any, gate: StepGate, model: Any) -> None:
    """Plain runs: the Trainer calls ``AcceleratedOptimizer.step`` once per optimizer step.

    A skip leaves parameters and optimizer state untouched and marks the step
    as skipped (the same flag an fp16 overflow sets), so the Trainer also
    holds the LR scheduler back. With an fp16 GradScaler the scaler is reset
    at the same scale, as after an overflow, so the next step can unscale.
    """
    original = optimizer.step
    if getattr(original, "_harness_guard", False):
        return  # a second train() call on the same optimizer: one guard per step, not two

    @functools.wraps(original)
    def harness_step(*args: Any, **kwargs: Any) -> Any:
        scaler = getattr(optimizer, "scaler", None)
        if gate.guard(model, optimizer) is Action.CONTINUE:
            if scaler is None:
                optimizer._is_overflow = False
            result = original(*args, **kwargs)
            gate.note_optimizer_skip(bool(getattr(optimizer, "step_was_skipped", False)))
            return result
        optimizer._is_overflow = True
        if scaler is not None and scaler.is_enabled():
            scaler.update(scaler.get_scale())  # forget this step's unscale_; keep the scale as it was
        return None

    harness_step._harness_guard = True  # type: ignore[attr-defined]
    optimizer.step = harness_step
