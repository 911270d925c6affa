"""Compact fingerprints of training state (weights, optimizer, scheduler, RNG) that survive a JSON round trip.

A resume is only correct if what the Trainer restored equals what it saved.
These fingerprints are small enough to store beside every checkpoint and
exact enough to notice one changed weight: per tensor, the float64 sum and
sum of squares (any single-element change moves at least one of them).

Sharded state is fingerprinted where it lives, with no collective: under
FSDP2 the rank's own DTensor shard (``to_local()``), under FSDP1 the rank's
slice of each ``FlatParameter``, under ZeRO-3 its partition. Each rank stores
and later compares its own fingerprints, so a resume with the same world
size compares shard with shard.
"""
from __future__ import annotations

import random
from typing import Any

import numpy as np
import torch
import xxhash

from harness.lib.sharding import local_tensor


def unwrap_optimizer(optimizer: Any) -> Any:
    """The innermost optimizer under accelerate's and DeepSpeed's wrappers."""
    seen = 0
    while hasattr(optimizer, "optimizer") and seen < 4:
        optimizer = optimizer.optimizer
        seen += 1
    return optimizer


def optimizer_tensors(optimizer: Any, clone: bool = True) -> dict[str, torch.Tensor]:
    """Every tensor of the optimizer's state (and ZeRO's fp32 master partitions), by a stable name."""
    out: dict[str, torch.Tensor] = {}
    seen: set[int] = set()  # wrappers share their inner optimizer's state dict
    node, depth = optimizer, 0
    while node is not None and depth < 5:
        for attr in ("single_partition_of_fp32_groups", "fp32_partitioned_groups_flat"):  # ZeRO-1/2, ZeRO-3
            for i, part in enumerate(getattr(node, attr, None) or []):
                part = local_tensor(part)
                out[f"d{depth}.{attr}.{i}"] = part.detach().clone() if clone else part.detach()
        state = getattr(node, "state", None)
        if isinstance(state, dict) and id(state) not in seen:
            seen.add(id(state))
            for j, per_param in enumerate(state.values()):
                if isinstance(per_param, dict):
                    for key, value in per_param.items():
                        if torch.is_tensor(value):
                            value = local_tensor(value)  # FSDP2: Adam's moments are DTensor shards like their parameters
                            out[f"d{depth}.state.{j}.{key}"] = value.detach().clone() if clone else value.detach()
        node, depth = getattr(node, "optimizer", None), depth + 1
    return out


def param_tensors(model: Any, clone: bool = True) -> dict[str, torch.Tensor]:
    """Every parameter; the rank's own part when sharded (ZeRO-3 ``ds_tensor``, FSDP2 DTensor shard, FSDP1 flat slice)."""
    module = getattr(model, "module", model)
    out: dict[str, torch.Tensor] = {}
    for name, p in module.named_parameters():
        local = local_tensor(getattr(p, "ds_tensor", p)).detach()
        out[name] = local.clone() if clone else local
    return out


def tensor_sums(tensors: dict[str, torch.Tensor]) -> dict[str, list[float]]:
    """Per tensor [sum, sum of squares] in float64, read with one transfer."""
    names = [n for n, t in tensors.items() if t.numel()]
    if not names:
        return {}

    def pair(t: torch.Tensor) -> torch.Tensor:
        t = local_tensor(t)  # never reduce a DTensor as a whole: that would be a collective
        t = t if t.is_floating_point() else t.double()  # step counters; floats reduce in float64 without a copy
        return torch.stack([torch.sum(t, dtype=torch.float64), torch.linalg.vector_norm(t, 2, dtype=torch.float64) ** 2])

    sums = torch.stack([pair(tensors[n]).cpu() for n in names])
    return {n: [float(a), float(b)] for n, (a, b) in zip(names, sums.tolist())}


_BIT_VIEWS = {8: "int64", 4: "int32", 2: "int16", 1: "int8"}  # dtype names: importing this module reads nothing of torch


_CHUNK = 1 << 24  # elements per pass: float64 temporaries stay at 128 MB whatever the tensor's size


