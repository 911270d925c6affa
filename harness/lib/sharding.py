"""FSDP (FSDP1 and FSDP2 / ``fully_shard``) seen from the plugins: what is sharded, the local shard, the full sizes.

Plugins that read parameters, gradients or optimizer state must never touch a
DTensor as a whole: ``.reshape``, ``.cpu()`` or ``bool()`` on one may
redistribute it, which is a collective hidden inside a hook (and a hang when
one rank does it alone). Everything here works on the rank's own shard
(``to_local()``), reads only metadata, and issues no collective.

* FSDP2: parameters are ``DTensor`` shards over a device mesh. On a 1-D mesh
  (``Shard(0)``) every rank holds a different slice: nothing is replicated.
  Under HSDP (a 2-D mesh, ``(Replicate(), Shard(0))``) the ranks of one
  replicate group hold the same slice: those can be compared.
* FSDP1 (``FullyShardedDataParallel``): each wrapped module's parameters are
  flattened into one ``FlatParameter``; the rank holds its padded slice (and,
  with ``use_orig_params``, views of it under the original names).
"""
from __future__ import annotations

import functools
from dataclasses import dataclass, field
from typing import Any

import torch


@functools.lru_cache(maxsize=None)  # looked up on hot paths (every step's grad norm): import once
def dtensor_class() -> Any:
    """``torch.distributed.tensor.DTensor``, or None where torch has none."""
    try:
        from torch.distributed.tensor import DTensor
    except Exception:  # noqa: BLE001 - an old or distributed-less torch build
        return None
    return DTensor


def is_dtensor(tensor: Any) -> bool:
    cls = dtensor_class()
    return cls is not None and isinstance(tensor, cls)


def local_tensor(tensor: Any) -> Any:
    """The rank's own shard of a DTensor (a plain tensor, no communication); anything else as it is."""
    return tensor.to_local() if is_dtensor(tensor) else tensor


@functools.lru_cache(maxsize=None)
def _fsdp1_class() -> Any:
    try:
        from torch.distributed.fsdp import FullyShardedDataParallel
    except Exception:  # noqa: BLE001
        return None
    return FullyShardedDataParallel


@functools.lru_cache(maxsize=None)
def _fsdp2_class() -> Any:
    try:
        from torch.distributed.fsdp import FSDPModule
    except Exception:  # noqa: BLE001
        return None
    return FSDPModule


@dataclass(frozen=True)
class Sharding:
    """How a model's parameters are laid out over the ranks.

    ``kind``: "none", "fsdp1" or "fsdp2". ``shard_size``: ranks one parameter
    is split over; ``replicate_size``: ranks holding the same shard (HSDP's
    replicate dimension, 1 otherwise). ``replica_group``: the global ranks
    that hold this rank's shard (this rank included), in rank order.
    """

    kind: str = "none"
    shard_size: int = 1
    replicate_size: int = 1
    replica_group: tuple[int, ...] = ()
    detail: str = ""
    shard_key: tuple[int, ...] = field(default=())  # this rank's coordinate in the shard dimension(s): equal within a replica group

    @property
    def sharded(self) -> bool:
        return self.kind != "none"

    def describe(self) -> str:
        if self.kind == "none":
            return "no FSDP"
        if self.kind == "fsdp2" and self.replicate_size > 1:
            return f"FSDP2 HSDP ({self.replicate_size} replicas x {self.shard_size} shards)"
        return f"{'FSDP2 (fully_shard)' if self.kind == 'fsdp2' else 'FSDP1'}, {self.shard_size} shards" + (f", {self.detail}" if self.detail else "")


def _mesh_layout(param: Any) -> tuple[int, int, tuple[int, ...], tuple[int, ...]]:
    """(shard ranks, replicate ranks, this rank's replica group, its shard coordinate) of a DTensor parameter."""
    mesh, placements = param.device_mesh, param.placements
    shard_size, replicate_size, shard_dims, replicate_dims = 1, 1, [], []
    for dim, placement in enumerate(placements):
        size = int(mesh.size(dim))
        if placement.is_shard():
            shard_size *= size
            shard_dims.append(dim)
        elif placement.is_replicate():
            replicate_size *= size
            replicate_dims.append(dim)
    coordinate = mesh.get_coordinate() or []
    shard_key = tuple(int(coordinate[d]) for d in shard_dims) if coordinate else ()
    ranks = mesh.mesh  # the global rank at each mesh coordinate
    group: list[int] = []
    if coordinate:
        for index in range(ranks.numel()):
            where = list(torch.unravel_index(torch.tensor(index), tuple(ranks.shape)))
            if all(int(where[d]) == int(coordinate[d]) for d in shard_dims):
                group.append(int(ranks.reshape(-1)[index]))
    return shard_size, replicate_size, tuple(sorted(group)), shard_key


