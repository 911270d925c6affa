"""A robust baseline for noisy training curves: where a value sits against its recent history.

The level is the median of the most recent values, so it follows a healthy
run's falling loss; the spread is the MAD of step-to-step differences
(scaled to a standard deviation), which a slow trend barely moves while step
noise sets it. Used by spike detection and by the resume check's loss band.

:class:`Baseline` is the window spike detection keeps: it is robust from the
first steps. Every value is tested against what the window already holds
(median and MAD over what is there, from ``MIN_VALUES`` values on), and an
outlier is never admitted, so a spike in the warm-up cannot raise the bar for
the steps after it; findings are only made once the window holds
``min_history`` values. With ``trend`` the level is projected along the
window's robust (Theil-Sen) slope when the curve falls, so that the steep fall
of a warm-up does not leave the median lagging above the current loss, where
it would swallow a spike.
"""
from __future__ import annotations

import math
import operator
import statistics
from bisect import bisect_left, insort
from collections import deque
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

MAD_TO_SIGMA = 1.4826  # MAD of a normal distribution times this is its standard deviation
MIN_VALUES = 3  # values a window needs before it can test the next one at all (two step-to-step differences)
TREND_SDS = 3.0  # a falling window's level follows its line once the median lags it by this many robust SDs


@dataclass
class Judgement:
    """How one value compares with its baseline."""

    value: float
    median: float
    sd: float
    z: float
    size: int

    @property
    def rise(self) -> float:
        """The value's change relative to the level (0.25 is 25% above it); inf over a zero level."""
        if self.median == 0:
            return 0.0 if self.value == 0 else math.copysign(math.inf, self.value)
        return (self.value - self.median) / abs(self.median)

    def evidence(self, name: str) -> dict[str, float | int]:
        return {name: self.value, "median": self.median, "robust_sd": self.sd, "z": self.z, "window": self.size}


def theil_sen_slope(values: Sequence[float]) -> float:
    """Median of the pairwise slopes of equally spaced values (robust: a few outliers do not tilt it)."""
    slopes = [(values[j] - values[i]) / (j - i) for i in range(len(values)) for j in range(i + 1, len(values))]
    return statistics.median(slopes) if slopes else 0.0


def judge(value: float, window: Sequence[float], min_history: int, level_steps: int, trend: bool = False) -> Judgement | None:
    """Robust z-score of ``value`` against ``window``; None until the window has ``min_history`` values.

    The level is the median of the last ``level_steps`` values, so it follows
    a healthy run's falling loss; the spread is the MAD of step-to-step
    differences (scaled to a standard deviation), which a slow trend barely
    moves while step noise sets it. With ``trend``, a falling window's level
    is the Theil-Sen line through its last ``level_steps`` values at the next
    step when the plain median would lag it by ``TREND_SDS`` robust SDs (a
    flat, noisy window keeps its median: a noise slope must not pull the level
    down and the window with it), never below the lowest of them (a curve that flattens out would
    otherwise be overshot, and a level under every value the curve reached
    would reject all that follows); a rising slope is never projected, so a
    slow climb cannot lift its own bar.
    """
    if len(window) < max(min_history, 2):
        return None
    values = list(window)
    recent = values[-level_steps:]
    median = statistics.median(recent)
    diffs = [b - a for a, b in zip(values, values[1:])]
    centre = statistics.median(diffs)
    mad = statistics.median(abs(d - centre) for d in diffs)
    return _judged(value, recent, median, mad, trend, len(window))


def _judged(value: float, recent: list[float], median: float, mad: float, trend: bool, size: int,
            slope: float | None = None) -> Judgement:
    """The judgement from the window's level and MAD of differences: the spread, then the trend's level (see ``judge``);
    ``slope``: the Theil-Sen slope of ``recent`` when the caller keeps it."""
    sd = max(MAD_TO_SIGMA * mad / math.sqrt(2), 1e-3 * abs(median), 1e-12)
    if trend and len(recent) >= MIN_VALUES:
        slope = min(0.0, theil_sen_slope(recent) if slope is None else slope)
        if -slope * (len(recent) + 1) / 2 > TREND_SDS * sd:  # the median lags a real fall (not a noise slope): follow the line
            projected = statistics.median(v - slope * i for i, v in enumerate(recent)) + slope * len(recent)
            median = max(projected, min(recent))  # never below what the curve reached: a fall that stops cannot lock the level out
            sd = max(sd, 1e-3 * abs(median))
    return Judgement(value, median, sd, (value - median) / sd, size)


