"""Spans of training text in an eval row: runs of matched n-grams, with the n-grams across a line or document boundary set apart.

An eval row may join several lines or documents (``run_clm.py`` cuts the
concatenated validation text into 64-token blocks). A line copied into
training on its own matches only the n-grams inside it: the ones that cross
into the next line never occur in training, so counting them (as a plain
matched fraction does) makes a block of copied lines look two-thirds clean.
Here a row's boundaries are gaps between units (gap ``g`` lies between unit
``g - 1`` and unit ``g``); a window with a gap strictly inside it crosses a
boundary and counts neither for nor against the row. A run of consecutive
matched windows is one stretch of text seen in training: a span of
``run + n - 1`` units (two runs that abut, the first ending a training row and
the second starting one, are one span that a training block boundary cut). A span counts as training text only when it holds a window
inside one line: a run made of boundary-crossing windows alone is template
text around a line break (``Answer: 21.\\nQuestion: What is``), not a copy.
Rows without boundaries (one eval example per line) are judged on all their
windows, as before.

A joined row is judged on the larger of its n-gram share and its copied
share (of the units a window could cover, those that are evidence of a
copy): a copied line that a training block cut in two keeps its tokens but
loses the n-grams across the cut. Evidence of a copy is a whole line (or
document, or the part of one the row holds) inside a training span (but for
the few units a training cut near its end leaves without a window, where the
span's window there sat at its training row's edge: the hits say so), or a span
of at least ``long_span`` units (the ``dirty_span`` that makes a row dirty by
itself) wherever it lies. A shorter piece of a line is no evidence: lines of a
templated corpus share such phrases with many training lines (``To make
dumplings, slice the`` of a 31-token line), so counting them made clean blocks
half "copied". A single example keeps the n-gram share alone, where a few
n-grams of a shared template would otherwise cover many of its units.
"""
from __future__ import annotations

from bisect import bisect_left, bisect_right
from collections.abc import Iterable
from dataclasses import dataclass, field

import numpy as np


def crossing_windows(units: int, window: int, cuts: np.ndarray | None) -> np.ndarray:
    """Per window offset (``units - window + 1`` of them): whether a boundary gap falls strictly inside it."""
    count = units - window + 1
    if count <= 0:
        return np.zeros(0, dtype=np.bool_)
    if cuts is None or not len(cuts):
        return np.zeros(count, dtype=np.bool_)
    starts = np.arange(count, dtype=np.int64)
    # window o holds the gaps o+1 .. o+window-1: some cut there iff fewer cuts lie at or before o than at or before o+window-1
    return np.searchsorted(cuts, starts, side="right") < np.searchsorted(cuts, starts + (window - 1), side="right")


