"""The hang watchdog's timing model and thread: how long each phase of a rank's run may last, and who notices when it does not end.

The training thread calls :meth:`HangClock.beat` at each point of progress
(a micro-batch arrived, a step ended, an evaluation or a save ended). A beat
is one clock read, one subtraction, one comparison and one tuple stored in an
attribute: no lock (a reference store is atomic under the GIL), no
allocation beyond the tuple, no I/O. The interval that a beat closes is
learned under the phase it belonged to, named by what ended it:

- ``compute``: a micro-batch's forward and backward, the step guard, the
  optimizer (closed by the next micro-batch or the step's end);
- ``data``: after a step, logging and waiting for the next step's batches
  (closed by the next micro-batch);
- ``eval`` / ``save``: an evaluation or a checkpoint save (closed by its end);
- ``start``: from the run start to the first batch (never learned: once per run).

A daemon thread (:class:`WatchThread`) wakes every ``poll_s`` and asks
:meth:`HangClock.check` whether the open interval has lasted longer than its
phase's threshold: ``max(factor x the longest seen, floor_s)``, or
``max(warmup_s, floor_s)`` for a phase never seen before (the first step, the
first evaluation, the first save carry one-time costs: compilation, worker
start-up, cold storage). The first interval of a phase is left out of its
longest once a second one exists, for the same reason. A stall fires once per
beat (re-armed by the next beat), and an interval that fired is not learned as
normal. An interval seen as an evaluation or a save stays one until the next
beat (the Trainer clears its flag before the harness's own hooks for it have
run). Independent of collectives: nothing here talks to another rank.
"""
from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass
from typing import Callable

log = logging.getLogger("harness.watchdog")

HANG_EXIT_CODE = 76  # what `hang_action: abort` exits with: one above a harness stop's 75 (EX_TEMPFAIL), apart from 1 (a crash) and 2 (usage)
START, DATA, COMPUTE, EVAL, SAVE = "start", "data", "compute", "eval", "save"
PHASES = (START, DATA, COMPUTE, EVAL, SAVE)
PHASE_WORDS = {
    START: "starting up (from the run start to the first batch)",
    DATA: "between steps (logging, then waiting for the next step's batches from the data loader)",
    COMPUTE: "inside a training step (forward, backward, the step guard, the optimizer)",
    EVAL: "in an evaluation",
    SAVE: "saving a checkpoint",
}
# what a beat means, for the words of the last progress
BATCH, STEP_END, EVAL_END, SAVE_END, RUN_START = "batch", "step_end", "eval_end", "save_end", "run_start"

Beat = tuple[float, str, int, int]  # (monotonic time, what happened, step, micro-batch)


class PhaseTimes:
    """The longest interval seen per phase (the first one apart), and the threshold each phase gets from it."""

    def __init__(self, factor: float, floor_s: float, warmup_s: float) -> None:
        self.factor, self.floor_s, self.warmup_s = factor, floor_s, warmup_s
        self.count = dict.fromkeys(PHASES, 0)
        self.first = dict.fromkeys(PHASES, 0.0)
        self.longest = dict.fromkeys(PHASES, 0.0)  # over the intervals after the first

    def observe(self, phase: str, seconds: float) -> None:
        """One interval of ``phase`` ended after ``seconds`` (training thread; plain dict stores, no lock)."""
        n = self.count[phase]
        if n == 0:
            self.first[phase] = seconds
        elif seconds > self.longest[phase]:
            self.longest[phase] = seconds
        self.count[phase] = n + 1

    def typical(self, phase: str) -> float | None:
        """The longest normal interval of ``phase``: the first one only while it is the only one; None before any."""
        n = self.count[phase]
        if n == 0 or phase == START:
            return None
        return self.first[phase] if n == 1 else self.longest[phase]

    def threshold(self, phase: str) -> tuple[float, str]:
        """Seconds without progress that count as a hang in ``phase``, and how that number came about (in words)."""
        seen = self.typical(phase)
        if seen is None:
            return max(self.warmup_s, self.floor_s), f"max(warmup_s {self.warmup_s:g} s, floor_s {self.floor_s:g} s): no {phase} phase seen yet"
        learned = self.factor * seen
        if learned >= self.floor_s:
            return learned, f"factor {self.factor:g} x the longest {phase} phase seen ({seen:.3g} s)"
        return self.floor_s, f"floor_s {self.floor_s:g} s (above factor {self.factor:g} x the longest {phase} phase seen, {seen:.3g} s)"

    def snapshot(self) -> dict[str, float | None]:
        return {phase: self.typical(phase) for phase in PHASES if phase != START}


