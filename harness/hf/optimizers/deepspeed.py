"""The optimizer guard of DeepSpeed runs: the engine steps its own optimizer inside ``engine.step()``.

Nothing here imports DeepSpeed: the guard works on whatever optimizer the
engine holds (ZeRO-1/2/3 wrappers, fp16 optimizers, or a plain torch
optimizer under ZeRO stage 0) by the attributes it has.
"""
from __future__ import annotations

import functools
from typing import Any, Callable

from harness.core.actions import Action
from harness.hf.optimizers.gate import StepGate


def guard_deepspeed_optimizer(optimizer: Any, gate: StepGate, engine: Any) -> None:
    """DeepSpeed: ``engine.step()`` (inside backward) calls its optimizer's ``step``; guard that.

    A skip drives the optimizer down its own overflow path (the one an fp16
    overflow takes: gradients dropped, no update, ``overflow`` set so that the
    engine holds the LR scheduler and counts a skipped step) without touching
    the loss scale. If the optimizer still reports no overflow afterwards the
    update happened, and a critical ``SKIP_NOT_APPLIED`` finding says so.
    """
    original = optimizer.step
    if getattr(original, "_harness_guard", False):
        return
    owns_overflow = hasattr(optimizer, "overflow")

    @functools.wraps(original)
    def harness_step(*args: Any, **kwargs: Any) -> Any:
        if gate.guard(engine, optimizer) is Action.CONTINUE:
            if not owns_overflow and hasattr(optimizer, "overflow"):
                optimizer.overflow = False
            result = original(*args, **kwargs)
            gate.note_optimizer_skip(bool(getattr(optimizer, "overflow", False)))  # the engine's own overflow skip
            return result
        if not has_overflow_path(optimizer):
            # ZeRO stage 0 with a plain torch optimizer: drop the gradients, flag the skip for the engine
            optimizer.zero_grad(set_to_none=True)
            optimizer.overflow = True
            return None
        result = step_with_forced_overflow(optimizer, original, args, kwargs)
        if not getattr(optimizer, "overflow", False):
            gate.skip_not_applied(type(optimizer).__name__)
        return result

    harness_step._harness_guard = True  # type: ignore[attr-defined]
    optimizer.step = harness_step


def has_overflow_path(optimizer: Any) -> bool:
    """Whether the optimizer has an fp16-style overflow check the guard can force (DeepSpeed's ZeRO/fp16 wrappers)."""
    return hasattr(optimizer, "_update_scale") and (
        hasattr(optimizer, "check_overflow") or hasattr(optimizer, "_overflow_check_and_loss_scale_update")
    )


def step_with_forced_overflow(optimizer: Any, original: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    """Run the optimizer's own step with its overflow check answering "overflow" and the loss scale frozen."""

    def forced_overflow(*_: Any, **__: Any) -> bool:
        optimizer.overflow = True
        return True

    patches: dict[str, Any] = {"_update_scale": lambda *_, **__: None}
    if hasattr(optimizer, "check_overflow"):
        patches["check_overflow"] = forced_overflow  # ZeRO-1/2, fp16 optimizers
    if hasattr(optimizer, "_overflow_check_and_loss_scale_update"):  # ZeRO-3 checks only under fp16

        def stage3_overflow(update_scale: bool = True) -> bool:
            optimizer.overflow = True
            return optimizer._loss_scale_update_and_overflow_cleanup() if update_scale else True

        patches["_overflow_check_and_loss_scale_update"] = stage3_overflow
    saved_flag = vars(optimizer).get("check_grad_overflow")
    if saved_flag is not None:
        optimizer.check_grad_overflow = True  # ZeRO-1/2 may skip its check under bf16/fp32
    for name, patch in patches.items():
        setattr(optimizer, name, patch)
    try:
        return original(*args, **kwargs)
    finally:
        for name in patches:
            vars(optimizer).pop(name, None)
        if saved_flag is not None:
            optimizer.check_grad_overflow = saved_flag
        if hasattr(optimizer, "_global_grad_norm"):
            optimizer._global_grad_norm = None  # not inf: the harness skipped, the gradients were not infinite
