"""The layout of the step's one cross-rank exchange: the core's header, then one fixed slot per plugin reservation.

Every optimizer step the ranks meet once, at the step guard, in one
all-gather of one int64 row per rank (``harness.core.distributed.exchange_rows``).
The row starts with the core's header (the strongest pending action, queued
findings, plugin switch-off votes) and goes on with one slot per
reservation, in the order the reservations were made (the same on every
rank: plugins reserve in ``on_run_start``, which every rank runs in the same
plugin order). A slot is ``[count, v0, ..., v_{capacity-1}]``; ``count`` is
-1 when the plugin shared nothing this step, and may exceed the capacity
when it shared more (the receiver then knows the values were cut).
"""
from __future__ import annotations

from collections.abc import Sequence

Key = tuple[str, str]  # (owner plugin, key)
NOT_SHARED = -1


class StepExchange:
    """Reservations, this step's contributions, and what every rank contributed at the last exchange."""

    def __init__(self) -> None:
        self._capacity: dict[Key, int] = {}
        self._outgoing: dict[Key, list[int]] = {}
        self._received: dict[Key, list[list[int] | None]] = {}
        self._counts: dict[Key, list[int]] = {}

    def reserve(self, owner: str, key: str, capacity: int) -> None:
        """A fixed slot of ``capacity`` integers in every step's row (call on every rank, in the same order)."""
        if capacity < 0:
            raise ValueError(f"capacity must be >= 0, got {capacity}")
        self._capacity[(owner, key)] = max(capacity, self._capacity.get((owner, key), 0))

    def share(self, owner: str, key: str, values: Sequence[int]) -> None:
        if (owner, key) not in self._capacity:
            raise KeyError(f"plugin '{owner}' shares '{key}' without reserving it (call ctx.reserve('{key}', capacity) in on_run_start)")
        self._outgoing[(owner, key)] = [int(v) for v in values]

    def drop_outgoing(self) -> None:
        """Forget contributions made for a step that never reached its exchange."""
        self._outgoing = {}

    def keys(self) -> list[Key]:
        return list(self._capacity)

    @property
    def width(self) -> int:
        return sum(1 + c for c in self._capacity.values())

    def pack(self, header: Sequence[int]) -> list[int]:
        """This rank's row: the header, then each slot (count, values padded to capacity)."""
        row = [int(v) for v in header]
        for key, capacity in self._capacity.items():
            values = self._outgoing.get(key)
            if values is None:
                row += [NOT_SHARED] + [0] * capacity
            else:
                row += [len(values)] + values[:capacity] + [0] * (capacity - min(len(values), capacity))
        self._outgoing = {}
        return row

    def loop_back(self) -> None:
        """One process: what ``unpack`` of this rank's own packed row gives, without building the row."""
        outgoing, self._outgoing = self._outgoing, {}
        if not outgoing:  # most steps of a one-process run share nothing
            self._received, self._counts = {}, {}
            return
        self._received = {key: [values[: self._capacity[key]]] for key, values in outgoing.items()}
        self._counts = {key: [len(values)] for key, values in outgoing.items()}

    def unpack(self, rows: Sequence[Sequence[int]], header_width: int) -> list[list[int]]:
        """Every rank's header; the slots are kept for ``received``."""
        headers = [list(row[:header_width]) for row in rows]
        received: dict[Key, list[list[int] | None]] = {}
        counts: dict[Key, list[int]] = {}
        offset = header_width
        for key, capacity in self._capacity.items():
            per_rank: list[list[int] | None] = []
            for row in rows:
                count = int(row[offset])
                per_rank.append(None if count == NOT_SHARED else [int(v) for v in row[offset + 1 : offset + 1 + min(count, capacity)]])
            received[key] = per_rank
            counts[key] = [int(row[offset]) for row in rows]
            offset += 1 + capacity
        self._received = received
        self._counts = counts
        return headers

    def received(self, owner: str, key: str) -> list[list[int] | None] | None:
        """Each rank's values at the last exchange (None for a rank that shared nothing); None if nobody shared."""
        per_rank = self._received.get((owner, key))
        if per_rank is None or all(v is None for v in per_rank):
            return None
        return per_rank

    def truncated(self, owner: str, key: str, count: int) -> bool:
        return count > self._capacity.get((owner, key), 0)

    def cut_ranks(self, owner: str, key: str) -> list[int]:
        """Ranks whose contribution at the last exchange was longer than the slot (their values arrived cut)."""
        capacity = self._capacity.get((owner, key), 0)
        return [rank for rank, count in enumerate(self._counts.get((owner, key), [])) if count > capacity]

    def reset(self) -> None:
        self._outgoing = {}
        self._received = {}
        self._counts = {}
