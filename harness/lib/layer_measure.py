"""Per-group norms of gradients, parameters and the applied update, computed on the device without a read.

Everything here returns device tensors of shape ``[groups]`` (squared sums
per group, summed with one ``index_add_``), so that a plugin can queue them
for the step's one device-to-host transfer.

The update ``delta W`` of an Adam-family optimizer (``torch.optim.Adam`` and
``AdamW``, foreach or fused, AMSGrad too) is derived from the optimizer
state right after the update, with the LR and weight decay the update used:
``a = lr / bc1 * m / (sqrt(v) / sqrt(bc2) + eps)``, ``delta = -(a + c W') /
(1 - c)`` with ``c = lr * wd`` for AdamW (``-a`` for Adam, whose weight decay
is inside ``m`` and ``v``), and ``W = W' - delta``. That costs a few
temporaries the size of one parameter at a time, no copy of the model. Other
optimizers need a snapshot of the parameters before the update
(:class:`Snapshot`: one transient copy of the trainable parameters).
"""
from __future__ import annotations

from typing import Any, Sequence

import torch


def group_sums(values: Sequence[torch.Tensor], index: torch.Tensor, groups: int) -> torch.Tensor:
    """Sum per group of 0-dim tensors ``values`` (one per entry of ``index``), as one ``[groups]`` float32 tensor."""
    stacked = torch.stack([v.float().to(index.device) for v in values]) if values else torch.zeros(0, device=index.device)
    return torch.zeros(groups, dtype=torch.float32, device=index.device).index_add_(0, index, stacked.to(index.device))


def squared_norm(tensor: torch.Tensor) -> torch.Tensor:
    """Squared L2 norm in float32; of this rank's shard for a DTensor (FSDP2: rank 0 measures its own shards)."""
    tensor = tensor.detach()
    if hasattr(tensor, "to_local"):
        tensor = tensor.to_local()
    return torch.linalg.vector_norm(tensor, dtype=torch.float32).square()


def grad_param_norms(params: Sequence[Any], index: torch.Tensor, groups: int) -> tuple[torch.Tensor | None, torch.Tensor]:
    """(grad norm, param norm) per group; the grad norms are None when no parameter holds a gradient (DeepSpeed ZeRO)."""
    with torch.no_grad():
        param_sq = group_sums([squared_norm(p) for p in params], index, groups).sqrt()
        grads = [(i, p.grad) for i, p in enumerate(params) if p.grad is not None]
        if not grads:
            return None, param_sq
        where = index[torch.tensor([i for i, _ in grads])] if len(grads) != len(params) else index
        grad_sq = group_sums([squared_norm(g) for _, g in grads], where, groups).sqrt()
    return grad_sq, param_sq


def inner_optimizer(optimizer: Any) -> Any:
    """The torch optimizer under accelerate's (or any) wrapper that keeps it as ``.optimizer``."""
    seen = 0
    while isinstance(getattr(optimizer, "optimizer", None), torch.optim.Optimizer) and seen < 5:
        optimizer, seen = optimizer.optimizer, seen + 1
    return optimizer


def is_adam(optimizer: Any) -> bool:
    """An optimizer whose update :func:`adam_update_norms` can derive exactly from its state."""
    return isinstance(optimizer, (torch.optim.Adam, torch.optim.AdamW)) and not any(g.get("maximize") for g in optimizer.param_groups)


def _decoupled(optimizer: Any, group: dict[str, Any]) -> bool:
    return isinstance(optimizer, torch.optim.AdamW) or bool(group.get("decoupled_weight_decay", False))


def _bias_correction(beta: float, step: Any, device: torch.device) -> Any:
    if torch.is_tensor(step):
        return (1 - beta ** step.to(device=device, dtype=torch.float32))  # tensor math: no read of the step counter
    return 1 - beta ** float(step)


def adam_update_norms(
    optimizer: Any, hyper: list[tuple[float, float]], position: dict[int, int], index_device: torch.device, groups: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
    """(||delta W||, ||W before||, ||exp_avg_sq||) per group, right after an Adam update; None without Adam state.

    ``hyper`` holds (lr, weight_decay) of each param group as the update used
    them (read in the optimizer's step pre-hook); ``position`` maps
    ``id(param)`` to its group index.
    """
    deltas, olds, moments, where = [], [], [], []
    with torch.no_grad():
        for group, (lr, decay) in zip(optimizer.param_groups, hyper):
            beta1, beta2 = group["betas"]
            eps, decoupled, amsgrad = group["eps"], _decoupled(optimizer, group), group.get("amsgrad", False)
            for param in group["params"]:
                slot = position.get(id(param))
                state = optimizer.state.get(param) or {}
                if slot is None or "exp_avg" not in state or "exp_avg_sq" not in state:
                    continue
                second = state["max_exp_avg_sq"] if amsgrad and "max_exp_avg_sq" in state else state["exp_avg_sq"]
                step = state.get("step", 1)
                bc1, bc2 = _bias_correction(beta1, step, param.device), _bias_correction(beta2, step, param.device)
                bc2_sqrt = bc2.sqrt() if torch.is_tensor(bc2) else bc2 ** 0.5
                adam = state["exp_avg"].float() * (lr / bc1) / (second.float().sqrt() / bc2_sqrt + eps)
                new = param.detach().float()
                shrink = lr * decay if decoupled else 0.0
                delta = -(adam + shrink * new) / (1 - shrink) if shrink else -adam
                deltas.append(squared_norm(delta))
                olds.append(squared_norm(new - delta))
                moments.append(squared_norm(state["exp_avg_sq"]))
                where.append(slot)
        if not where:
            return None
        index = torch.tensor(where, device=index_device)
        return tuple(group_sums(v, index, groups).sqrt() for v in (deltas, olds, moments))  # type: ignore[return-value]


class Snapshot:
    """The parameters before an update (a transient copy), for optimizers whose update cannot be derived from state."""

    def __init__(self, params: Sequence[Any]) -> None:
        with torch.no_grad():
            self.before = [p.detach().clone() for p in params]

    def update_norms(self, params: Sequence[Any], index: torch.Tensor, groups: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(||delta W||, ||W before||) per group; frees the copy."""
        with torch.no_grad():
            deltas = [squared_norm(p.detach() - b) for p, b in zip(params, self.before)]
            olds = [squared_norm(b) for b in self.before]
        self.before = []
        return group_sums(deltas, index, groups).sqrt(), group_sums(olds, index, groups).sqrt()
