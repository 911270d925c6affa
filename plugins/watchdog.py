"""watchdog: a rank that stops making progress becomes RANK_HANG, with every thread's stack and the place it waits, named.

A daemon thread per rank (:mod:`harness.lib.hang_watch`), independent of
collectives, learns from the run how long each phase lasts (a step's compute,
the wait for data between steps, an evaluation, a checkpoint save) and fires
when the open phase has lasted longer than ``max(factor x the longest seen,
floor_s)`` (``warmup_s`` for a phase never seen yet). Evaluation and save are
told from the wait for data by the Trainer's own control flags
(``should_evaluate``, ``should_save``), read by the watchdog thread. Then it
dumps every thread's Python stack to ``hangs/rank-<r>-step-<N>.txt`` and
writes ``RANK_HANG`` (critical) to this rank's findings file at once, from
the watchdog thread (:mod:`harness.lib.offthread_findings`), naming where
the training thread waits (:mod:`harness.lib.hang_frames`). Once per hang:
the next progress re-arms it. ``hang_action: abort`` then ends the process
with exit code 76 (``HANG_EXIT_CODE``; 75 is a harness stop) through ``os._exit``, so a scheduler
or an elastic launcher restarts the job; a rank that waits in a collective
first gives the rank it waits for one more threshold to dump its own stacks.

Cost on the training thread: one beat per micro-batch and per step end (a
clock read, a subtraction, a comparison, a tuple stored; no lock, no I/O).
"""
from __future__ import annotations

import faulthandler
import logging
import math
import os
import sys
import threading
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from harness.core.findings import FindingCode, Severity
from harness.core.hookspecs import hookimpl
from harness.core.plugin import Plugin
from harness.lib.hang_frames import Where, name_frames, thread_frames, write_stacks
from harness.lib.hang_summary import (PEER_WAIT_S, brief_where, hang_summary, stack_display, stall_order, stalled_first,
                                     wait_for_peer_hangs)
from harness.lib.hang_watch import (BATCH, COMPUTE, DATA, EVAL, EVAL_END, HANG_EXIT_CODE, PHASE_WORDS, RUN_START, SAVE, SAVE_END,
                                    START, STEP_END, Beat, HangClock, PhaseTimes, Stall, WatchThread, poll_interval)
from harness.lib.offthread_findings import record_offthread
from harness.lib.safe_paths import safe_target

log = logging.getLogger("harness.watchdog")

RANK_HANG = FindingCode(
    "RANK_HANG", Severity.CRITICAL,
    "A rank made no progress for longer than the watchdog's threshold; every thread's stack was dumped and the place it waits named.",
    "hangs#rank_hang",
)


def stall_in_ms(stalled_s: float, threshold_s: float) -> tuple[float, float]:
    """Both to the millisecond, outwards (the stall up, the threshold down): the evidence keeps the stall over its
    threshold, as it was (rounding both to the nearest ms made a 2.0004 s stall over 2 s read 2.0 over 2.0)."""
    return math.ceil(stalled_s * 1000 - 1e-9) / 1000, math.floor(threshold_s * 1000 + 1e-9) / 1000  # 1.001 s * 1000 is 1000.9999...


class WatchdogOptions(BaseModel):
    """Options of the ``watchdog`` plugin."""

    model_config = ConfigDict(extra="forbid")

    factor: float = Field(5.0, ge=1.0, description="A phase (a step's compute, the wait for data, an evaluation, a save) counts as hung "
                          "after this many times the longest one of its kind seen in this run (the first of each kind left out once "
                          "a second exists), but never before floor_s.")
    floor_s: float = Field(120.0, gt=0, description="The shortest stall that fires, in seconds, whatever the learned times say.")
    warmup_s: float = Field(900.0, gt=0, description="The allowance for a phase never seen yet in this run (the start up to the first "
                            "batch, the first step, the first evaluation, the first save: compilation, worker start-up, cold storage).")
    hang_action: Literal["report", "abort"] = Field(
        "report", description="report: write RANK_HANG and the stacks, and let the job run (it may recover); abort: then end the process "
        f"with exit code {HANG_EXIT_CODE} (os._exit) so that a scheduler or an elastic launcher restarts the job.")
    poll_s: float | None = Field(None, gt=0, description="How often the watchdog thread looks, in seconds (default: floor_s / 20, "
                                 "between 0.05 and 5).")