@dataclass
class CopiedSpans:
    """What training matched of one unit sequence (one tokenisation variant of an eval row)."""

    window: int = 0
    units: int = 0
    matched: int = 0  # matched windows inside one line or document (what the n-gram fraction counts)
    windows: int = 0  # windows inside one line or document (all windows when no line holds a whole one)
    crossing_matched: int = 0  # matched windows across a boundary (counted neither way)
    crossing: int = 0  # windows across a boundary
    segments: int = 0  # lines or documents that hold a whole window
    edges: set[int] = field(default_factory=set)  # where lines or documents start and end (the row's ends included)
    coverable: int = 0  # units inside some counted window (a line shorter than n cannot be matched at all)
    spans: list[tuple[int, int]] = field(default_factory=list)  # training spans, [start, end) in units, ascending
    long_span: int = 0  # a span this long is evidence of a copy wherever it lies (0: only whole lines are)
    row_starts: frozenset[int] = frozenset()  # matched windows that started a training row: a copy may be cut before them
    row_ends: frozenset[int] = frozenset()  # matched windows that ended a training row: a copy may be cut after them

    @property
    def fraction(self) -> float:
        """The share of the n-grams seen in training: those inside one line matched, of all the row's n-grams (one across
        a boundary never counts for the row: template text around line breaks matches there; it still counts against,
        as the row's text it is, so a few template n-grams inside short lines do not make a block look copied)."""
        total = self.windows + self.crossing
        return self.matched / total if total else 0.0

    @property
    def joined(self) -> bool:
        """The sequence joins lines or documents and some of its windows lie inside one: judged by its training spans,
        even when only one line holds a whole window (a copied line of 43 tokens in a 64-token block whose other line
        is shorter than a window is still two thirds of the block)."""
        return self.crossing > 0

    @property
    def covered(self) -> int:
        """Units inside training spans (two runs a few windows apart overlap: their union)."""
        covered, reach = 0, 0
        for start, end in self.spans:  # ascending starts
            covered += max(0, end - max(start, reach))
            reach = max(reach, end)
        return covered

    @property
    def copied(self) -> int:
        """Units that are evidence of a copy: spans of at least ``long_span`` units whole, and every line (the part of
        one at the row's ends included) that one span covers, or covers but for at most ``window - 1`` units at one
        end where the span's window at that end started (or ended) a training row. A line copied into training
        loses the windows across the training block boundary that cut it: near its middle the two runs abut and are
        one span, but a cut within ``window - 1`` units of the line's start or end leaves those units without a
        window. A span that stops short of a line's end inside a training row saw other text there: the same
        sentence with another name or number, which a templated corpus holds by the hundred. Any other piece of a
        line is no evidence: a phrase its template shares with many training lines is as likely as a copy."""
        edges = sorted(self.edges)
        regions = [(start, end) for start, end in self.spans if self.long_span and end - start >= self.long_span]
        slack, w = self.window - 1, self.window
        starts, ends = sorted(self.row_starts), sorted(self.row_ends)
        for start, end in self.spans:
            lines = edges[max(bisect_right(edges, start) - 1, 0) : bisect_left(edges, end) + 1]
            for a, b in zip(lines, lines[1:]):  # the lines this span reaches into, [a, b)
                s, e = max(start, a), min(end, b)
                # a training row ended inside the line, within window - 1 units of its end, at a window of the span (windows
                # of other rows may go on past it: the same template words); or a row started so near its start
                cut_after = _any_between(ends, max(b - slack - w, s), e - w)
                cut_before = _any_between(starts, s, min(a + slack, e - w))
                if (s == a and (e == b or cut_after)) or (e == b and cut_before):
                    regions.append((a, b))
        copied, reach = 0, 0
        for start, end in sorted(regions):
            copied += max(0, end - max(start, reach))
            reach = max(reach, end)
        return copied

    @property
    def copied_fraction(self) -> float:
        """The share of the coverable units inside training spans: a copied line that a training block cut in two is
        copied whole, although the n-grams across training's cut were never seen."""
        return min(1.0, self.copied / self.coverable) if self.coverable else 0.0

    @property
    def judged_fraction(self) -> float:
        """What the status is judged on: a joined row's larger share (its n-grams undercount the copied lines that
        training cut), a single example's n-gram share (a few template n-grams may cover many of its units)."""
        return max(self.fraction, self.copied_fraction) if self.joined else self.fraction

    @property
    def judged_share(self) -> str:
        """Which share ``judged_fraction`` is: ``tokens`` (the copied share of a joined row) or ``ngrams``."""
        return "tokens" if self.joined and self.copied_fraction > self.fraction else "ngrams"

    @property
    def longest(self) -> int:
        return max((end - start for start, end in self.spans), default=0)


def _any_between(ascending: list[int], lo: int, hi: int) -> bool:
    """Whether some value of ``ascending`` lies in ``[lo, hi]``."""
    i = bisect_left(ascending, lo)
    return i < len(ascending) and ascending[i] <= hi


