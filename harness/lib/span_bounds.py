"""Cheap upper bounds on what :func:`harness.lib.copied_spans.copied_spans` can find in a row's matched windows.

The ``contamination`` plugin decides at each step end, on the training
thread, whether an eval row just became dirty. For a row that joins lines
(``run_clm.py``'s blocks) the full verdict builds the row's training spans
with numpy: about 140 us a row, several ms on a step that matched a few
rows, against 0.5 ms a step for all plugins together. Most matched rows are
far from dirty, and a few operations on the matched bits (Python ints used
as bitsets, bit i: window i) prove it: ``may_be_dirty`` is False only when
no set of spans the full verdict could build from these bits reaches
``dirty_fraction`` or ``dirty_span``, so calling the full verdict only when
it says True gives the same verdicts.

The bounds follow ``copied_spans`` step by step, each time keeping a
superset of its windows: the windows it fills between two abutting runs
(any inside window up to ``window - 1`` after a window that ended a training
row when one ``window`` further on started one), the windows across a line
break kept only where all of them are set, runs stripped of their
boundary-crossing ends (a span runs from its first window inside a line to
its last). A run of ``r`` windows then bounds a span at ``r + window - 1``
units; when no run can make a span of ``dirty_span`` units, the copied units
are (nearly) whole lines inside spans only, bounded by the lines whose
windows more than ``window - 1`` units from both ends are kept, and its first
and last one (or one of them and a training row's edge among its windows) (a line shorter than a window: every window across both its
ends), summed.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

SLACK = 1e-9  # fractions compared with room for rounding: a bound errs towards judging, never towards skipping


def spread(bits: int, width: int) -> int:
    """``bits | bits << 1 | ... | bits << (width - 1)``, in about log2(width) operations."""
    have = 1
    while have < width:
        step = min(have, width - have)
        bits |= bits << step
        have += step
    return bits


def has_run(bits: int, length: int) -> bool:
    """Whether ``bits`` holds ``length`` consecutive set bits, in about log2(length) operations."""
    have = 1
    while have < length and bits:
        step = min(have, length - have)
        bits &= bits >> step
        have += step
    return bool(bits)


@dataclass(frozen=True)
class RowShape:
    """What the bounds need of one tokenisation variant of an eval row; computed once per variant."""

    window: int
    windows: int  # all window offsets
    inner: int  # bitset: the counted windows (inside one line or document; all of them when no line holds one)
    counted: int  # how many
    joined: bool  # some windows cross a line or document break, some do not (judged by its training spans)
    crossing: int = 0  # bitset: windows across a line break (joined rows only, like the fields below)
    breaks: tuple[int, ...] = ()  # per line break, ascending: the windows across it
    lines: tuple[tuple[int, int, int, int, int], ...] = ()  # per line a span may count: windows it needs, its first
    # window, its last one, all its windows, its units
    coverable: int = 0  # units inside some counted window

    @classmethod
    def of(cls, units: int, window: int, cuts: np.ndarray | None) -> RowShape:
        """The shape of ``units`` units cut at ``cuts`` (sorted gaps inside the row), as ``copied_spans`` sees it, with
        Python ints (a few microseconds: a row is shaped the first time training matches it, on the training thread)."""
        total = max(units - window + 1, 0)
        full = (1 << total) - 1
        gaps = [] if cuts is None else [int(c) for c in np.asarray(cuts).tolist()]
        breaks, crossing, across = [], 0, {}
        for gap in gaps:  # window o holds gap g strictly inside it for g - window < o < g
            lo, hi = max(0, gap - window + 1), min(total, gap)
            if lo < hi:
                breaks.append(((1 << (hi - lo)) - 1) << lo)
                crossing |= breaks[-1]
                across[gap] = breaks[-1]
        if crossing in (0, full):  # no break inside a window, or no line holds a whole one: every window counts
            return cls(window, total, full, total, False)
        inner = full & ~crossing
        lines = []  # per line holding a counted window: its first and last (they run unbroken inside a line)
        for start, end in zip([0, *gaps], [*gaps, total]):
            part = inner & ((1 << max(min(end, total) - start, 0)) - 1) << start if start < total else 0
            if part:
                lines.append(((part & -part).bit_length() - 1, part.bit_length() - 1))
        # copied_spans' coverable: each counted window covers up to the next one's start, the last one whole
        coverable = sum(last - first for first, last in lines) + window
        coverable += sum(min(following[0] - last, window) for (_, last), following in zip(lines, lines[1:]))
        edges = sorted({0, units, *gaps})
        whole = []  # per line copied_spans may count: the windows it needs kept, its first and last, all, its units
        for start, end in zip(edges, edges[1:]):
            if end - start >= window:  # one run of its windows, all but up to window - 1 units at one end covered:
                middle = max(end - 2 * window + 2 - (start + window - 1), 0)  # those more than window - 1 in, and
                needed = ((1 << middle) - 1) << (start + window - 1)
                own = ((1 << (end - window - start + 1)) - 1) << start
                whole.append((needed, 1 << start, 1 << (end - window), own, end - start))
            elif 0 < start and end < units:  # shorter than a window: every window across both its ends
                whole.append((across.get(start, 0) | across.get(end, 0), 0, 0, 0, end - start))  # (at a row end: never)
        return cls(window, total, inner, inner.bit_count(), True, crossing, tuple(breaks), tuple(whole), coverable)


def may_be_dirty(shape: RowShape, matched: int, dirty_fraction: float, dirty_span: int, row_starts: int = 0,
                 row_ends: int = 0) -> bool:
    """False only when these matched windows cannot make this variant dirty: by its n-gram share, its copied share or
    (a joined row) a training span of ``dirty_span`` units. A joined row needs a matched window inside a line (matches
    only across line breaks are template text there); a single example's share is exact. ``row_starts`` and
    ``row_ends``: the matched windows that started or ended a training row (where copied_spans lets a training cut
    leave a copy short)."""
    inside = matched & shape.inner
    if not shape.joined:
        return inside.bit_count() >= dirty_fraction * max(shape.counted, 1)
    if not inside:
        return False
    if inside.bit_count() >= dirty_fraction * shape.windows - SLACK:  # of all the row's windows (copied_spans.fraction)
        return True
    w, seen = shape.window, matched & ((1 << shape.windows) - 1)
    abutting = row_ends & (row_starts >> w)  # a row's end here, a row's start ``window`` on: copied_spans may fill between
    seen |= spread(abutting << 1, w - 1) & shape.inner
    for across in shape.breaks:  # a break's windows stay only where every one of them is set
        if seen & across != across:
            seen &= ~across
    while True:  # a span runs from its first window inside a line to its last: strip crossing ends
        ends = (seen & ~(seen << 1)) | (seen & ~(seen >> 1))
        strip = ends & shape.crossing
        if not strip:
            break
        seen &= ~strip
    if dirty_span and has_run(seen, dirty_span - w + 1):
        return True  # a span of dirty_span units may be there (or, copied_spans' long_span, copied units of any length)
    copied = sum(units for needed, first, last, own, units in shape.lines  # no span that long: (nearly) whole lines only,
                 if seen & needed == needed and (not first  # exactly, or short by a training row's cut at one end
                                                 or seen & first and (seen & last or row_ends & own)
                                                 or seen & last and row_starts & own))
    return copied >= dirty_fraction * shape.coverable - SLACK
