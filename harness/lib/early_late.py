"""Exact medians of the first and the last third of a growing series, without re-sorting the series at every value.

``dpo_health`` compares the median of a logged value over the first third of
the run's logged points with its median over the last third, at every log.
Recomputing both from the whole history costs O(n log n) per log, so over a
100,000-step run the check grows with the step count (O(n^2) in all). Here
each third is kept sorted as values arrive: a new value is inserted in the
late third, the value that leaves it is removed, and the early third only
ever takes the next value in order (the third, ``max(2, n // 3)``, never
shrinks and grows by at most one per value). Each step is a binary search
plus a ``list`` insert or delete (a memmove), and the medians are read in
O(1). The values themselves are kept (8 bytes each, plus the list's
pointer): the late third has to know which value leaves it.

The medians are bit-for-bit those of :func:`statistics.median` over the same
slices (``series[:third]`` and ``series[-third:]``).
"""
from __future__ import annotations

from bisect import bisect_left, insort


def third_of(count: int) -> int:
    """How many points each third holds: at least two, so that a short series compares two points, not one."""
    return max(2, count // 3)


def _median(ordered: list[float]) -> float:
    """:func:`statistics.median` of an already sorted, non-empty list."""
    middle = len(ordered) // 2
    if len(ordered) % 2:
        return ordered[middle]
    return (ordered[middle - 1] + ordered[middle]) / 2


class EarlyLateMedians:
    """The medians of ``values[:third]`` and ``values[-third:]`` after every ``add`` (finite values only)."""

    def __init__(self) -> None:
        self._values: list[float] = []
        self._early: list[float] = []  # values[:third], sorted
        self._late: list[float] = []  # values[late_start:], sorted
        self._late_start = 0

    def __len__(self) -> int:
        return len(self._values)

    def add(self, value: float) -> None:
        """One more point at the end of the series; NaN is refused (it has no place in a sorted list)."""
        if value != value:
            raise ValueError("EarlyLateMedians.add: NaN has no median; pass finite values (the caller filters them)")
        self._values.append(value)
        count = len(self._values)
        third = third_of(count)
        while len(self._early) < min(third, count):
            insort(self._early, self._values[len(self._early)])
        insort(self._late, value)
        start = max(0, count - third)
        while self._late_start < start:
            leaving = self._values[self._late_start]
            del self._late[bisect_left(self._late, leaving)]
            self._late_start += 1

    def early(self) -> float:
        """Median of the first third; ``ValueError`` while empty (as :func:`statistics.median`)."""
        if not self._early:
            raise ValueError("no median for an empty series")
        return _median(self._early)

    def late(self) -> float:
        """Median of the last third; ``ValueError`` while empty."""
        if not self._late:
            raise ValueError("no median for an empty series")
        return _median(self._late)


__all__ = ["EarlyLateMedians", "third_of"]