def model_sharding(model: Any) -> Sharding:
    """The FSDP layout of ``model`` (unwrapped or not), read from its modules and parameters only."""
    module = model
    fsdp1, fsdp2 = _fsdp1_class(), _fsdp2_class()
    modules = list(module.modules()) if hasattr(module, "modules") else []
    if fsdp1 is not None and any(isinstance(m, fsdp1) for m in modules):
        root = next(m for m in modules if isinstance(m, fsdp1))
        strategy = getattr(getattr(root, "sharding_strategy", None), "name", "")
        world = torch.distributed.get_world_size() if torch.distributed.is_available() and torch.distributed.is_initialized() else 1
        group = getattr(root, "process_group", None)
        shards = torch.distributed.get_world_size(group) if group is not None and world > 1 else world
        if strategy == "NO_SHARD":
            shards = 1
        return Sharding("fsdp1", shard_size=shards, replicate_size=max(1, world // max(shards, 1)), detail=strategy.lower())
    first = next((p for p in module.parameters() if is_dtensor(p)), None) if hasattr(module, "parameters") else None
    if first is not None or (fsdp2 is not None and any(isinstance(m, fsdp2) for m in modules)):
        if first is None:
            return Sharding("fsdp2")
        shard_size, replicate_size, group, key = _mesh_layout(first)
        return Sharding("fsdp2", shard_size=shard_size, replicate_size=replicate_size, replica_group=group, shard_key=key)
    return Sharding()


def fsdp_enabled(trainer: Any) -> bool:
    """What HF and accelerate say: ``trainer.is_fsdp_enabled`` or an FSDP accelerator (FSDP2 included)."""
    if getattr(trainer, "is_fsdp_enabled", False) is True:
        return True
    accelerator = getattr(trainer, "accelerator", None)
    state = getattr(accelerator, "state", None)
    return getattr(getattr(state, "distributed_type", None), "value", None) == "FSDP"


def trainer_sharding(trainer: Any) -> Sharding:
    """The layout of the trainer's (wrapped) model; FSDP flagged by the trainer but not visible yet counts as one shard per rank."""
    model = getattr(trainer, "model_wrapped", None)
    model = getattr(trainer, "model", None) if model is None else model
    found = model_sharding(model) if model is not None else Sharding()
    if found.sharded or not fsdp_enabled(trainer):
        return found
    accelerator = getattr(trainer, "accelerator", None)
    version = "fsdp2" if getattr(accelerator, "is_fsdp2", False) else "fsdp1"
    world = int(getattr(getattr(trainer, "args", None), "world_size", 1) or 1)
    return Sharding(version, shard_size=world, detail="model not wrapped yet")


def model_is_sharded(trainer: Any) -> bool:
    """Whether each rank holds only a shard of the weights and optimizer state (FSDP sharding, or DeepSpeed ZeRO-3)."""
    if trainer_sharding(trainer).sharded:
        return True
    model = getattr(trainer, "model", None)
    return model is not None and any(hasattr(p, "ds_numel") for p in model.parameters())


def optimizer_is_sharded(trainer: Any) -> bool:
    """Whether each rank holds only a partition of the optimizer state: sharded weights, or DeepSpeed ZeRO-1/2."""
    if model_is_sharded(trainer):
        return True
    engine = getattr(trainer, "model_wrapped", None)
    stage = engine.zero_optimization_stage() if getattr(trainer, "is_deepspeed_enabled", False) and hasattr(engine, "zero_optimization_stage") else 0
    return int(stage or 0) >= 1


def full_parameter_counts(model: Any) -> tuple[int, int]:
    """(all, trainable) parameters of the whole model, not of this rank's shard.

    DTensor (FSDP2) and ZeRO-3 (``ds_numel``) parameters report their full
    size already; FSDP1's ``FlatParameter`` holds a padded local slice, so
    its original parameters are counted from its metadata (``_numels``).
    """
    flats: dict[int, Any] = {}
    fsdp1 = _fsdp1_class()
    if fsdp1 is not None:
        for m in model.modules():
            handle = getattr(m, "_handle", None) if isinstance(m, fsdp1) else None
            flat = getattr(handle, "flat_param", None)
            if flat is not None:
                flats[id(flat)] = flat
    total = trainable = 0
    for flat in flats.values():
        numels = [int(n) for n in getattr(flat, "_numels", []) or []]
        originals = getattr(flat, "_params", None)
        total += sum(numels)
        if originals is not None and len(originals) == len(numels):
            trainable += sum(n for p, n in zip(originals, numels) if p.requires_grad)
        elif flat.requires_grad:
            trainable += sum(numels)
    for param in model.parameters():
        if id(param) in flats or (flats and getattr(param, "_fsdp_flattened", False)):
            continue  # counted above, from its FlatParameter
        n = int(getattr(param, "ds_numel", 0) or param.numel())
        total += n
        trainable += n if param.requires_grad else 0
    return total, trainable


def replicated_local(tensor: Any) -> Any:
    """A DTensor that every rank holds whole (all placements ``Replicate``) as its plain local tensor; anything else as it is.

    Under FSDP2 the Trainer's gradient norm (``clip_grad_norm_`` over
    DTensor gradients) is such a DTensor: its local tensor is the global
    norm, readable with the step's other values; the DTensor itself cannot be
    packed into the step's one device-to-host read.
    """
    if is_dtensor(tensor) and all(p.is_replicate() for p in tensor.placements):
        return tensor.to_local()
    return tensor
