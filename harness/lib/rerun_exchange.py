"""Send one rank's micro-batches (and the RNG state they started from) to every rank, as plain tensors: no pickle.

The rerun plugin's neighbour check, on a flagged step only. Every rank
calls :func:`broadcast_step` together (the step exchange told them all the
same source rank). The source first broadcasts the length of a JSON
manifest (0: nothing to send, e.g. its own packing failed), then the
manifest as bytes (keys, dtypes, shapes), then each tensor, over the CPU
control group (``harness.core.distributed.control_group``, gloo). The
neighbour's result comes back with :func:`broadcast_result` (a float64
vector of known length). Costs: the step's micro-batches through the host
once, on the flagged step alone.
"""
from __future__ import annotations

import json
import math
from collections.abc import Mapping
from typing import Any

import torch

from harness.core.collective_release import keep_until_exit
from harness.core.distributed import broadcast_from, control_group


def _dtype(name: str) -> torch.dtype:
    value = getattr(torch, name.replace("torch.", ""), None)
    if not isinstance(value, torch.dtype):
        raise ValueError(f"not a torch dtype: {name!r}")
    return value


def _pack(batches: list[Mapping[str, Any]], rng: Mapping[str, Any] | None, losses: list[float]) -> tuple[bytes, list[torch.Tensor]]:
    tensors: list[torch.Tensor] = []
    micro: list[list[list[Any]]] = []
    for batch in batches:
        entries = []
        for key, value in batch.items():
            if torch.is_tensor(value):
                entries.append([str(key), str(value.dtype), list(value.shape)])
                tensors.append(value.detach().cpu().contiguous())
        micro.append(entries)
    rng_entries: list[list[Any]] = []
    if rng is not None:
        for name, value in (("cpu", rng["cpu"]), ("cuda", _current_device_state(rng))):
            if value is not None:
                rng_entries.append([name, list(value.shape)])
                tensors.append(value.detach().cpu().contiguous())
    tensors.append(torch.tensor(losses, dtype=torch.float64))
    manifest = {"micro": micro, "rng": rng_entries, "losses": len(losses)}
    return json.dumps(manifest).encode("utf-8"), tensors


def _empty(manifest: dict[str, Any]) -> list[torch.Tensor]:
    out = [torch.empty([int(d) for d in shape], dtype=_dtype(dtype)) for entries in manifest["micro"] for _, dtype, shape in entries]
    out += [torch.empty([int(d) for d in shape], dtype=torch.uint8) for _, shape in manifest["rng"]]
    out.append(torch.empty(int(manifest["losses"]), dtype=torch.float64))
    return out


def broadcast_step(src: int, rank: int, batches: list[Mapping[str, Any]], rng: Mapping[str, Any] | None,
                   losses: list[float]) -> tuple[list[dict[str, Any]], dict[str, Any] | None, list[float]] | None:
    """On every rank: rank ``src``'s (micro-batches on the CPU, RNG state, original losses), or None if it sent nothing."""
    group = control_group()
    payload, tensors = b"", []
    if rank == src:
        try:
            payload, tensors = _pack(batches, rng, losses)
        except Exception:  # noqa: BLE001 - the others must not wait: send "nothing"
            payload, tensors = b"", []
    length = torch.tensor([len(payload)], dtype=torch.int64)
    torch.distributed.broadcast(length, src=src, group=group)
    keep_until_exit(length)
    if int(length[0]) == 0:
        return None
    raw = torch.frombuffer(bytearray(payload), dtype=torch.uint8) if rank == src else torch.empty(int(length[0]), dtype=torch.uint8)
    torch.distributed.broadcast(raw, src=src, group=group)
    keep_until_exit(raw)
    manifest = json.loads(bytes(raw.tolist()).decode("utf-8"))
    if rank != src:
        tensors = _empty(manifest)
    broadcast_from(tensors, src)  # host tensors: over the control group, and waited for (the caller keeps them)
    it = iter(tensors)
    received = [{key: next(it) for key, _, _ in entries} for entries in manifest["micro"]]
    states = {name: next(it) for name, _ in manifest["rng"]}
    sent_losses = [float(v) for v in next(it).tolist()]
    state = None
    if "cpu" in states:  # the sender's training device's generator goes onto the receiver's own current device
        state = {"cpu": states["cpu"], **({"cuda": states["cuda"]} if "cuda" in states else {})}
    return received, state, sent_losses


def _current_device_state(rng: Mapping[str, Any]) -> torch.Tensor | None:
    """The generator state of the device this rank trains on (``cuda_all`` holds one per visible GPU)."""
    if rng.get("cuda") is not None:
        return rng["cuda"]
    every = rng.get("cuda_all")
    if not every or not torch.cuda.is_available():
        return None
    return every[torch.cuda.current_device()]


def broadcast_result(src: int, rank: int, count: int, result: tuple[list[float], float | None, bool | None] | None
                     ) -> tuple[list[float], float | None, bool | None] | None:
    """Rank ``src``'s recomputation (losses, grad norm, grads finite) on every rank, or None when it failed there."""
    vector = torch.full((count + 4,), math.nan, dtype=torch.float64)
    if rank == src and result is not None and len(result[0]) == count:
        losses, norm, finite = result
        vector[0] = 1.0
        vector[1 : count + 1] = torch.tensor(losses, dtype=torch.float64)
        vector[count + 1] = math.nan if norm is None else norm
        vector[count + 2] = -1.0 if finite is None else float(finite)
        vector[count + 3] = float(norm is not None)
    elif rank == src:
        vector[0] = 0.0
    torch.distributed.broadcast(vector, src=src, group=control_group())
    keep_until_exit(vector)
    values = vector.tolist()
    if values[0] != 1.0:
        return None
    finite_code = values[count + 2]
    norm_value = values[count + 1] if values[count + 3] == 1.0 else None
    return values[1 : count + 1], norm_value, (None if finite_code < 0 else bool(finite_code))
