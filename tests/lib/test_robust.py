"""The robust judge (harness.lib.robust): the level is a recent median, the spread the MAD of step-to-step differences."""
from __future__ import annotations

import math
import random
from collections import deque

import pytest

from harness.lib.robust import MAD_TO_SIGMA, Baseline, judge, theil_sen_slope

ALTERNATING = [0.0, 1.0] * 5 + [0.0]  # 11 values: diffs are five +1 and five -1, so the MAD is exactly 1
ALTERNATING_SD = MAD_TO_SIGMA / math.sqrt(2)


def test_no_judgement_until_the_window_holds_min_history() -> None:
    assert judge(5.0, [1.0] * 9, min_history=10, level_steps=5) is None
    assert judge(5.0, [1.0] * 10, min_history=10, level_steps=5) is not None


def test_spread_is_the_scaled_mad_of_step_differences() -> None:
    j = judge(5.0, ALTERNATING, min_history=5, level_steps=len(ALTERNATING))
    assert j is not None
    assert j.median == 0.0  # six zeros, five ones
    assert j.sd == pytest.approx(ALTERNATING_SD, rel=1e-12)
    assert j.z == pytest.approx(5.0 / ALTERNATING_SD, rel=1e-12)
    assert (j.value, j.size) == (5.0, 11)


def test_the_level_is_the_median_of_the_last_level_steps_only() -> None:
    window = [10.0] * 10 + [2.0, 2.0, 2.0]
    j = judge(2.0, window, min_history=5, level_steps=3)
    assert j is not None and j.median == 2.0 and j.z == 0.0


def test_a_steady_trend_does_not_widen_the_spread() -> None:
    """A falling loss has constant differences: MAD 0, so the spread is the floor of 1e-3 of the level."""
    window = [10.0 - 0.1 * i for i in range(20)]
    j = judge(window[-1], window, min_history=10, level_steps=5)
    assert j is not None
    assert j.median == pytest.approx(8.3)  # median of the last five: 8.5 .. 8.1
    assert j.sd == pytest.approx(1e-3 * 8.3)


def test_a_constant_zero_window_has_a_tiny_positive_spread() -> None:
    j = judge(1e-9, [0.0] * 10, min_history=10, level_steps=10)
    assert j is not None and j.sd == 1e-12 and j.z == pytest.approx(1000.0)


def test_one_outlier_in_the_window_barely_moves_level_and_spread() -> None:
    clean = judge(0.0, ALTERNATING, min_history=5, level_steps=11)
    dirty_window = list(ALTERNATING)
    dirty_window[3] = 1e6  # one of the ones
    dirty = judge(0.0, dirty_window, min_history=5, level_steps=11)
    assert clean is not None and dirty is not None
    assert dirty.median == clean.median == 0.0
    assert dirty.sd <= 2 * clean.sd  # a mean/std baseline would move by orders of magnitude


def test_accepts_a_deque_and_names_its_evidence() -> None:
    j = judge(3.0, deque(ALTERNATING, maxlen=50), min_history=5, level_steps=11)
    assert j is not None
    assert j.evidence("loss") == {"loss": 3.0, "median": 0.0, "robust_sd": j.sd, "z": j.z, "window": 11}


def test_with_trend_a_falling_window_s_level_is_its_line_at_the_next_step() -> None:
    falling = [6.0 - 0.2 * i + (0.01 if i % 2 else -0.01) for i in range(10)]  # 6.0 .. 4.2, a steep warm-up
    plain = judge(4.0, falling, min_history=3, level_steps=10)
    followed = judge(4.0, falling, min_history=3, level_steps=10, trend=True)
    assert plain is not None and followed is not None
    assert plain.median == pytest.approx(5.1, abs=0.02)  # the median lags the curve by half the window
    assert followed.median == pytest.approx(min(falling), abs=0.02)  # the line's 4.0 is floored at the lowest value reached
    assert followed.z == pytest.approx((4.0 - followed.median) / followed.sd)
    assert followed.sd == plain.sd  # the spread is the same step-to-step noise either way


def test_with_trend_a_noisy_flat_or_rising_window_keeps_its_median() -> None:
    flat = [3.0, 3.2, 2.9, 3.1, 2.8, 3.0, 2.9, 2.8, 3.1, 2.7]  # a chance downward drift inside the noise
    assert judge(3.0, flat, 3, 10, trend=True).median == judge(3.0, flat, 3, 10).median  # type: ignore[union-attr]
    rising = [3.0 + 0.1 * i for i in range(10)]
    assert judge(5.0, rising, 3, 10, trend=True).median == pytest.approx(3.45)  # type: ignore[union-attr]


def test_theil_sen_slope_ignores_an_outlier() -> None:
    values = [10.0 - i for i in range(9)]
    values[4] = 100.0
    assert theil_sen_slope(values) == pytest.approx(-1.0)
    assert theil_sen_slope([1.0]) == 0.0


