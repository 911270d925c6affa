"""Rank/world discovery and the few collectives the harness needs.

Collectives run only when more than one process trains, and only at points
every rank reaches together (the optimizer-step guard, the end of training).

Plugins issue their collectives only through the ``*_guarded`` helpers: the
plugin's local computation runs inside the helper, and the rank joins the
collective whatever that computation did. A rank whose computation raised
sends a ``RankFailure`` instead of its result and gets its exception back
after the collective, so a plugin bug on one rank costs an
``INTERNAL_PLUGIN_ERROR`` there, never a rank left waiting in a collective
the others skipped.
"""
from __future__ import annotations

import atexit
import os
import pickle
import traceback
from dataclasses import dataclass
from typing import Any, Callable

import torch

from harness.core.collective_release import keep_until_exit, released_after, settle, wait_for_idle_workers


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


def alone() -> bool:
    """No other process to meet: torch.distributed is not running, or runs one process (every collective is the identity)."""
    return not dist_ready() or torch.distributed.get_world_size() == 1


def dist_info() -> DistInfo:
    """Rank and world size from torch.distributed when initialised, else the launcher's env."""
    if dist_ready():
        rank, world = torch.distributed.get_rank(), torch.distributed.get_world_size()
    else:
        rank, world = int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1))
    return DistInfo(rank=rank, world_size=world, local_rank=int(os.environ.get("LOCAL_RANK", 0)))


_CLOSE_AT_EXIT: dict[str, bool] = {}


def close_process_group_at_exit() -> None:
    """At exit, let gloo's workers drop every collective's tensors, then destroy the default group if the script has not.

    Most training scripts (transformers' examples among them) never call
    ``destroy_process_group``, and a rank's last collective is the harness's
    own agreement at the end of training, or the script's evaluation gather:
    a gloo worker still releasing its tensors when the interpreter finalises
    aborts the rank with "terminate called without an active exception"
    after training finished, turning a good job into a failed one
    (``harness.core.collective_release``).
    ``atexit`` runs before that teardown. Destroying a gloo or NCCL group is
    local to the rank (no collective), so a rank that exits first waits for
    nobody. Once per process.
    """
    if _CLOSE_AT_EXIT or not dist_ready():
        return
    _CLOSE_AT_EXIT["registered"] = True

    def close() -> None:
        try:
            settle()  # also when the script destroyed the group itself: DDP's reducer keeps gloo's workers alive
            wait_for_idle_workers()  # the script's own last collectives (an eval gather, a barrier) race the same way
            if torch.distributed.is_available() and torch.distributed.is_initialized():
                torch.distributed.destroy_process_group()
        except Exception:  # noqa: BLE001 - exiting anyway; never turn an exit into a traceback
            pass

    atexit.register(close)


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
    if alone():
        return list(values)
    tensor = torch.tensor(values, dtype=torch.int64)
    torch.distributed.all_reduce(tensor, op=torch.distributed.ReduceOp.MAX, group=control_group())
    keep_until_exit(tensor)
    return [int(v) for v in tensor.tolist()]


def exchange_rows(row: list[int]) -> list[list[int]]:
    """Every rank's row of int64s on every rank, in rank order: the step's one collective (``[row]`` when alone).

    Rows must have the same length on every rank (the layout is fixed per
    run, see ``harness.core.exchange``). The tensors are born on the host and
    go over the CPU control group, so reading them never waits for a GPU.
    """
    if alone():
        return [list(row)]
    mine = torch.tensor(row, dtype=torch.int64)
    rows = [torch.empty_like(mine) for _ in range(torch.distributed.get_world_size())]
    torch.distributed.all_gather(rows, mine, group=control_group())
    keep_until_exit(mine, *rows)
    return [r.numpy().tolist() for r in rows]


def _gather_bytes(payload: bytes, dst: int | None) -> list[bytes] | None:
    """Every rank's ``payload`` on rank ``dst`` (every rank when None), in rank order; None on the others.

    torch's ``*_object`` collectives do the same, but their tensors are made
    and dropped inside torch, out of ``keep_until_exit``'s reach.
    """
    group, world, rank = control_group(), torch.distributed.get_world_size(), torch.distributed.get_rank()
    length = torch.tensor([len(payload)], dtype=torch.int64)
    lengths = [torch.empty_like(length) for _ in range(world)]
    torch.distributed.all_gather(lengths, length, group=group)
    sizes = [int(n) for n in torch.cat(lengths).tolist()]
    mine = torch.zeros(max(sizes), dtype=torch.uint8)
    if payload:
        mine[: len(payload)] = torch.frombuffer(bytearray(payload), dtype=torch.uint8)
    received = [torch.empty_like(mine) for _ in range(world)] if dst is None or rank == dst else []
    if dst is None:
        torch.distributed.all_gather(received, mine, group=group)
    else:
        torch.distributed.gather(mine, received or None, dst=dst, group=group)
    keep_until_exit(length, *lengths, mine, *received)
    if not received:
        return None
    return [tensor[:size].numpy().tobytes() for tensor, size in zip(received, sizes)]