def _exact_one(tensor: torch.Tensor) -> torch.Tensor:
    """[bit-pattern sum, float64 sum, float64 sum of squares] of one tensor, on its device, in chunks."""
    flat = local_tensor(tensor).detach().reshape(-1)
    floating = flat.is_floating_point()
    bits = flat.view(getattr(torch, _BIT_VIEWS[flat.element_size()])) if floating else flat
    out = torch.zeros(3, dtype=torch.float64, device=flat.device)
    bit_sum = torch.zeros((), dtype=torch.int64, device=flat.device)
    for start in range(0, flat.numel(), _CHUNK):
        chunk = flat[start : start + _CHUNK]
        bit_sum += bits[start : start + _CHUNK].sum(dtype=torch.int64)
        out[1] += chunk.sum(dtype=torch.float64)
        if floating:
            out[2] += chunk.double().square().sum()
    out[0] = bit_sum.view(torch.float64)  # carried bit for bit, unpacked on the host
    return out


def exact_fingerprints(tensors: list[torch.Tensor | None]) -> list[tuple[int, float, float] | None]:
    """Per tensor (sum of its bit patterns as integers, float64 sum, float64 sum of squares), one host read.

    The integer sum of the raw bits changes when any one element changes by
    a single ulp, so replicas that should be bit-identical (data-parallel
    weights and reduced gradients) compare exactly; the float sums say how
    large a difference is (the sum of squares is 0 for integer tensors).
    ``None`` entries (a missing gradient) stay None; a DTensor counts by its
    local shard (no collective). Work is chunked, so the
    memory it needs does not grow with the largest tensor.
    """
    tensors = [local_tensor(t) for t in tensors]
    present = [t for t in tensors if t is not None and t.numel()]
    if not present:
        return [None] * len(tensors)
    rows = torch.stack([_exact_one(t).cpu() for t in present]) if len({t.device for t in present}) > 1 else torch.stack([_exact_one(t) for t in present]).cpu()
    values = iter(zip(rows[:, 0].view(torch.int64).tolist(), rows[:, 1].tolist(), rows[:, 2].tolist()))
    return [None if t is None or not t.numel() else next(values) for t in tensors]


def same_fingerprint_key(value: tuple[int, float, float] | None) -> tuple[int, str, str] | None:
    """A hashable key under which equal fingerprints compare equal (NaN sums included, by their bits)."""
    return None if value is None else (value[0], value[1].hex(), value[2].hex())


def differing(saved: dict[str, list[float]], now: dict[str, list[float]], rel: float = 0.0) -> list[str]:
    """Names whose fingerprints differ (beyond ``rel`` relative tolerance), plus names only one side has."""
    out = [n for n in saved if n not in now]
    for name, (a, b) in saved.items():
        if name in now:
            c, d = now[name]
            if abs(a - c) > rel * max(abs(a), abs(c)) or abs(b - d) > rel * max(abs(b), abs(d)):
                out.append(name)
    return out + [n for n in now if n not in saved]


def _digest(data: bytes) -> str:
    return xxhash.xxh3_64_hexdigest(data)


def rng_fingerprints() -> dict[str, str]:
    """One digest per random-number stream the Trainer saves and restores (python, numpy, torch CPU and device)."""
    out = {
        "python": _digest(repr(random.getstate()).encode()),
        "numpy": _digest(repr(np.random.get_state()[1].tolist()).encode() + str(np.random.get_state()[2]).encode()),
        "torch_cpu": _digest(torch.get_rng_state().numpy().tobytes()),
    }
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        out["torch_cuda"] = _digest(torch.cuda.get_rng_state().numpy().tobytes())
    return out


def scheduler_state(scheduler: Any) -> dict[str, Any] | None:
    """Where an LR scheduler stands: its step counter (``last_epoch``) and current LR; None without either."""
    position = getattr(scheduler, "last_epoch", None)
    if not isinstance(position, int):
        return None
    try:
        lr = float(scheduler.get_last_lr()[0])
    except Exception:  # noqa: BLE001 - a scheduler without get_last_lr
        return None
    return {"last_epoch": position, "lr": lr}
