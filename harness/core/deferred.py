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
from typing import Any

import numpy as np
import torch

Key = tuple[str, str]  # (owner plugin, key)


class DeferredReads:
    """Device tensors queued during a step, and the host values of the last read."""

    def __init__(self) -> None:
        self._pending: list[tuple[Key, torch.Tensor]] = []
        self._values: dict[Key, list[Any]] = {}
        self.reads = 0  # host transfers made (for the sync benchmark and tests)

    def defer(self, owner: str, key: str, tensor: Any) -> None:
        if not torch.is_tensor(tensor):
            self._pending.append(((owner, key), torch.as_tensor(tensor)))
            return
        self._pending.append(((owner, key), tensor.detach()))

    @property
    def pending(self) -> int:
        return len(self._pending)

    def read(self) -> None:
        """Copy every queued tensor to the host in one transfer; the values replace the last read's."""
        pending, self._pending = self._pending, []
        values: dict[Key, list[Any]] = defaultdict(list)
        if pending:
            parts, layout = [], []
            for key, tensor in pending:
                flat, kind = _as_int64(tensor)
                parts.append(flat)
                layout.append((key, kind, tuple(tensor.shape), flat.numel()))
            device = next((p.device for p in parts if p.device.type != "cpu"), parts[0].device)  # host-born values join the device's buffer
            buffer = torch.cat([p.to(device) for p in parts]) if len(parts) > 1 else parts[0]
            host = buffer.cpu().numpy()
            self.reads += 1
            offset = 0
            for key, kind, shape, count in layout:
                chunk = host[offset : offset + count]
                offset += count
                values[key].append(_unpack(chunk, kind, shape))
        self._values = dict(values)

    def values(self, owner: str, key: str) -> list[Any]:
        return self._values.get((owner, key), [])

    def clear(self) -> None:
        self._pending.clear()
        self._values = {}


def _as_int64(tensor: torch.Tensor) -> tuple[torch.Tensor, str]:
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