def _median_of_sorted(data: list[float]) -> float:
    """``statistics.median`` of a sorted list, with its arithmetic (the same float)."""
    n = len(data)
    return data[n // 2] if n % 2 else (data[n // 2 - 1] + data[n // 2]) / 2


def _median_abs_deviation(diffs: list[float], centre: float) -> float:
    """``statistics.median(abs(d - centre) for d in diffs)`` for sorted ``diffs`` without sorting the deviations: they
    grow outwards from ``centre`` on both sides, so the middle ones come from merging two sorted runs (half the list)."""
    n = len(diffs)
    right = bisect_left(diffs, centre)
    left = right - 1
    wanted = n // 2  # the deviations of rank wanted (and wanted - 1 when n is even) are the median's
    previous = current = 0.0
    for _ in range(wanted + 1):
        previous = current
        if left >= 0 and (right >= n or centre - diffs[left] <= diffs[right] - centre):
            current = centre - diffs[left]  # = abs(diffs[left] - centre) exactly: IEEE subtraction is sign-symmetric
            left -= 1
        else:
            current = diffs[right] - centre
            right += 1
    return current if n % 2 else (previous + current) / 2


class Baseline:
    """The last ``size`` normal values of a curve; outliers (as the caller defines them) are never admitted.

    While values are judged as they come, the sorted lists that :func:`judge`
    would build from the window are kept up to date instead: the
    step-to-step differences (for the spread) and, with ``trend``, the
    pairwise slopes of the recent values (for Theil-Sen). Each judgement is
    bit for bit the one :func:`judge` gives for the same window (the same
    subtractions and divisions of the same values). A window changed from
    outside (``values.extend`` of a restored state) is noticed and the lists
    rebuilt; a non-finite value makes the window judged the plain way until it
    has left. Most steps of a run need no judgement at all (``under_level``:
    a value clearly under the level); a value admitted without one leaves the
    lists to be rebuilt by the next judgement, which is cheaper than keeping
    them through every step that never reads them.
    """

    def __init__(self, size: int, min_history: int, level_steps: int, trend: bool = False, values: Iterable[float] = ()) -> None:
        self.values: deque[float] = deque(values, maxlen=size)
        self.min_history = min_history
        self.level_steps = level_steps
        self.trend = trend
        self._diffs: list[float] | None = None  # sorted differences of consecutive values; None: not kept (non-finite)
        self._slopes: list[float] = []  # sorted pairwise slopes of the last level_steps values (with trend)
        self._synced: tuple[int, float | None] = (-1, None)  # (len, last value) the lists describe
        self._admitted: tuple[float, float | None] | None = None  # (last value admitted, the value it pushed out)
        self._judged = False  # judge ran since the last admit: keep the lists up to date (the next value is likely judged too)

    def __len__(self) -> int:
        return len(self.values)

    @property
    def ready(self) -> bool:
        return len(self.values) >= self.min_history

    def judge(self, value: float) -> Judgement | None:
        """``value`` against what the window holds now (from MIN_VALUES values on, whether or not it is ready)."""
        values = self.values
        if len(values) < max(MIN_VALUES, 2):
            return None
        self._judged = True
        if not self._in_sync():
            self._rebuild()
        diffs = self._diffs
        if diffs is None:
            return judge(value, values, MIN_VALUES, self.level_steps, self.trend)
        recent = list(values)[-self.level_steps:]
        mad = _median_abs_deviation(diffs, _median_of_sorted(diffs))
        slope = _median_of_sorted(self._slopes) if self.trend and self._slopes else None
        return _judged(value, recent, _median_of_sorted(sorted(recent)), mad, self.trend, len(values), slope)

    def under_level(self, value: float, ratio: float) -> bool:
        """Whether ``value`` is at most ``ratio`` times any level a judgement of it could give, without judging it.

        The level is never below the lowest of the last ``level_steps`` values
        (their median, or the trend's line held up at that lowest value), so a
        value under ``ratio`` times that lowest one cannot reach ``ratio``
        times the level: a caller whose outlier needs that (a spike's minimum
        rise) skips the judgement of every clearly normal value, most steps of
        a run. False when unsure: fewer than MIN_VALUES values, or a recent one
        that is not positive and finite.
        """
        values = self.values
        if len(values) < MIN_VALUES:
            return False
        recent = list(values)[-self.level_steps:]
        lowest = min(recent)
        # the margin keeps the bound strict through the rounding of the caller's own comparison with the level
        return lowest > 0 and math.isfinite(sum(recent)) and value <= lowest * ratio * (1.0 - 1e-12)

    def judgement_of_admitted(self) -> Judgement | None:
        """What ``judge`` gave the value last admitted, against the window as it was then (None when the window has
        changed otherwise since): for a caller that skipped that judgement (``under_level``) and needs it after all."""
        admitted, values = self._admitted, self.values
        if admitted is None or not values or values[-1] is not admitted[0]:
            return None
        value, pushed_out = admitted
        window = list(values)[:-1]
        if pushed_out is not None:
            window.insert(0, pushed_out)
        return judge(value, window, MIN_VALUES, self.level_steps, self.trend)

    def _in_sync(self) -> bool:
        values, (length, last) = self.values, self._synced
        return length == len(values) and (not values or last is values[-1])

    def _rebuild(self) -> None:
        window = list(self.values)
        diffs = sorted(map(operator.sub, window[1:], window))
        recent = window[-self.level_steps:]
        slopes = sorted((recent[j] - recent[i]) / (j - i) for i in range(len(recent)) for j in range(i + 1, len(recent))) if self.trend else []
        finite = all(map(math.isfinite, window))
        self._diffs, self._slopes = (diffs, slopes) if finite else (None, [])
        self._synced = (len(window), window[-1] if window else None)

    def admit(self, value: float) -> None:
        values = self.values
        self._admitted = (value, values[0] if values and len(values) == values.maxlen else None)
        judged, self._judged = self._judged, False
        if not judged or self._diffs is None or not values or not self._in_sync() or not math.isfinite(value):
            # the lists are rebuilt at the next judge; a value admitted unjudged (under_level) leaves them, since their
            # upkeep costs more than a rebuild where most values are never judged
            values.append(value)
            self._synced = (-1, None)  # stale for certain: a full window keeps its length, a repeated value its identity
            return
        diffs, full = self._diffs, len(values) == values.maxlen
        if full and len(values) >= 2:
            del diffs[bisect_left(diffs, values[1] - values[0])]  # the oldest difference leaves with the oldest value
        if not (full and len(values) < 2):  # a window of one value keeps no difference
            insort(diffs, value - values[-1])
        if self.trend:
            self._shift_slopes(value)
        values.append(value)
        self._synced = (len(values), value)

    def _shift_slopes(self, value: float) -> None:
        """The recent values before ``value`` joins them: the oldest one's slopes leave when the recent window is full."""
        values, slopes, level = self.values, self._slopes, self.level_steps
        recent = list(values)[-level:]
        keeps = min(level, values.maxlen or level)  # how many recent values there are once the window is full
        if len(recent) >= keeps:  # the oldest recent value leaves (out of the last level_steps, or out of the window)
            oldest = recent[0]
            for k in range(1, len(recent)):
                del slopes[bisect_left(slopes, (recent[k] - oldest) / k)]
            recent = recent[1:]
        for i, earlier in enumerate(recent):
            insort(slopes, (value - earlier) / (len(recent) - i))

    def clear(self) -> None:
        self.values.clear()
        self._diffs, self._slopes, self._synced, self._admitted = [], [], (0, None), None

    def median(self) -> float | None:
        return statistics.median(self.values) if self.values else None