def copied_spans(offsets: list[int] | np.ndarray, units: int, window: int, crossing: np.ndarray,
                 cuts: np.ndarray | None = None, long_span: int = 0,
                 row_starts: Iterable[int] = (), row_ends: Iterable[int] = ()) -> CopiedSpans:
    """Spans and counted fractions of a sequence of ``units`` whose matched window starts are ``offsets``.

    ``crossing`` (from :func:`crossing_windows` with ``cuts``) marks the windows across a boundary. When every window
    crosses one (no line holds ``window`` units), all windows count, as in a row without boundaries.

    Two runs that abut (a window that ended a training row, ``row_ends``, and one that started a training row
    where the first one's text ends, ``row_starts``) are one copy that a training block boundary cut: the ``window - 1`` windows across that cut were never seen, and those inside one line count as seen
    for the span (a window across a line break is never filled in: it would join two lines copied apart). A span
    goes on across a line break only when every window across the break was seen (lines copied together); otherwise
    the windows across it that matched are the template text lines start and end with, and the span stops there. A
    span runs from its first window inside one line to its last. ``long_span``: see :attr:`CopiedSpans.copied`.
    """
    out = CopiedSpans(window=window, units=units, long_span=long_span, row_starts=frozenset(row_starts),
                      row_ends=frozenset(row_ends))
    total = len(crossing)
    if not total:
        return out
    across = crossing if not crossing.all() else np.zeros(total, dtype=np.bool_)
    out.crossing = int(across.sum())
    out.windows = total - out.crossing
    cuts = np.asarray(cuts if cuts is not None and out.crossing else [], dtype=np.int64)
    counted = np.flatnonzero(~across) if len(cuts) else None
    if counted is not None and len(counted):  # lines holding a counted window: ids ascend with the windows
        out.segments = int(np.count_nonzero(np.diff(np.searchsorted(cuts, counted, side="right")))) + 1
    else:
        out.segments = 1 if out.windows else 0
    if not len(offsets):
        return out  # nothing matched (most rows): the counts are all a clean row needs
    starts = np.unique(np.asarray(offsets, dtype=np.int64))
    starts = starts[(starts >= 0) & (starts < total)]
    if not len(starts):
        return out
    if counted is None:
        counted = np.flatnonzero(~across)
    # windows of one length, ascending: each covers up to the next one's start, the last one whole
    out.coverable = int(np.minimum(np.diff(counted), window).sum()) + window if len(counted) else 0
    out.edges = {0, units, *cuts.tolist()}
    inside = ~across[starts]
    out.matched = int(inside.sum())
    out.crossing_matched = len(starts) - out.matched
    seen = np.zeros(total, dtype=np.bool_)
    seen[starts] = True
    matched = seen.copy()  # before the windows between abutting runs are filled in
    for last in sorted(out.row_ends):  # a training row ended here and the next started one window on: a block boundary
        first = last + window  # cut the copy there (whatever template windows other rows matched in between)
        if first in out.row_starts and 0 <= last and first < total:
            seen[last + 1 : first] |= ~across[last + 1 : first]
    for gap in cuts.tolist():
        lo, hi = max(0, gap - window + 1), min(total, gap)  # the windows across this break
        if lo < hi and not seen[lo:hi].all():
            seen[lo:hi] = False
    kept = np.flatnonzero(seen)
    if len(kept):
        pieces = np.split(kept, np.flatnonzero(np.diff(kept) != 1) + 1)
        for piece in pieces:
            inner = piece[~across[piece]]
            if matched[inner].any():  # a span holds a matched window inside a line, not fill between crossing ones
                out.spans.append((int(inner[0]), int(inner[-1]) + window))
    return out


def inner_bits(crossing: np.ndarray) -> int:
    """The counted windows as a bitset (bit i: window i lies inside one line), for a cheap first test on matched bits."""
    counted = ~crossing if len(crossing) and not crossing.all() else np.ones(len(crossing), dtype=np.bool_)
    return int.from_bytes(np.packbits(counted, bitorder="little").tobytes(), "little")