def _gather_objects(obj: Any, dst: int | None) -> list[Any] | None:
    # pickle, as torch's gather_object: these objects come from this job's own ranks, in memory, never from a file
    gathered = _gather_bytes(pickle.dumps(obj), dst)
    return None if gathered is None else [pickle.loads(payload) for payload in gathered]


def gather_to_main(obj: Any) -> list[Any] | None:
    """Every rank's ``obj`` on rank 0 (in rank order); None on the other ranks."""
    if alone():
        return [obj]
    return _gather_objects(obj, dst=0)


def all_gather_objects(obj: Any) -> list[Any]:
    """Every rank's ``obj`` on every rank (in rank order), over the CPU control group; ``[obj]`` when alone."""
    if alone():
        return [obj]
    gathered = _gather_objects(obj, dst=None)
    assert gathered is not None  # every rank receives
    return gathered


@dataclass(frozen=True)
class RankFailure:
    """What a rank sends in place of its result when its part of a guarded collective raised."""

    rank: int
    error: str  # "ExceptionType: message"
    traceback: str

    @classmethod
    def of(cls, exc: BaseException) -> "RankFailure":
        rank = torch.distributed.get_rank() if dist_ready() else 0
        tb = "".join(traceback.format_exception(type(exc), exc, exc.__traceback__))
        return cls(rank, f"{type(exc).__name__}: {exc}", tb)


def _run_guarded(compute: Callable[[], Any]) -> tuple[Any, BaseException | None]:
    try:
        return compute(), None
    except Exception as exc:  # noqa: BLE001 - re-raised after the collective, on this rank
        return RankFailure.of(exc), exc


def gather_guarded(compute: Callable[[], Any]) -> tuple[Any, list[Any] | None]:
    """``(this rank's compute(), every rank's on rank 0 | None elsewhere)``; every rank joins, even when compute raised.

    A failed rank's entry is a ``RankFailure``; the failed rank re-raises its
    exception after the gather (so its hook fails, isolated, where it failed).
    """
    value, error = _run_guarded(compute)
    gathered = gather_to_main(value)
    if error is not None:
        raise error
    return value, gathered


def all_gather_guarded(compute: Callable[[], Any], reraise: bool = True) -> list[Any]:
    """Every rank's ``compute()`` on every rank; failed ranks' entries are ``RankFailure`` (seen by all ranks alike).

    With ``reraise`` the failed rank raises its exception after the gather;
    without, the caller handles the ``RankFailure`` entries (identically on
    every rank, since every rank sees the same list).
    """
    value, error = _run_guarded(compute)
    gathered = all_gather_objects(value)
    if error is not None and reraise:
        raise error
    return gathered


def failures(gathered: list[Any] | None) -> list[RankFailure]:
    """The ``RankFailure`` entries of a guarded gather's result."""
    return [g for g in gathered or [] if isinstance(g, RankFailure)]


def broadcast_guarded(collect: Callable[[], list[torch.Tensor]], src: int | None) -> int:
    """Overwrite the tensors ``collect()`` lists with rank ``src``'s, on every rank, if all can; returns how many were sent.

    Every rank that reaches this call (all of them, at a point they reach
    together) joins one small agreement over the control group first: which
    source was asked for (``src``, None when this rank saw no reason; the
    highest asked wins), whether every rank collected its tensors, and
    whether the counts match. Nothing is broadcast unless all hold; a rank
    whose ``collect`` raised re-raises after the agreement.
    """
    if alone():
        return 0
    tensors: list[torch.Tensor] = []
    error: BaseException | None = None
    try:
        tensors = list(collect())
    except Exception as exc:  # noqa: BLE001 - re-raised after the agreement
        error = exc
    asked, failed, most, negated_least = all_reduce_max([-1 if src is None else int(src), int(error is not None), len(tensors), -len(tensors)])
    if error is not None:
        raise error
    if asked < 0 or failed or most != -negated_least:
        return 0
    return broadcast_from(tensors, asked)


def broadcast_from(tensors: list[torch.Tensor], src: int = 0) -> int:
    """Overwrite ``tensors`` on every rank with rank ``src``'s values, in place; returns how many were sent.

    Device tensors go over the default group (NCCL on GPUs), host tensors
    over the gloo control group, so that a CPU step counter in an optimizer
    state does not need a device copy. The tensors are others' (a model's,
    an optimizer's, a rerun's batches): the ones gloo carried are waited for
    here, until its workers let go of them.
    """
    if alone():
        return 0
    default_is_gloo = torch.distributed.get_backend() == "gloo"
    with released_after([tensor for tensor in tensors if default_is_gloo or tensor.device.type == "cpu"]):
        _broadcast_each(tensors, src)
    return len(tensors)


def _broadcast_each(tensors: list[torch.Tensor], src: int) -> None:
    # a function of its own: a loop variable left in the caller would hold the last tensor past released_after's check
    for tensor in tensors:
        group = control_group() if tensor.device.type == "cpu" else None
        torch.distributed.broadcast(tensor, src=src, group=group)


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
