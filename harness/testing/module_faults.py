"""Faults born inside one named module or parameter: a forward overflow, a non-finite gradient in backward.

Used by ``FaultInjector`` (options ``overflow_module`` / ``overflow_at_step``
and ``inf_grad_target``) to test that nan_guard names the module or
parameter where a NaN first appears, not just that one appeared. Both stay
on for their whole step, so a rerun of the step reproduces them.
"""
from __future__ import annotations

from typing import Any

import torch


class ModuleFaults:
    """Hooks on named modules or parameters of ``model``, active while their flag is set.

    ``overflowing``: every forward of the ``overflow`` module returns its
    output times inf (an activation overflow). ``inf_grads``: the gradient
    of the ``inf_grad`` parameter, or the one arriving at the ``inf_grad``
    module's output, is multiplied by inf in every backward.
    """

    def __init__(self, model: Any, overflow: str | None, inf_grad: str | None) -> None:
        self.overflowing = False
        self.inf_grads = False
        if overflow:
            model.get_submodule(overflow).register_forward_hook(self._overflow)
        if inf_grad:
            params = dict(model.named_parameters())
            if inf_grad in params:
                params[inf_grad].register_hook(self._scale_grad)
            else:
                model.get_submodule(inf_grad).register_forward_hook(self._inf_grad)

    def _overflow(self, module: Any, inputs: Any, output: Any) -> Any:
        if self.overflowing and torch.is_tensor(output):
            return output * float("inf")
        return None

    def _scale_grad(self, grad: torch.Tensor) -> torch.Tensor | None:
        return grad * float("inf") if self.inf_grads else None

    def _inf_grad(self, module: Any, inputs: Any, output: Any) -> None:
        if self.inf_grads and torch.is_tensor(output) and output.requires_grad:
            output.register_hook(self._scale_grad)
