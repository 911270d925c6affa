"""What data parallelism replicates in a run, and so what ``grad_sync`` can compare across ranks.

* DDP (and DeepSpeed ZeRO-0): every rank holds the same weights and, after
  the all-reduce, the same reduced gradients.
* DeepSpeed ZeRO-1/2: the weights are replicas; each rank owns a slice of
  the reduced gradient (checked with linear sums, see
  :mod:`harness.lib.grad_slices`).
* FSDP2 HSDP (a 2-D mesh: replicate x shard) and FSDP1 ``NO_SHARD``: the
  ranks of one replica group hold the same shard of every weight and reduced
  gradient, compared bit for bit within the group.
* FSDP (FSDP1 and FSDP2 fully sharded): each rank holds its own slice and
  nothing is held twice; the all-gather gives every rank the same full
  weights (they cannot drift apart) and each reduced slice exists once. Only
  the inputs and data-loader waits are compared.
* ZeRO-3, tensor/context/sequence parallelism: nothing is compared.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from harness.core.distributed import model_parallel_sizes
from harness.lib.sharding import trainer_sharding


@dataclass(frozen=True)
class Parallelism:
    """``mode``: single | ddp | zero | replicas | sharded | unsupported; ``group``: the ranks holding this rank's weights."""

    mode: str
    described: str
    group: tuple[int, ...] = ()
    engine: str = "ddp"  # ddp | deepspeed | fsdp1 | fsdp2

    @property
    def compares_tensors(self) -> bool:
        """Weights and reduced gradients are compared bit for bit (within ``group``)."""
        return self.mode in ("ddp", "replicas")

    @property
    def active(self) -> bool:
        return self.mode in ("ddp", "zero", "replicas", "sharded")


def parallelism(trainer: Any, world_size: int, rank: int) -> Parallelism:
    """The run's data parallelism as grad_sync sees it (read once, at run start)."""
    everyone = tuple(range(world_size))
    if world_size <= 1:
        return Parallelism("single", "one process", (rank,))
    sharded = model_parallel_sizes(trainer)
    if sharded:
        return Parallelism("unsupported", "model parallelism (" + ", ".join(f"{k}={v}" for k, v in sharded.items())
                           + ") shards weights or feeds ranks the same data")
    layout = trainer_sharding(trainer)
    if layout.sharded:
        described = layout.describe()
        if layout.kind == "fsdp2" and layout.replicate_size > 1 and len(layout.replica_group) > 1:
            return Parallelism("replicas", described, layout.replica_group, "fsdp2")
        if layout.kind == "fsdp1" and layout.shard_size == 1:
            return Parallelism("replicas", described, everyone, "fsdp1")
        return Parallelism("sharded", described, (rank,), layout.kind)
    if getattr(trainer, "is_deepspeed_enabled", False):
        engine = trainer.model_wrapped
        stage = int(engine.zero_optimization_stage()) if hasattr(engine, "zero_optimization_stage") else 0
        if stage >= 3:
            return Parallelism("unsupported", "DeepSpeed ZeRO-3 shards weights and gradients", engine="deepspeed")
        if stage in (1, 2):
            return Parallelism("zero", f"DeepSpeed ZeRO-{stage}", everyone, "deepspeed")
        return Parallelism("ddp", "DeepSpeed ZeRO-0", everyone, "deepspeed")
    return Parallelism("ddp", "DistributedDataParallel", everyone)
