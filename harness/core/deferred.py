"""One device-to-host transfer per optimizer step for every plugin together.

Reading a device tensor (``.item()``, ``.tolist()``, ``bool()``) stalls the
GPU's queue until everything before it has run. Plugins therefore hand their
tensors to ``ctx.defer(key, tensor)`` during the step; the step guard calls
:meth:`DeferredReads.read` once, which packs every queued tensor into one
int64 buffer (floats by their bit pattern, so nothing is rounded), copies it
to the host in one transfer and unpacks the values. Plugins read theirs with
``ctx.deferred(key)`` in ``on_before_optimizer_step`` and ``on_step_end``.
"""
from __future__ import annotations

from collections import defaultdict
from typing import Any, Callable

import numpy as np
import torch

Key = tuple[str, str]  # (owner plugin, key)
ErrorSink = Callable[[str, BaseException], None]  # (owner plugin, exception)


class DeferredReads:
    """Device tensors queued during a step, and the host values of the last read."""

    def __init__(self) -> None:
        self._pending: list[tuple[Key, torch.Tensor]] = []
        self._values: dict[Key, list[Any]] = {}
        self.reads = 0  # host transfers made (for the sync benchmark and tests)

    def defer(self, owner: str, key: str, tensor: Any) -> None:
        if not torch.is_tensor(tensor):  # a host number: kept exact (float64), never copied to a device
            dtype = torch.float64 if isinstance(tensor, float) else None
            self._pending.append(((owner, key), torch.as_tensor(tensor, dtype=dtype)))
            return
        self._pending.append(((owner, key), tensor.detach()))

    @property
    def pending(self) -> int:
        return len(self._pending)

    def drop_pending(self) -> None:
        """Forget tensors queued for a step that never reached its read (a step that died half-way)."""
        self._pending = []

    def read(self, on_error: ErrorSink | None = None) -> None:
        """Copy every queued tensor to the host in one transfer; the values replace the last read's.

        Device tensors are joined on their device and copied once; host-born
        ones are joined on the host (no host-to-device copy). A tensor that
        cannot be packed (a meta or complex tensor, a DTensor) is dropped and
        charged to its plugin through ``on_error``; the others are read.
        """
        pending, self._pending = self._pending, []
        values: dict[Key, list[Any]] = defaultdict(list)
        packed: list[tuple[Key, str, tuple[int, ...], torch.Tensor]] = []
        for key, tensor in pending:
            try:
                flat, kind = _as_int64(tensor)
            except Exception as exc:  # noqa: BLE001 - one plugin's odd tensor must not cost the others their values
                if on_error is not None:
                    on_error(key[0], exc)
                continue
            packed.append((key, kind, tuple(tensor.shape), flat))
        if packed:
            host_parts = [p for *_, p in packed if p.device.type == "cpu"]
            device_parts = [p for *_, p in packed if p.device.type != "cpu"]
            on_device = torch.cat(device_parts).cpu().numpy() if device_parts else None  # the one device-to-host copy
            on_host = torch.cat(host_parts).numpy() if host_parts else None  # born on the host: no device involved
            self.reads += 1
            offsets = {"device": 0, "host": 0}
            for key, kind, shape, flat in packed:
                where = "host" if flat.device.type == "cpu" else "device"
                source = on_host if where == "host" else on_device
                count = flat.numel()
                chunk = source[offsets[where] : offsets[where] + count]  # type: ignore[index]
                offsets[where] += count
                values[key].append(_unpack(chunk, kind, shape))
        self._values = dict(values)

    def values(self, owner: str, key: str) -> list[Any]:
        return self._values.get((owner, key), [])

    def clear(self) -> None:
        self._pending.clear()
        self._values = {}


def _as_int64(tensor: torch.Tensor) -> tuple[torch.Tensor, str]:
    if tensor.is_complex() or tensor.device.type == "meta":
        raise TypeError(f"ctx.defer cannot read a {tensor.dtype} tensor on {tensor.device}: defer real tensors with data")
    if hasattr(tensor, "to_local"):  # a DTensor (FSDP2, tensor parallel): its local part is what this rank holds
        raise TypeError(f"ctx.defer cannot read a {type(tensor).__name__}: defer its local tensor (`.to_local()`) instead")
    if tensor.device.type == "mps" and tensor.is_floating_point():
        tensor = tensor.cpu()  # MPS has no float64
    flat = tensor.reshape(-1)
    if flat.dtype == torch.bool:
        return flat.to(torch.int64), "bool"
    if flat.is_floating_point():
        return flat.to(torch.float64).view(torch.int64), "float"
    return flat.to(torch.int64), "int"


def _unpack(chunk: np.ndarray, kind: str, shape: tuple[int, ...]) -> Any:
    if kind == "float":
        array: np.ndarray = chunk.view(np.float64)
    elif kind == "bool":
        array = chunk.astype(bool)
    else:
        array = chunk
    if not shape:
        return array[0].item()
    return array.reshape(shape).tolist()
