"""The watchdog's timing model on a fake clock: thresholds learned per phase, long first phases allowed, once per hang."""
from __future__ import annotations

import threading
import time

import pytest

from harness.lib.hang_watch import (BATCH, COMPUTE, DATA, EVAL, EVAL_END, SAVE, SAVE_END, START, STEP_END, HangClock, PhaseTimes,
                                    WatchThread, closed_phase, poll_interval)


class FakeClock:
    def __init__(self) -> None:
        self.t = 1000.0

    def __call__(self) -> float:
        return self.t


def _clock(factor: float = 3.0, floor: float = 1.5, warmup: float = 60.0, open_phase=None) -> tuple[HangClock, FakeClock]:
    now = FakeClock()
    clock = HangClock(PhaseTimes(factor, floor, warmup), open_phase=open_phase, now=now)
    clock.start(0)
    return clock, now


def _steps(clock: HangClock, now: FakeClock, n: int, compute: float = 0.2, data: float = 0.05, first: int = 1) -> None:
    for step in range(first, first + n):
        now.t += data
        clock.beat(BATCH, step, 0)
        now.t += compute
        clock.beat(STEP_END, step)


def test_the_phase_of_an_interval_is_named_by_its_ends() -> None:
    assert closed_phase("run_start", BATCH) == START
    assert closed_phase(BATCH, BATCH) == COMPUTE and closed_phase(BATCH, STEP_END) == COMPUTE
    assert closed_phase(STEP_END, BATCH) == DATA and closed_phase(SAVE_END, BATCH) == DATA
    assert closed_phase(STEP_END, EVAL_END) == EVAL and closed_phase(EVAL_END, SAVE_END) == SAVE


def test_thresholds_are_learned_per_phase_with_the_first_left_out_and_the_floor_below() -> None:
    clock, now = _clock(factor=3.0, floor=1.5)
    now.t += 20.0  # the start (model load, first batch): never learned
    clock.beat(BATCH, 1, 0)
    now.t += 9.0  # the first step: compilation and warm-up
    clock.beat(STEP_END, 1)
    times = clock.times
    assert times.threshold(COMPUTE)[0] == pytest.approx(27.0)  # only the first seen yet: it counts
    assert times.threshold(DATA) == (60.0, "max(warmup_s 60 s, floor_s 1.5 s): no data phase seen yet")
    _steps(clock, now, 5, compute=0.8, first=2)
    threshold, basis = times.threshold(COMPUTE)
    assert threshold == pytest.approx(2.4) and "factor 3 x the longest compute phase seen (0.8 s)" in basis  # the 9 s warm-up left out
    assert times.threshold(DATA) == (1.5, "floor_s 1.5 s (above factor 3 x the longest data phase seen, 0.05 s)")
    assert times.threshold(START)[0] == 60.0 and times.threshold(EVAL)[0] == 60.0 and times.threshold(SAVE)[0] == 60.0
    assert set(times.snapshot()) == {DATA, COMPUTE, EVAL, SAVE}


def test_a_stall_fires_once_per_beat_and_rearms_when_progress_resumes() -> None:
    clock, now = _clock()
    _steps(clock, now, 4)
    now.t += 1.4
    assert clock.check() is None  # within the floor
    now.t += 0.2
    stall = clock.check()
    assert stall is not None and stall.phase == DATA and stall.step == 5 and stall.stalled_s == pytest.approx(1.6)
    assert stall.threshold_s == 1.5 and stall.last_progress() == "step 4 ended" and stall.progress() == [4, 0]
    assert abs(stall.since_unix - (time.time() - 1.6)) < 1.0
    now.t += 10
    assert clock.check() is None  # once per hang
    clock.beat(BATCH, 5, 0)  # it recovered: the stalled interval is not learned as a normal data phase
    assert clock.times.threshold(DATA)[0] == 1.5 and clock.progressed_since(stall)
    now.t += 2.0
    again = clock.check()
    assert again is not None and again.phase == COMPUTE and again.step == 5 and again.progress() == [4, 1]
    assert again.last_progress() == "micro-batch 0 of step 5 arrived"


def test_an_evaluation_and_a_save_are_timed_apart_from_the_wait_for_data() -> None:
    flags = {"eval": False, "save": False}

    def open_phase(beat):
        if beat[1] == BATCH:
            return COMPUTE
        if beat[1] == STEP_END and flags["eval"]:
            return EVAL
        if beat[1] in (STEP_END, EVAL_END) and flags["save"]:
            return SAVE
        return DATA

    clock, now = _clock(open_phase=open_phase)
    _steps(clock, now, 3)
    flags.update(eval=True, save=True)
    now.t += 30.0  # the first evaluation: far beyond the data phase's 1.5 s, within warmup_s
    assert clock.check() is None
    clock.beat(EVAL_END, 3)
    flags["eval"] = False
    now.t += 40.0  # the first save
    assert clock.check() is None
    clock.beat(SAVE_END, 3)
    flags["save"] = False
    assert clock.times.threshold(EVAL)[0] == pytest.approx(90.0) and clock.times.threshold(SAVE)[0] == pytest.approx(120.0)
    assert clock.times.threshold(DATA)[0] == 1.5  # the evaluation and the save did not count as a wait for data
    now.t += 1.0
    clock.beat(BATCH, 4, 0)
    flags.update(save=True)
    clock.beat(STEP_END, 4)
    now.t += 121.0  # a save three times slower than the first
    stall = clock.check()
    assert stall is not None and stall.phase == SAVE and stall.step == 4


def test_the_poll_interval_follows_the_floor() -> None:
    assert poll_interval(120.0, None) == 5.0 and poll_interval(1.5, None) == 0.075 and poll_interval(0.1, None) == 0.05
    assert poll_interval(120.0, 0.5) == 0.5


def test_the_thread_hands_over_a_stall_and_survives_a_failing_handler() -> None:
    clock, now = _clock(floor=1.0)
    _steps(clock, now, 2)
    seen: list[object] = []
    done = threading.Event()

    def on_stall(stall: object) -> None:
        seen.append(stall)
        done.set()
        raise RuntimeError("a broken handler must not end the watchdog")

    watch = WatchThread(clock, on_stall, poll_s=0.005)
    watch.start()
    now.t += 5.0
    assert done.wait(2.0) and len(seen) == 1
    watch.stop()
    assert not watch.alive


def test_a_beat_costs_microseconds() -> None:
    clock = HangClock(PhaseTimes(5.0, 120.0, 900.0))
    beat = clock.beat
    started = time.perf_counter()
    for step in range(20_000):
        beat(BATCH, step, 0)
        beat(STEP_END, step)
    per_step = (time.perf_counter() - started) / 20_000
    assert per_step < 20e-6, f"{per_step * 1e6:.2f} us per step"


def test_a_save_stays_a_save_after_the_trainer_clears_its_flag() -> None:
    flags = {"save": True}

    def open_phase(beat):
        return COMPUTE if beat[1] == BATCH else SAVE if flags["save"] else DATA

    clock, now = _clock(open_phase=open_phase)
    _steps(clock, now, 3)
    now.t += 20.0  # the Trainer's save
    assert clock.check() is None
    flags["save"] = False  # cleared before the harness's own checkpoint hooks run: still the save's interval
    now.t += 1.0
    assert clock.check() is None
    clock.beat(SAVE_END, 3)
    now.t += 1.6
    stall = clock.check()
    assert stall is not None and stall.phase == DATA  # a new interval: the wait for data again
