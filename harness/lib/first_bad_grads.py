"""Which parameter gradients went non-finite, and which first in backward order (flagged steps only).

Two sources, each one device read:

- the step's own ``.grad`` (:func:`scan_gradients`): exact as long as nothing
  mixed the gradients; listed in module order, and the first in backward
  order taken as the one nearest the output (the last in module order; a
  tied weight counts at its first use). Clipping by an infinite norm keeps
  that information (finite gradients become 0, non-finite ones NaN).
- a rerun of the step's backward (:func:`locate_backward`), for when the
  Trainer clipped by a NaN norm: the clip coefficient is then NaN and every
  gradient NaN, so ``.grad`` tells nothing. Tensor hooks on every parameter
  record, as backward produces them, whether each gradient is finite (the
  true backward order) and hand autograd a zero view in its place: ``.grad``
  stays as it was and no gradient-sized buffer is allocated.
"""
from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

import torch

from harness.lib.first_bad import MAX_NAMES, clean_name, extremes, nonfinite_names, restore_rng, rng_state

STEP_GRADS = "the step's gradients"
RERUN = "a rerun of the step's backward on the same weights"


@dataclass
class GradScan:
    """The non-finite gradients of one rank, or why they cannot be read."""

    names: list[str] = field(default_factory=list)  # module order
    first_backward: str | None = None  # the one backward reached first: nearest the output
    checked: int = 0
    scope: str = "whole model"
    source: str = STEP_GRADS
    unavailable: str | None = None
    reproduced: bool | None = None  # a rerun only: did it give non-finite gradients again

    def evidence(self) -> dict[str, Any]:
        if self.unavailable:
            return {"nonfinite_params": "unavailable", "first_nonfinite_param": None, "nonfinite_param_count": None,
                    "nonfinite_params_why": self.unavailable}
        extra = {"reproduced_in_backward": self.reproduced} if self.source == RERUN else {}
        return {"nonfinite_params": self.names[:MAX_NAMES], "first_nonfinite_param": self.first_backward,
                "nonfinite_param_count": len(self.names), "grad_tensors_checked": self.checked, "grad_scope": self.scope,
                "grad_source": self.source, **extra}

    def describe(self, ranks: int = 1) -> str:
        """What the scan found; with ``ranks`` > 1 a clean rerun is no verdict: the NaN may have come from another rank."""
        if self.unavailable:
            return f"which parameters: unavailable ({self.unavailable})"
        if not self.names:
            if self.source == RERUN and ranks > 1:
                return (f"{self.source}, which does not all-reduce, gave finite gradients: this rank's own backward did not make "
                        "the NaN (another rank's, or a transient fault)")
            if self.source == RERUN:
                return f"{self.source} gave finite gradients (not reproduced: a transient fault, or one outside the model)"
            return f"no non-finite gradient in the {self.scope} ({self.checked} tensors checked)"
        first = f"; first in module order: {self.names[0]}" if len(self.names) > 1 else ""
        return (f"first non-finite gradient in backward order: {self.first_backward} ({len(self.names)} of {self.checked} "
                f"parameter gradients non-finite in {self.source}, {self.scope}{first})")


def scan_gradients(model: Any, local: Callable[[Any], Any] = lambda t: t, scope: str = "whole model") -> GradScan:
    """The parameters of ``model`` whose ``.grad`` is non-finite; ``local`` maps a gradient to this rank's shard."""
    named = [(clean_name(n), local(p.grad)) for n, p in model.named_parameters() if p.grad is not None]
    if not named:
        return GradScan(scope=scope, unavailable="no parameter holds a gradient here")
    names, checked = nonfinite_names(named)
    return GradScan(names=names, first_backward=names[-1] if names else None, checked=checked, scope=scope)


def locate_backward(model: Any, losses: Iterable[Callable[[], torch.Tensor]], scope: str = "whole model") -> GradScan:
    """Rerun backward of each loss (one micro-batch each, in order) until one gives non-finite gradients; ``.grad`` untouched."""
    params = [(clean_name(n), p) for n, p in model.named_parameters() if p.requires_grad]
    position = {n: i for i, (n, _) in enumerate(params)}
    fired: list[tuple[str, torch.Tensor]] = []

    def hook(name: str) -> Callable[[torch.Tensor], torch.Tensor]:
        def record(grad: torch.Tensor) -> torch.Tensor:
            if grad.numel() and grad.is_floating_point():
                fired.append((name, torch.isfinite(extremes(grad)).all()))
            return torch.zeros((), dtype=grad.dtype, device=grad.device).expand_as(grad)  # no memory, nothing accumulated
        return record

    handles = [p.register_hook(hook(n)) for n, p in params]
    saved = rng_state()
    try:
        for compute in losses:
            fired.clear()
            with torch.enable_grad():
                torch.autograd.grad(compute(), [p for _, p in params], allow_unused=True)
            if not fired:
                continue
            device = fired[0][1].device
            flags = torch.stack([ok.to(device) for _, ok in fired]).tolist()  # the one read of this micro-batch
            bad = [n for (n, _), ok in zip(fired, flags) if not ok]
            if bad:
                names = sorted(set(bad), key=position.__getitem__)
                return GradScan(names, bad[0], len(params), scope, RERUN, reproduced=True)
        return GradScan([], None, len(params), scope, RERUN, reproduced=False)
    finally:
        for handle in handles:
            handle.remove()
        restore_rng(saved)
