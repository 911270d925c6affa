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
import statistics
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
    sd = max(MAD_TO_SIGMA * mad / math.sqrt(2), 1e-3 * abs(median), 1e-12)
    if trend and len(recent) >= MIN_VALUES:
        slope = min(0.0, theil_sen_slope(recent))
        if -slope * (len(recent) + 1) / 2 > TREND_SDS * sd:  # the median lags a real fall (not a noise slope): follow the line
            projected = statistics.median(v - slope * i for i, v in enumerate(recent)) + slope * len(recent)
            median = max(projected, min(recent))  # never below what the curve reached: a fall that stops cannot lock the level out
            sd = max(sd, 1e-3 * abs(median))
    return Judgement(value, median, sd, (value - median) / sd, len(window))


class Baseline:
    """The last ``size`` normal values of a curve; outliers (as the caller defines them) are never admitted."""

    def __init__(self, size: int, min_history: int, level_steps: int, trend: bool = False, values: Iterable[float] = ()) -> None:
        self.values: deque[float] = deque(values, maxlen=size)
        self.min_history = min_history
        self.level_steps = level_steps
        self.trend = trend

    def __len__(self) -> int:
        return len(self.values)

    @property
    def ready(self) -> bool:
        return len(self.values) >= self.min_history

    def judge(self, value: float) -> Judgement | None:
        """``value`` against what the window holds now (from MIN_VALUES values on, whether or not it is ready)."""
        return judge(value, self.values, MIN_VALUES, self.level_steps, self.trend)

    def admit(self, value: float) -> None:
        self.values.append(value)

    def clear(self) -> None:
        self.values.clear()

    def median(self) -> float | None:
        return statistics.median(self.values) if self.values else None
