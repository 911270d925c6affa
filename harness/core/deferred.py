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

    def __init__(self, join_host: bool = False) -> None:
        """``join_host``: read host tensors as device ones are read (joined, one copy); only worth it in tests, which
        thereby run the device path on a machine without a device."""
        self._join_host = join_host
        self._host_run = not join_host  # try the host loop first, until a device tensor shows this is a device run
        self._pending: list[tuple[Key, torch.Tensor]] = []
        self._values: dict[Key, list[Any]] = {}
        self.reads = 0  # host transfers made (for the sync benchmark and tests)

    @property
    def join_host(self) -> bool:
        return self._join_host

    @join_host.setter
    def join_host(self, value: bool) -> None:
        """Set after construction too (the sync benchmark does, on an attached run): the host loop follows it."""
        self._join_host = value
        self._host_run = not value

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

        Device tensors are joined on their device and copied once; host
        tensors (all of them in a CPU run) are read one by one with ``tolist``,
        as exact and far cheaper than joining them, since there is no transfer to
        save. Device tensors are
        joined by kind (every float in one ``cat`` and one conversion to
        float64 bits, every integer and bool in another; the scalars of a kind,
        most of what plugins queue, in one ``stack`` first), and each kind's
        values become Python numbers in one ``tolist``: a step's read is a
        handful of tensor operations however many values plugins queued. A
        tensor that cannot be packed (a meta or complex tensor, a DTensor) is
        dropped and charged to its plugin through ``on_error``; the others are
        read.
        """
        pending, self._pending = self._pending, []
        if self._host_run and self._read_all_on_host(pending):
            return
        scalars: dict[Group, list[torch.Tensor]] = defaultdict(list)  # 0-d tensors: stacked in one operation
        flats: dict[Group, list[torch.Tensor]] = defaultdict(list)  # the others, flattened
        entries: list[tuple[Key, str, tuple[int, ...], Group, bool, int, int]] = []  # key, kind, shape, group, scalar, index, count
        hosts: list[Any] = []  # the host values, in queue order (host tensors' read at once)
        tensors_read = False
        for key, tensor in pending:
            if type(tensor) is _Host:
                entries.append((key, "host", (), (True, False), False, len(hosts), 0))
                hosts.append(tensor.value)
                continue
            try:
                kind = _kind(tensor)
            except Exception as exc:  # noqa: BLE001 - one plugin's odd tensor must not cost the others their values
                if on_error is not None:
                    on_error(key[0], exc)
                continue
            on_host = tensor.is_cpu
            if on_host and not self.join_host:  # no transfer to save: one ``tolist`` each is a few microseconds, the packing tens
                entries.append((key, "host", (), (True, False), False, len(hosts), 0))
                hosts.append(tensor.tolist())
                tensors_read = True
                continue
            if kind == "float" and tensor.device.type == "mps":
                tensor = tensor.cpu()  # MPS has no float64
                on_host = True
            group = (on_host, kind == "float")
            shape = tuple(tensor.shape)
            if not shape:
                entries.append((key, kind, shape, group, True, len(scalars[group]), 1))
                scalars[group].append(tensor)
            else:
                flat = tensor if len(shape) == 1 else tensor.reshape(-1)
                entries.append((key, kind, shape, group, False, len(flats[group]), flat.numel()))
                flats[group].append(flat)
        values: dict[Key, list[Any]] = defaultdict(list)
        numbers: dict[Group, list[Any]] = {}  # each group's values as Python numbers: its scalars, then its flats
        offsets: dict[Group, list[int]] = {}  # where each flat of a group starts in its numbers
        if tensors_read or len(entries) > len(hosts):  # some tensor to read
            for on_host in (False, True):
                kinds = [floating for floating in (True, False) if scalars.get((on_host, floating)) or flats.get((on_host, floating))]
                if not kinds:
                    continue
                parts = [_as_int64(scalars.get((on_host, floating), []), flats.get((on_host, floating), []), floating)
                         for floating in kinds]
                joined = torch.cat(parts) if len(parts) > 1 else parts[0]
                array = joined.numpy() if on_host else joined.cpu().numpy()  # the one device-to-host copy
                start = 0
                for floating, part in zip(kinds, parts):
                    group = (on_host, floating)
                    chunk = array[start : start + len(part)]
                    numbers[group] = (chunk.view(np.float64) if floating else chunk).tolist()
                    start += len(part)
                    first, offsets[group] = len(scalars.get(group, [])), []
                    for flat in flats.get(group, []):
                        offsets[group].append(first)
                        first += flat.numel()
            self.reads += 1
        for key, kind, shape, group, scalar, index, count in entries:
            if kind == "host":
                values[key].append(hosts[index])
                continue
            if scalar:
                value: Any = numbers[group][index]
                values[key].append(value != 0 if kind == "bool" else value)
                continue
            begin = offsets[group][index]
            items = numbers[group][begin : begin + count]
            if kind == "bool":
                items = [item != 0 for item in items]
            values[key].append(items if len(shape) == 1 else np.array(items, dtype=object).reshape(shape).tolist())
        self._values = dict(values)

    def _read_all_on_host(self, pending: list[tuple[Key, Any]]) -> bool:
        """A CPU run's read in one short loop, as the general path reads host tensors (one ``tolist`` each): False,
        with nothing read, when some queued tensor is not a plain host tensor of a common dtype (the general path then
        reads them all, and charges what it cannot read)."""
        values: dict[Key, list[Any]] = {}
        tensors_read = False
        for key, tensor in pending:
            if type(tensor) is _Host:
                value = tensor.value
            elif type(tensor) is torch.Tensor and tensor.is_cpu and tensor.dtype in _KINDS:
                value, tensors_read = tensor.tolist(), True
            else:
                if torch.is_tensor(tensor) and not tensor.is_cpu and not tensor.is_meta:
                    self._host_run = False  # a device run: later reads go straight to the joined path (no host reads twice)
                return False
            listed = values.get(key)
            if listed is None:
                values[key] = [value]
            else:
                listed.append(value)
        if tensors_read:
            self.reads += 1
        self._values = values
        return True

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


_KINDS: dict[torch.dtype, str] = {torch.bool: "bool"}
for _dtype in (torch.float16, torch.bfloat16, torch.float32, torch.float64):
    _KINDS[_dtype] = "float"
for _dtype in (torch.uint8, torch.int8, torch.int16, torch.int32, torch.int64):
    _KINDS[_dtype] = "int"


def _kind(tensor: torch.Tensor) -> str:
    """The tensor's kind ("float", "bool", "int"); raises for what cannot be packed. A plain tensor of a common dtype
    is one dictionary lookup (this runs for every queued tensor of every step); the rest are looked at closely."""
    kind = _KINDS.get(tensor.dtype) if type(tensor) is torch.Tensor and not tensor.is_meta else None
    if kind is not None:
        return kind
    if tensor.is_complex() or tensor.device.type == "meta":
        raise TypeError(f"ctx.defer cannot read a {tensor.dtype} tensor on {tensor.device}: defer real tensors with data")
    if hasattr(tensor, "to_local"):  # a DTensor (FSDP2, tensor parallel): its local part is what this rank holds
        raise TypeError(f"ctx.defer cannot read a {type(tensor).__name__}: defer its local tensor (`.to_local()`) instead")
    if tensor.dtype == torch.bool:
        return "bool"
    return "float" if tensor.is_floating_point() else "int"


def _as_int64(scalars: list[torch.Tensor], flats: list[torch.Tensor], floating: bool) -> torch.Tensor:
    """One kind's tensors on one device as one flat int64 tensor, the scalars first: floats by their float64 bit pattern
    (exact). ``cat`` and ``stack`` promote to the widest dtype, which is exact for both kinds."""
    parts = ([torch.stack(scalars)] if scalars else []) + flats
    joined = torch.cat(parts) if len(parts) > 1 else parts[0]
    if floating:
        return joined.view(torch.int64) if joined.dtype == torch.float64 else joined.to(torch.float64).view(torch.int64)
    return joined if joined.dtype == torch.int64 else joined.to(torch.int64)
