"""A robust baseline for noisy training curves: where a value sits against its recent history.

The level is the median of the most recent values, so it follows a healthy
run's falling loss; the spread is the MAD of step-to-step differences
(scaled to a standard deviation), which a slow trend barely moves while step
noise sets it. Used by spike detection and by the resume check's loss band.
"""
from __future__ import annotations

import math
import statistics
from collections.abc import Sequence
from dataclasses import dataclass

MAD_TO_SIGMA = 1.4826  # MAD of a normal distribution times this is its standard deviation


@dataclass
class Judgement:
    """How one value compares with its baseline."""

    value: float
    median: float
    sd: float
    z: float
    size: int

    def evidence(self, name: str) -> dict[str, float | int]:
        return {name: self.value, "median": self.median, "robust_sd": self.sd, "z": self.z, "window": self.size}


def judge(value: float, window: Sequence[float], min_history: int, level_steps: int) -> Judgement | None:
    """Robust z-score of ``value`` against ``window``; None until the window has ``min_history`` values.

    The level is the median of the last ``level_steps`` values, so it follows
    a healthy run's falling loss; the spread is the MAD of step-to-step
    differences (scaled to a standard deviation), which a slow trend barely
    moves while step noise sets it.
    """
    if len(window) < min_history:
        return None
    values = list(window)
    median = statistics.median(values[-level_steps:])
    diffs = [b - a for a, b in zip(values, values[1:])]
    centre = statistics.median(diffs)
    mad = statistics.median(abs(d - centre) for d in diffs)
    sd = max(MAD_TO_SIGMA * mad / math.sqrt(2), 1e-3 * abs(median), 1e-12)
    return Judgement(value, median, sd, (value - median) / sd, len(window))
