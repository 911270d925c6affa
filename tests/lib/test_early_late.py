"""EarlyLateMedians: the medians of a growing series' first and last third, exactly as statistics.median of the slices."""
from __future__ import annotations

import random
import statistics

import pytest

from harness.lib.early_late import EarlyLateMedians, third_of


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_every_prefix_has_the_medians_of_its_slices(seed: int) -> None:
    rng = random.Random(seed)
    values = [rng.choice([round(rng.gauss(0, 1), 1), -1.5, 0.0, 2.0]) for _ in range(400)]  # many ties: removal must pick one
    medians = EarlyLateMedians()
    for count, value in enumerate(values, start=1):
        medians.add(value)
        third = third_of(count)
        assert len(medians) == count
        assert medians.early() == statistics.median(values[:count][:third])
        assert medians.late() == statistics.median(values[:count][-third:])


def test_the_sorted_thirds_hold_a_third_each_not_the_whole_series() -> None:
    medians = EarlyLateMedians()
    for i in range(3000):
        medians.add(float(i % 17))
    assert len(medians._early) == len(medians._late) == third_of(3000) == 1000


def test_empty_and_nan_are_refused() -> None:
    medians = EarlyLateMedians()
    with pytest.raises(ValueError, match="empty"):
        medians.early()
    with pytest.raises(ValueError, match="NaN"):
        medians.add(float("nan"))
