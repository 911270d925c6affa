"""Optimizer adapters, one per engine: where a skipped step really does not update anything.

``TrainerControl`` has no skip, so the harness guards the optimizer's own
``step``. Plain runs (and accelerate) guard ``AcceleratedOptimizer.step``
(:mod:`.accelerate`); DeepSpeed runs guard the engine's own optimizer, which
steps inside ``engine.step()`` (:mod:`.deepspeed`). Both ask a
:class:`~.gate.StepGate` (the bridge's :class:`~harness.hf.guard.StepGuard`).
"""
from __future__ import annotations

from typing import Any

from harness.hf.optimizers.accelerate import guard_accelerated_optimizer
from harness.hf.optimizers.deepspeed import guard_deepspeed_optimizer
from harness.hf.optimizers.gate import StepGate

__all__ = ["StepGate", "guard_accelerated_optimizer", "guard_deepspeed_optimizer", "install_optimizer_guard"]


def install_optimizer_guard(trainer: Any, gate: StepGate) -> bool:
    """Guard the optimizer of ``trainer`` (at train begin, once it exists and is prepared); True under DeepSpeed."""
    if getattr(trainer, "is_deepspeed_enabled", False):
        engine = trainer.model_wrapped
        guard_deepspeed_optimizer(engine.optimizer, gate, engine)
        return True
    guard_accelerated_optimizer(trainer.optimizer, gate, trainer.model_wrapped)
    return False
