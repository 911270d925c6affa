"""Rank/world discovery and the few collectives the harness needs.

Collectives run only when more than one process trains, and only at points
every rank reaches together (the optimizer-step guard, the end of training).
"""
from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

import torch


@dataclass(frozen=True)
class DistInfo:
    rank: int
    world_size: int
    local_rank: int

    @property
    def is_main(self) -> bool:
        return self.rank == 0


def dist_ready() -> bool:
    return torch.distributed.is_available() and torch.distributed.is_initialized()


def dist_info() -> DistInfo:
    """Rank and world size from torch.distributed when initialised, else the launcher's env."""
    if dist_ready():
        rank, world = torch.distributed.get_rank(), torch.distributed.get_world_size()
    else:
        rank, world = int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1))
    return DistInfo(rank=rank, world_size=world, local_rank=int(os.environ.get("LOCAL_RANK", 0)))


_CONTROL_GROUP: dict[str, Any] = {}


def control_group() -> Any:
    """A CPU (gloo) process group for the harness's few control integers and findings.

    Agreeing on an action over NCCL would put a device sync into every
    optimizer step; over gloo the integers never touch the GPU. Created once,
    lazily, at the first guard, which every rank reaches together.
    """
    if "group" not in _CONTROL_GROUP:
        if torch.distributed.get_backend() == "gloo":
            _CONTROL_GROUP["group"] = None  # the default group already runs on the CPU
        else:
            _CONTROL_GROUP["group"] = torch.distributed.new_group(backend="gloo")
    return _CONTROL_GROUP["group"]


def all_reduce_max(values: list[int]) -> list[int]:
    """Element-wise maximum of small integer vectors over all ranks (identity when alone)."""
    if not dist_ready() or torch.distributed.get_world_size() == 1:
        return list(values)
    tensor = torch.tensor(values, dtype=torch.int64)
    torch.distributed.all_reduce(tensor, op=torch.distributed.ReduceOp.MAX, group=control_group())
    return [int(v) for v in tensor.tolist()]


def gather_to_main(obj: Any) -> list[Any] | None:
    """Every rank's ``obj`` on rank 0 (in rank order); None on the other ranks."""
    if not dist_ready() or torch.distributed.get_world_size() == 1:
        return [obj]
    rank = torch.distributed.get_rank()
    out: list[Any] | None = [None] * torch.distributed.get_world_size() if rank == 0 else None
    torch.distributed.gather_object(obj, out, dst=0, group=control_group())
    return out


def all_gather_objects(obj: Any) -> list[Any]:
    """Every rank's ``obj`` on every rank (in rank order), over the CPU control group; ``[obj]`` when alone."""
    if not dist_ready() or torch.distributed.get_world_size() == 1:
        return [obj]
    out: list[Any] = [None] * torch.distributed.get_world_size()
    torch.distributed.all_gather_object(out, obj, group=control_group())
    return out


def broadcast_from(tensors: list[torch.Tensor], src: int = 0) -> int:
    """Overwrite ``tensors`` on every rank with rank ``src``'s values, in place; returns how many were sent.

    Device tensors go over the default group (NCCL on GPUs), host tensors
    over the gloo control group, so that a CPU step counter in an optimizer
    state does not need a device copy.
    """
    if not dist_ready() or torch.distributed.get_world_size() == 1:
        return 0
    for tensor in tensors:
        group = control_group() if tensor.device.type == "cpu" else None
        torch.distributed.broadcast(tensor, src=src, group=group)
    return len(tensors)


def model_parallel_sizes(trainer: Any) -> dict[str, int]:
    """Tensor, context or sequence parallel degrees above 1 (accelerate's ParallelismConfig, DeepSpeed AutoTP)."""
    sizes: dict[str, int] = {}
    config = getattr(getattr(trainer, "args", None), "parallelism_config", None)
    for name in ("tp_size", "cp_size", "sp_size"):
        value = getattr(config, name, None)
        if isinstance(value, int) and value > 1:
            sizes[name] = value
    engine = getattr(trainer, "model_wrapped", None)
    autotp = getattr(getattr(engine, "_config", None), "tensor_parallel_config", None)
    value = getattr(autotp, "autotp_size", None)
    if isinstance(value, int) and value > 1:
        sizes["autotp_size"] = value
    return sizes
