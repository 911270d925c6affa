"""FSDP2's reduce-scatter, checked like ZeRO-1/2's: each rank's reduced gradient shard against the ranks' local gradients.

Under fully sharded FSDP2 no gradient is held twice, so nothing compares bit
for bit. What every rank does hold is its own local (pre-reduction) gradient
of each whole parameter, in the unsharded parameter FSDP2 all-gathers for
forward and backward. Tensor hooks on those sum, per shard, two linear
fingerprints (plain and alternating sums) during the check step's backward
passes; after the reduce-scatter the owner's shard must equal the mean over
ranks of those sums (a tolerance covers rounding). The same interface as
:class:`harness.lib.grad_slices.ZeroSlices`, and no collective: every rank
derives the shard layout from the shapes and the mesh alone.

The unsharded parameters are FSDP2 internals (``FSDPParam._unsharded_param``);
where they cannot be found (another torch version, a custom
``shard_placement_fn``) :func:`fsdp2_slices` returns None and the gradient
check is off, said once by grad_sync.
"""
from __future__ import annotations

from typing import Any

import torch

from harness.lib.grad_slices import ZeroSlices
from harness.lib.sharding import is_dtensor, local_tensor


def _fsdp_params(model: Any) -> dict[int, Any]:
    """id(sharded DTensor parameter) -> its ``FSDPParam``, for every ``fully_shard``-ed module."""
    from torch.distributed.fsdp import FSDPModule

    found: dict[int, Any] = {}
    for module in model.modules():
        if not isinstance(module, FSDPModule):
            continue
        group = getattr(module._get_fsdp_state(), "_fsdp_param_group", None)
        for fsdp_param in getattr(group, "fsdp_params", None) or []:
            found[id(fsdp_param.sharded_param)] = fsdp_param
    return found


def _layout(param: Any) -> list[tuple[int, int, int]] | None:
    """(owner, first element, element count) of every rank's shard of a 1-D-mesh ``Shard(0)`` DTensor, in the flattened full tensor."""
    if not is_dtensor(param) or len(param.placements) != 1 or not param.placements[0].is_shard() or param.placements[0].dim != 0:
        return None
    if param.dim() == 0:
        return None
    rows, row = int(param.shape[0]), int(torch.Size(param.shape[1:]).numel())
    ranks = [int(r) for r in param.device_mesh.mesh.reshape(-1).tolist()]  # global rank of each shard, in mesh order
    chunk = -(-rows // len(ranks))  # torch.chunk: ceil(rows / shards) rows per shard, the last ones shorter or empty
    out = []
    for index, owner in enumerate(ranks):
        first, last = min(index * chunk, rows), min((index + 1) * chunk, rows)
        out.append((owner, first * row, (last - first) * row))
    return out


class Fsdp2Slices(ZeroSlices):
    """Each rank's reduced FSDP2 gradient shard against the mean of every rank's local gradient over that shard."""

    def __init__(self, params: list[tuple[str, torch.nn.Parameter]], rank: int, internals: dict[int, Any]) -> None:
        pieces = [(index, start, numel, owner) for index, (_, param) in enumerate(params)
                  for owner, start, numel in _layout(param) or [] if numel]
        self._set_pieces(pieces, params, rank)
        self._internals = internals

    def arm(self) -> bool:
        """Hook the unsharded parameters for this step's backward passes; False before the first all-gather made them."""
        self.disarm()
        targets = []
        for index, (_, param) in enumerate(self.params):
            if index not in self.by_param or not param.requires_grad:
                continue
            unsharded = getattr(self._internals.get(id(param)), "_unsharded_param", None)
            if unsharded is None:
                return False  # step 1: FSDP2 creates them lazily, in the first forward (the same on every rank)
            targets.append((index, unsharded))
        for index, unsharded in targets:
            self._handles.append(unsharded.register_hook(self._hook(index)))
        return bool(targets)

    def reduced_fragment(self, index: int, start: int, numel: int) -> torch.Tensor | None:
        """This rank's reduce-scattered shard of parameter ``index`` (its padding cut off)."""
        grad = self.params[index][1].grad
        return None if grad is None else local_tensor(grad).reshape(-1)[:numel]


def fsdp2_slices(model: Any, params: list[tuple[str, torch.nn.Parameter]], rank: int) -> Fsdp2Slices | None:
    """The reduce-scatter check of a fully sharded FSDP2 model, or None where FSDP2's internals are not as expected."""
    try:
        internals = _fsdp_params(model)
    except Exception:  # noqa: BLE001 - private API of another torch version
        return None
    if not internals:
        return None
    slices = Fsdp2Slices(params, rank, internals)
    if not slices.pieces or any(id(p) not in internals for index, (_, p) in enumerate(params) if index in slices.by_param):
        return None
    return slices
