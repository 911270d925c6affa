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
Group = tuple[bool, bool]  # (born on the host, floating point): tensors joined in one cat
ErrorSink = Callable[[str, BaseException], None]  # (owner plugin, exception)


class DeferredReads:
    """Device tensors queued during a step, and the host values of the last read."""

    def __init__(self) -> None:
        self._pending: list[tuple[Key, torch.Tensor]] = []
        self._values: dict[Key, list[Any]] = {}
        self.reads = 0  # host transfers made (for the sync benchmark and tests)

    def defer(self, owner: str, key: str, tensor: Any) -> None:
        """Queue a tensor; a host value (a number, a list, a bool a plugin computed from CPU data) is kept as it is and
        comes back unchanged, in order with the tensors of its key: no tensor operation, which costs tens of
        microseconds on the training thread between steps."""
        if not torch.is_tensor(tensor):
            self._pending.append(((owner, key), _Host(tensor)))
            return
        self._pending.append(((owner, key), tensor.detach() if tensor.requires_grad else tensor))

    @property
    def pending(self) -> int:
        return len(self._pending)

    def drop_pending(self) -> None:
        """Forget tensors queued for a step that never reached its read (a step that died half-way)."""
        self._pending = []

    def read(self, on_error: ErrorSink | None = None) -> None:
        """Copy every queued tensor to the host in one transfer; the values replace the last read's.

        Device tensors are joined on their device and copied once; host-born
        ones are joined on the host (no host-to-device copy). Tensors are
        joined by kind first (every float in one ``cat`` and one conversion to
        float64 bits, every integer and bool in another), so a step's read
        costs a handful of tensor operations however many values plugins
        queued. A tensor that cannot be packed (a meta or complex tensor, a
        DTensor) is dropped and charged to its plugin through ``on_error``;
        the others are read.
        """
        pending, self._pending = self._pending, []
        groups: dict[Group, list[torch.Tensor]] = defaultdict(list)
        sizes: dict[Group, int] = defaultdict(int)
        entries: list[tuple[Key, str, tuple[int, ...], Group, int, int]] = []  # key, kind, shape, group, offset, count
        hosts: list[Any] = []  # the host values, in queue order
        for key, tensor in pending:
            if type(tensor) is _Host:
                entries.append((key, "host", (), (True, False), -1, 0))
                hosts.append(tensor.value)
                continue
            try:
                flat, kind = _flat(tensor)
            except Exception as exc:  # noqa: BLE001 - one plugin's odd tensor must not cost the others their values
                if on_error is not None:
                    on_error(key[0], exc)
                continue
            group = (flat.device.type == "cpu", kind == "float")
            count = flat.numel()
            entries.append((key, kind, tuple(tensor.shape), group, sizes[group], count))
            groups[group].append(flat)
            sizes[group] += count
        values: dict[Key, list[Any]] = defaultdict(list)
        arrays: dict[Group, np.ndarray] = {}
        if len(entries) > len(hosts):  # some tensor to read
            for on_host in (False, True):
                kinds = [floating for floating in (True, False) if groups.get((on_host, floating))]
                if not kinds:
                    continue
                parts = [_as_int64(groups[(on_host, floating)], floating) for floating in kinds]
                joined = torch.cat(parts) if len(parts) > 1 else parts[0]
                array = joined.numpy() if on_host else joined.cpu().numpy()  # the one device-to-host copy
                start = 0
                for floating in kinds:
                    arrays[(on_host, floating)] = array[start : start + sizes[(on_host, floating)]]
                    start += sizes[(on_host, floating)]
            self.reads += 1
        host_values = iter(hosts)
        for key, kind, shape, group, offset, count in entries:
            values[key].append(next(host_values) if kind == "host" else _unpack(arrays[group][offset : offset + count], kind, shape))
        self._values = dict(values)

    def values(self, owner: str, key: str) -> list[Any]:
        return self._values.get((owner, key), [])

    def clear(self) -> None:
        self._pending.clear()
        self._values = {}


class _Host:
    """A host value queued with the tensors (marks it apart from them without a type test per kind)."""

    __slots__ = ("value",)

    def __init__(self, value: Any) -> None:
        self.value = value


def _flat(tensor: torch.Tensor) -> tuple[torch.Tensor, str]:
    """The tensor as one flat view and its kind ("float", "bool", "int"); raises for what cannot be packed."""
    if tensor.is_complex() or tensor.device.type == "meta":
        raise TypeError(f"ctx.defer cannot read a {tensor.dtype} tensor on {tensor.device}: defer real tensors with data")
    if hasattr(tensor, "to_local"):  # a DTensor (FSDP2, tensor parallel): its local part is what this rank holds
        raise TypeError(f"ctx.defer cannot read a {type(tensor).__name__}: defer its local tensor (`.to_local()`) instead")
    if tensor.device.type == "mps" and tensor.is_floating_point():
        tensor = tensor.cpu()  # MPS has no float64
    flat = tensor.reshape(-1)
    if flat.dtype == torch.bool:
        return flat, "bool"
    return flat, "float" if flat.is_floating_point() else "int"


def _as_int64(flats: list[torch.Tensor], floating: bool) -> torch.Tensor:
    """Flat tensors of one kind on one device as one int64 tensor: floats by their float64 bit pattern (exact)."""
    joined = torch.cat(flats) if len(flats) > 1 else flats[0]  # cat promotes to the widest dtype: exact for both kinds
    if floating:
        return joined.to(torch.float64).view(torch.int64)
    return joined.to(torch.int64)


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