@dataclass(frozen=True)
class Stall:
    """The open interval outlasted its threshold: what the rank was doing and for how long."""

    beat: Beat
    phase: str
    stalled_s: float
    threshold_s: float
    basis: str
    since_unix: float  # wall clock of the last progress

    @property
    def step(self) -> int:
        """The step in flight: the beat's step once a micro-batch arrived or during the evaluation/save after it, else the next."""
        _, kind, step, _ = self.beat
        return step if kind == BATCH or self.phase in (EVAL, SAVE) else step + 1

    def last_progress(self) -> str:
        _, kind, step, micro = self.beat
        return {
            BATCH: f"micro-batch {micro} of step {step} arrived",
            STEP_END: f"step {step} ended",
            EVAL_END: f"the evaluation after step {step} ended",
            SAVE_END: f"the checkpoint save after step {step} ended",
            RUN_START: f"the run started (after step {step})",
        }.get(kind, kind)

    def progress(self) -> list[int]:
        """(steps ended, micro-batches of the next step arrived): the smaller, the earlier a rank stopped."""
        _, kind, step, micro = self.beat
        return [step - 1, micro + 1] if kind == BATCH else [step, 0]


class HangClock:
    """Beats from the training thread; stall checks from the watchdog thread. No lock on either side."""

    def __init__(self, times: PhaseTimes, open_phase: Callable[[Beat], str] | None = None, now: Callable[[], float] = time.monotonic) -> None:
        self.times = times
        self._now = now
        self._open_phase = open_phase or default_open_phase
        self._beat: Beat = (now(), RUN_START, 0, 0)
        self._fired: Beat | None = None
        self._phase_of: tuple[Beat | None, str] = (None, START)  # the open interval's phase as the watchdog last saw it

    def start(self, step: int) -> None:
        self._beat = (self._now(), RUN_START, step, 0)
        self._fired = None

    def beat(self, kind: str, step: int, micro: int = 0) -> None:
        """Progress (training thread): learn the interval that just closed, then start the next one."""
        now = self._now()
        last = self._beat
        if last is not self._fired:
            self.times.observe(_CLOSED[last[1], kind], now - last[0])
        self._beat = (now, kind, step, micro)

    def check(self) -> Stall | None:
        """The stall of the open interval, once per beat (watchdog thread); None while within its threshold."""
        beat = self._beat
        if beat is self._fired:
            return None
        now = self._now()
        phase = self._open_phase(beat)
        seen_beat, seen = self._phase_of
        if seen_beat is beat and seen in (EVAL, SAVE) and phase == DATA:
            phase = seen  # sticky: the Trainer clears its flag before the harness's own save/evaluate hooks have run
        self._phase_of = (beat, phase)
        threshold, basis = self.times.threshold(phase)
        stalled = now - beat[0]
        if stalled <= threshold:
            return None
        self._fired = beat
        return Stall(beat, phase, stalled, threshold, basis, time.time() - stalled)

    def progressed_since(self, stall: Stall) -> bool:
        return self._beat is not stall.beat


def closed_phase(opened_by: str, closed_by: str) -> str:
    """The phase of an interval from the beat that opened it and the one that closed it."""
    if closed_by == EVAL_END:
        return EVAL
    if closed_by == SAVE_END:
        return SAVE
    if opened_by == RUN_START:
        return START
    if opened_by == BATCH:
        return COMPUTE
    return DATA  # a step, an evaluation or a save ended; a batch (or the step's end, with no batch) closed it


_KINDS = (BATCH, STEP_END, EVAL_END, SAVE_END, RUN_START)
_CLOSED = {(opened, closed): closed_phase(opened, closed) for opened in _KINDS for closed in _KINDS}  # one lookup per beat


def default_open_phase(beat: Beat) -> str:
    """The phase of the open interval when nothing tells more (no trainer control flags)."""
    kind = beat[1]
    return START if kind == RUN_START else COMPUTE if kind == BATCH else DATA


class WatchThread:
    """A daemon thread that checks the clock every ``poll_s`` and hands each stall to ``on_stall`` (never raising)."""

    def __init__(self, clock: HangClock, on_stall: Callable[[Stall], None], poll_s: float, name: str = "harness-watchdog") -> None:
        self.clock = clock
        self._on_stall = on_stall
        self.poll_s = poll_s
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self, timeout: float = 5.0) -> None:
        self._stop.set()
        if self._thread.is_alive() and self._thread is not threading.current_thread():
            self._thread.join(timeout)

    @property
    def alive(self) -> bool:
        return self._thread.is_alive()

    @property
    def ident(self) -> int | None:
        return self._thread.ident

    def _run(self) -> None:
        while not self._stop.wait(self.poll_s):
            try:
                stall = self.clock.check()
                if stall is not None:
                    self._on_stall(stall)
            except Exception:  # noqa: BLE001 - the watchdog must never take the process down by itself
                log.exception("harness watchdog: the check failed (the watchdog goes on)")

    def wait_stopped_or(self, seconds: float) -> bool:
        """Sleep up to ``seconds``; True when the watchdog was stopped meanwhile."""
        return self._stop.wait(seconds)


def poll_interval(floor_s: float, poll_s: float | None) -> float:
    """How often the thread looks: ``poll_s``, or a twentieth of the floor, between 0.05 s and 5 s."""
    if poll_s is not None:
        return poll_s
    return min(5.0, max(0.05, floor_s / 20))


__all__ = ["HANG_EXIT_CODE", "HangClock", "PhaseTimes", "Stall", "WatchThread", "closed_phase", "poll_interval"]