def test_a_baseline_tests_from_three_values_and_is_ready_at_min_history() -> None:
    base = Baseline(size=5, min_history=4, level_steps=3)
    base.admit(1.0), base.admit(1.1)
    assert base.judge(9.0) is None and not base.ready
    base.admit(0.9)
    j = base.judge(9.0)
    assert j is not None and j.z > 6 and j.rise == pytest.approx(8.0) and not base.ready
    base.admit(1.0)
    assert base.ready and len(base) == 4 and base.median() == 1.0
    for _ in range(5):
        base.admit(2.0)
    assert list(base.values) == [2.0] * 5  # the window keeps the last ``size`` values


@pytest.mark.parametrize("size,level,trend", [(50, 10, True), (50, 10, False), (5, 3, True), (3, 10, True), (20, 20, True), (2, 1, True), (1, 1, False)])
def test_the_baselines_kept_differences_judge_exactly_as_the_window(size: int, level: int, trend: bool) -> None:
    """Baseline.judge keeps the window's differences sorted as values come and go; every judgement must be the one
    :func:`judge` gives for the same window, bit for bit, through admits, clears and a state restored from outside."""
    rng = random.Random(size * 100 + level)
    base = Baseline(size, 3, level, trend=trend)
    for i in range(3000):
        value = rng.choice([rng.gauss(3.0 - 0.001 * i, 0.2), 2.5, float(rng.randint(0, 3)), 0.0, -0.0])
        if rng.random() < 0.3:  # admitted unjudged (a caller's under_level): the kept lists go stale, the next judge rebuilds
            base.admit(value)
            continue
        got, want = base.judge(value), judge(value, base.values, 3, level, trend)
        assert (got is None) == (want is None)
        if got is not None and want is not None:
            assert repr((got.median, got.sd, got.z, got.size)) == repr((want.median, want.sd, want.z, want.size))  # nan alike
        roll = rng.random()
        if roll < 0.01:
            base.clear()
        elif roll < 0.02:
            base.values.extend([rng.random(), rng.random()])  # a restored state: the kept differences are rebuilt
        elif roll < 0.025:
            base.admit(math.nan)  # not finite: judged from the window itself until it leaves
        else:
            base.admit(value)


@pytest.mark.parametrize("trend", [True, False])
def test_a_value_under_the_level_bound_is_never_an_outlier_and_its_judgement_comes_back_after_admission(trend: bool) -> None:
    """``under_level`` lets spike detection skip judging most steps: it must never pass a value that the judgement would
    call a rise of ``ratio`` times the level, and ``judgement_of_admitted`` must give, bit for bit, the judgement skipped."""
    rng = random.Random(7 if trend else 8)
    base = Baseline(50, 10, 10, trend=trend)
    passed = rejected = 0
    for i in range(4000):
        level = 3.0 * math.exp(-i / 400) + 0.5 if trend else 2.0
        value = rng.choice([rng.gauss(level, 0.05 * level), level * rng.uniform(1.0, 1.3), rng.uniform(-0.5, 4.0), level])
        ratio = rng.choice([1.1, 1.25, 2.0])
        want = base.judge(value)
        if base.under_level(value, ratio):
            passed += 1
            assert want is not None and value <= ratio * want.median  # no rise of ratio x the level, whatever the spread
            assert value - want.median <= (ratio - 1.0) * abs(want.median)  # the loss rule's own arithmetic agrees
            base.admit(value)
            got = base.judgement_of_admitted()
            assert got is not None and repr(got) == repr(want)
        else:
            rejected += 1
            if rng.random() < 0.9:
                base.admit(value)
            if rng.random() < 0.01:
                base.clear()
    assert passed > 1000 and rejected > 300  # both sides of the bound were exercised


def test_the_level_bound_refuses_what_it_cannot_bound_and_the_admitted_judgement_is_forgotten_on_change() -> None:
    base = Baseline(20, 3, 5)
    for value in (1.0, 1.0):
        base.admit(value)
    assert not base.under_level(0.5, 2.0)  # fewer than MIN_VALUES values: no bound
    base.admit(1.0)
    assert base.under_level(1.9, 2.0) and not base.under_level(2.0, 2.0)  # strict margin at the bound itself
    base.admit(0.0)
    assert not base.under_level(0.0, 2.0)  # a non-positive recent value: no bound
    base.admit(math.inf)
    assert not base.under_level(1.0, 2.0)  # a non-finite recent value: no bound
    base.admit(1.5)
    assert base.judgement_of_admitted() is not None
    base.values.extend([1.0])  # changed from outside (a restored state): the admitted value's judgement is gone
    assert base.judgement_of_admitted() is None
    base.admit(1.2)
    base.clear()
    assert base.judgement_of_admitted() is None