def _no_beat(kind: str, step: int, micro: int = 0) -> None:
    """Before the run starts and after it ended: nothing to watch."""


class Watchdog(Plugin):
    """Finds a rank that stopped making progress (RANK_HANG), dumps every thread's stack and names where it waits."""

    name = "watchdog"
    Options = WatchdogOptions
    CODES = (RANK_HANG,)
    options: WatchdogOptions

    def __init__(self) -> None:
        self.options = WatchdogOptions()
        self._beat = _no_beat
        self._clock: HangClock | None = None
        self._thread: WatchThread | None = None
        self._trainer: Any = None
        self._training_ident: int | None = None
        self.fired: list[Stall] = []

    # -- the training thread: beats only -------------------------------------------------------

    @hookimpl
    def on_run_start(self, ctx: Any, trainer: Any) -> None:
        self._stop()
        o = self.options
        self._trainer = trainer
        self._training_ident = threading.get_ident()
        self._clock = HangClock(PhaseTimes(o.factor, o.floor_s, o.warmup_s), open_phase=self._open_phase)
        self._clock.start(int(getattr(getattr(trainer, "state", None), "global_step", 0) or 0))
        self._thread = WatchThread(self._clock, self._fire, poll_interval(o.floor_s, o.poll_s), name=f"harness-watchdog-rank-{ctx.rank}")
        self._thread.start()
        self._beat = self._clock.beat

    @hookimpl
    def inspect_batch(self, step: int, micro_step: int) -> None:
        self._beat(BATCH, step, micro_step)

    @hookimpl
    def on_step_end(self, step: int) -> None:
        self._beat(STEP_END, step)

    @hookimpl
    def on_evaluate(self, step: int) -> None:
        self._beat(EVAL_END, step)

    @hookimpl
    def on_checkpoint_save(self, step: int) -> None:
        self._beat(SAVE_END, step)

    @hookimpl(tryfirst=True)  # before the other plugins' run-end waits (the last checks of checkpoints and batches)
    def on_run_end(self) -> None:
        self._stop()

    def _stop(self) -> None:
        self._beat = _no_beat
        if self._thread is not None:
            self._thread.stop()
            self._thread = None

    # -- the watchdog thread --------------------------------------------------------------------

    def _open_phase(self, beat: Beat) -> str:
        """The open interval's phase; after a step, the Trainer's flags say whether an evaluation or a save runs now."""
        kind = beat[1]
        if kind == BATCH:
            return COMPUTE
        if kind == RUN_START:
            return START
        control = getattr(self._trainer, "control", None)
        if kind == STEP_END and getattr(control, "should_evaluate", False):
            return EVAL
        if kind in (STEP_END, EVAL_END) and getattr(control, "should_save", False):
            return SAVE
        return DATA

    def _fire(self, stall: Stall) -> None:
        ctx, o = self.ctx, self.options
        manager = getattr(ctx, "manager", None)
        if manager is not None and manager.is_disabled(self.name):  # switched off: its beats stopped, so the stall is not the run's
            self._beat = _no_beat
            if self._thread is not None:
                self._thread.stop(timeout=0)
            return
        self.fired.append(stall)
        aborting = o.hang_action == "abort"
        where: Where | None = None
        try:
            where = name_frames(thread_frames(self._training_ident), ctx.world_size)
            self._record(ctx, o, stall, where, aborting)
        except Exception as exc:  # noqa: BLE001 - a full disk or a bad hangs/ folder must not cost the abort
            sys.stderr.write(f"harness watchdog: rank {ctx.rank} made no progress at step {stall.step}, but its RANK_HANG could "
                             f"not be written ({exc!r}); the stacks follow.\n")
            try:
                faulthandler.dump_traceback(file=sys.stderr, all_threads=True)
            except Exception:  # noqa: BLE001 - stderr closed: nothing more to say
                pass
        finally:
            if aborting:
                self._abort(stall, where or Where("somewhere (the stacks could not be read)", "other", []))

    def _record(self, ctx: Any, o: Any, stall: Stall, where: Where, aborting: bool) -> None:
        """The stack file and the RANK_HANG finding, written from the watchdog thread."""
        step = stall.step
        stack_file = self._stack_path(ctx, step)
        header = (f"RANK_HANG: rank {ctx.rank} (pid {os.getpid()}) made no progress for {stall.stalled_s:.1f} s at step {step}, "
                  f"{PHASE_WORDS[stall.phase]}; threshold {stall.threshold_s:.3g} s = {stall.basis}.\n"
                  f"Last progress: {stall.last_progress()}.\nThe training thread is {where.words}.\n"
                  f"Innermost frames (innermost first): {'; '.join(where.innermost)}")
        how = write_stacks(stack_file, header, self._training_ident, threading.get_ident())
        shown_stack = stack_display(str(stack_file)) or str(stack_file)
        stalled_ms, threshold_ms = stall_in_ms(stall.stalled_s, stall.threshold_s)
        evidence = {
            "step": step, "rank": ctx.rank, "seconds_stalled": stalled_ms, "threshold_s": threshold_ms,
            "threshold_basis": stall.basis, "phase": stall.phase, "last_progress": stall.last_progress(), "progress": stall.progress(),
            "stalled_since_unix": stall.since_unix, "where": where.words, "where_kind": where.kind, "innermost_frames": where.innermost,
            "stack_file": str(stack_file), "stack_dump": how, "threads": threading.active_count(),
            "longest_seen_s": self._clock.times.snapshot() if self._clock else {}, "factor": o.factor, "floor_s": o.floor_s,
            "warmup_s": o.warmup_s, "hang_action": o.hang_action, "pid": os.getpid(),
        }
        cross = self._cross_rank(ctx, stall, where, evidence)
        doing = f"{PHASE_WORDS[stall.phase]}; last progress: {stall.last_progress()}"
        details = (f"over its threshold of {stall.threshold_s:.3g} s ({stall.basis}): the training thread is {where.words}; "
                   f"innermost frames: {', '.join(where.innermost[:3]) or 'none'}; every thread's stack in the run "
                   f"directory's {shown_stack}")
        head = f"rank {ctx.rank} made no progress for {stall.stalled_s:.1f} s at step {step}"
        # the rank that stalled first goes in front: rank 0's console line shows the first 200 characters or so
        message = f"{head}: {cross}. Rank {ctx.rank} was {doing}, {details}" if cross else f"{head} ({doing}), {details}"
        if aborting:
            message += f"; the process exits with code {HANG_EXIT_CODE} (hang_action: abort)"
            evidence["exit_code"] = HANG_EXIT_CODE
        record_offthread(ctx, RANK_HANG, message, step=step, evidence=evidence, plugin=self.name,
                         action="stop" if aborting else "continue")
        # rank 0's console has just printed the finding's line; a log record at error would print it a second time on
        # stderr (Python's last-resort handler, when the script configures no logging). Other ranks have no console line
        shown = getattr(getattr(ctx, "console", None), "enabled", False)
        log.log(logging.INFO if shown else logging.ERROR, "harness watchdog: %s", message)

    def _cross_rank(self, ctx: Any, stall: Stall, where: Where, evidence: dict[str, Any]) -> str | None:
        """With several ranks: the rank that stalled first and where, from the other ranks' spill files (watchdog thread).

        A rank waiting in a collective waits for another rank; that rank's watchdog fires at about the same time and
        writes its own RANK_HANG to ``ranks/findings.rank-<r>.jsonl``. This reads those files (read-only, a bounded
        wait of ``PEER_WAIT_S`` for them to appear, never a collective: the other rank is hung) and says which rank
        stalled first, where, and its stack file; sets ``evidence.stalled_first``. None when this rank stalled first
        (or alone) and does not wait in a collective.
        """
        if int(getattr(ctx, "world_size", 1) or 1) <= 1:
            return None
        waiting = where.kind == "collective"
        thread = self._thread
        try:
            peers = wait_for_peer_hangs(Path(ctx.run_dir), ctx.rank, stall.since_unix, ctx.world_size,
                                        wait_s=PEER_WAIT_S if waiting else 0.0,
                                        sleep=thread.wait_stopped_or if thread is not None else None)
            first = stalled_first(ctx.rank, stall.step, evidence, peers)
        except Exception:  # noqa: BLE001 - the other ranks' files are a bonus: this rank's own finding comes first
            log.debug("harness watchdog: the other ranks' findings could not be read", exc_info=True)
            peers, first = [], None
        brief = brief_where(where.words)
        if first is None:
            if not waiting:
                return None
            evidence["stalled_first"] = None
            return (f"rank {ctx.rank} is waiting in a collective ({brief}): the rank that stalled is probably another one, "
                    f"whose RANK_HANG is not written yet (the report and `harness explain` name it once it is)")
        own = f"rank {ctx.rank} is waiting {brief}" if waiting else f"rank {ctx.rank} is {brief}"
        e = first.evidence if isinstance(first.evidence, dict) else {}
        stack = stack_display(e.get("stack_file"))
        evidence["stalled_first"] = {"rank": first.rank, "step": first.step, "where": e.get("where"), "stack_file": stack,
                                     "finding": first.id}
        text = f"{own}; rank {first.rank} stalled first, at step {first.step} {e.get('where', 'at an unknown place')}"
        return text + (f"; its stacks in the run directory's {stack}" if stack else "")

    def _stack_path(self, ctx: Any, step: int) -> Path:
        base = f"rank-{ctx.rank}-step-{step}"
        path = ctx.path("hangs", f"{base}.txt")
        n = 1
        while path.exists():  # the same step stalled again after it recovered: keep the first dump
            n += 1
            path = ctx.path("hangs", f"{base}-{n}.txt")
        return safe_target(Path(ctx.run_dir), path)

    def _abort(self, stall: Stall, where: Where) -> None:
        """End the process with HANG_EXIT_CODE; a rank waiting in a collective first gives the rank it waits for time to dump."""
        thread, clock = self._thread, self._clock
        if where.kind == "collective" and self.ctx.world_size > 1 and thread is not None and clock is not None:
            waited = 0.0
            while waited < stall.threshold_s:
                if thread.wait_stopped_or(thread.poll_s) or clock.progressed_since(stall):
                    log.warning("harness watchdog: rank %s moved on: no abort", self.ctx.rank)
                    return
                waited += thread.poll_s
        sys.stderr.write(f"harness watchdog: rank {self.ctx.rank} hung at step {stall.step} ({where.words}); "
                         f"exiting with code {HANG_EXIT_CODE} (hang_action: abort). See the RANK_HANG finding.\n")
        sys.stderr.flush()
        try:
            sys.stdout.flush()
        finally:
            os._exit(HANG_EXIT_CODE)

    # -- the report ---------------------------------------------------------------------------------

    @hookimpl
    def report_sections(self, run: Any) -> Any:
        """Which rank stalled first and where, then every RANK_HANG with its stack file; None without hangs."""
        from harness.report.model import ReportSection, md_table
        from harness.lib.textsafe import md_escape

        ordered = stall_order(run.findings)
        if not ordered:
            return None
        rows = []
        for f in ordered:
            e = f.evidence if isinstance(f.evidence, dict) else {}
            rows.append([str(f.rank), str(f.step), str(e.get("where", "?")), str(e.get("last_progress", "?")),
                         f"{e.get('seconds_stalled', '?')} / {e.get('threshold_s', '?')}", _relative(run, e.get("stack_file"))])
        text = f"**{md_escape(hang_summary(ordered, run) or '')}**\n\n"
        text += md_table(["rank", "step", "where the training thread waits", "last progress", "stalled / threshold (s)", "stacks"], rows)
        return ReportSection("Hangs", text + "\n")


def _relative(run: Any, value: Any) -> str:
    """A stack file relative to the run directory being read (never the original path of a copied run)."""
    return stack_display(value, run) or "-"


__all__ = ["HANG_EXIT_CODE", "RANK_HANG", "Watchdog", "WatchdogOptions"]
