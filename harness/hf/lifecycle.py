"""One ``train()`` call from the harness's side: the run lock, run.json, rank markers, run end, the report.

``on_run_end`` fires however the call ends (completed, stopped by an action,
crashed; run.json records a Ctrl-C as ``interrupted``), and then rank 0 writes the report and hands it to ``on_report``
(where trackers close). After a harness stop the call returns, or raises
``HarnessStopped`` under the core option ``on_stop: raise``. Rank 0 holds the run directory's lock while a
``train()`` call runs; a second process on the same directory is refused
at attach already, before ``config.yaml`` is written.
"""
from __future__ import annotations

import functools
import logging
import sys
import time
from pathlib import Path
from typing import Any, Callable

from harness.core.actions import Action
from harness.core.context import RunContext
from harness.core.distributed import close_process_group_at_exit
from harness.core.errors import HarnessStopped
from harness.hf.actions import ActionExecutor
from harness.hf.checkpoint_state import CheckpointState
from harness.hf.run_dir_recovery import recover_run_dir
from harness.lib import rundir
from harness.lib.rank_markers import ENDED, RUNNING, is_communication_error, marker_path, read_marker, short_error, write_marker
from harness.lib.stops import StopNotice
from harness.lib.runinfo import INTERRUPTED, end_attempt, run_facts, start_attempt, status_of
from harness.lib.wrapped_runs import write_run_marker

RANK_END_WAIT_S = 90.0  # rank 0 waits this long at most for the other ranks' run-end files
RANK_CRASH_WAIT_S = 3.0  # after a failed collective, rank 0 waits this long at most for the rank that failed first to say why

log = logging.getLogger("harness")


class RunLifecycle:
    """Wraps ``trainer.train`` so that every call is recorded, ends with ``on_run_end`` and leaves a report."""

    def __init__(self, ctx: RunContext, trainer: Any, checkpoint_state: CheckpointState, actions: ActionExecutor) -> None:
        self.ctx = ctx
        self.trainer = trainer
        self._checkpoint_state = checkpoint_state
        self._actions = actions
        self._lock_dir = ctx.run_dir if ctx.is_main else None  # rank 0 holds the run lock while a train() call runs
        self._in_train = False
        self._attempt: int | None = None  # this train() call's index in run.json's attempts
        self._report_time = 0.0
        self._failed_at: float | None = None  # when this call's exception reached the harness (the rank markers' end time)
        self.after_run_end: Callable[[], None] | None = None  # after the plugins' on_run_end: the trackers get the last findings
        self.attached_at = time.time()  # findings from here on are this job's (wrap's summary); set-up ones included

    def wrap_train(self, train: Callable[..., Any]) -> Callable[..., Any]:
        @functools.wraps(train)
        def harness_train(*args: Any, **kwargs: Any) -> Any:
            return self.run_train(train, args, kwargs)

        return harness_train

    def run_train(self, train: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        """Run one ``train()`` call: ``on_run_end`` always fires, with how the run ended."""
        if self._in_train:
            return train(*args, **kwargs)
        close_process_group_at_exit()  # a multi-rank job must not abort in gloo's teardown after it trained well
        if self._lock_dir is not None:
            rundir.acquire(self._lock_dir, id(self))  # held until this call ends
        self._actions.begin_call()
        self.ctx.pending_action = Action.CONTINUE
        try:
            args, kwargs, resumed = self._checkpoint_state.resume_dir(args, kwargs)  # True/"last": the last COMPLETE checkpoint
        except BaseException:
            self._release_lock()
            raise
        self._in_train = True
        self.ctx.resumed_from = resumed
        if self.ctx.is_main:  # before the Trainer's own set-up, which may fail (a checkpoint it cannot load): wrap's summary
            write_run_marker(self.ctx.run_dir, since=self.attached_at)  # then still names this run directory; ``begin`` writes it again (idempotent)
        self._attempt = None
        self._failed_at = None
        self._mark_attempt(RUNNING)
        self._note_rank_findings()
        status, error = "completed", None
        try:
            result = train(*args, **kwargs)
        except BaseException as exc:
            status, error = "crashed", exc
            self._failed_at = time.time()
            raise
        finally:
            self._in_train = False
            if status == "completed" and self._actions.stopped:
                status = "stopped"
            self.ctx.status = status
            try:
                recover_run_dir(self.ctx)  # deleted mid-run: made again before the plugins' run ends write there
                self.ctx.manager.hooks.on_run_end(self.ctx, status, error)
                self.ctx.note_write_outages(final=True)  # what the plugins' run ends held, written where it can be, and said
                self._finish_run(status, error)
            finally:  # also after a KeyboardInterrupt while the report is written
                self._release_lock()
            if status == "crashed":
                how = "was interrupted (Ctrl-C / SIGINT)" if recorded_status(status, error) == INTERRUPTED else "crashed"
                log.error("harness: training %s; findings are in %s", how, self.ctx.run_dir / "findings.jsonl")
        notice = self._actions.notice
        if status == "stopped" and notice is not None and notice.ends_training:
            self._after_stop(notice)
        return result

    def _note_rank_findings(self) -> None:
        if self.ctx.is_main and self.ctx.world_size > 1:
            try:
                self.ctx.note_rank_findings()
            except Exception:  # noqa: BLE001 - at worst an earlier call's leftovers are announced at this call's end
                log.warning("harness: could not read the other ranks' findings files", exc_info=True)

    def _collect_rank_ends(self, status: str, error: BaseException | None = None) -> None:
        """Rank 0, after its ``on_run_end``: wait (bounded) for the other ranks' run ends, then merge their findings.

        Other ranks write their run-end files (contamination summaries, spilled
        findings) in their own ``on_run_end``, after the last step exchange:
        rank 0 waits a bounded time for their end markers (no collective:
        after a crash a rank may be gone, so it does not wait then), then
        copies the findings no exchange carried into ``findings.jsonl``
        (``RunContext.merge_rank_findings``), before the trackers take the
        last findings and the report is written.
        """
        ctx = self.ctx
        if not ctx.is_main or ctx.world_size <= 1:
            return
        try:
            if status != "crashed":
                self._wait_for_ranks(RANK_END_WAIT_S)
            elif is_communication_error(short_error(error)):  # another rank is gone: give it a moment to say why it failed
                self._wait_for_ranks(RANK_CRASH_WAIT_S, quiet=True)
            ctx.merge_rank_findings()
        except Exception:  # noqa: BLE001 - the spill files stay, and every report reads them
            log.warning("harness: could not merge the other ranks' findings into %s", ctx.run_dir / "findings.jsonl", exc_info=True)

    def _after_run_end(self) -> None:
        if self.after_run_end is not None:
            try:
                self.after_run_end()
            except Exception:  # noqa: BLE001 - the report and the run's record come first
                log.warning("harness: the trackers could not take the last findings", exc_info=True)

    def _after_stop(self, notice: StopNotice) -> None:
        """The Trainer returned from a harness stop: say so once more (rank 0), and raise if ``on_stop: raise``."""
        raising = self.ctx.options.on_stop == "raise"
        if self.ctx.is_main:
            then = "raising harness.HarnessStopped (on_stop: raise)" if raising else "train() returns as if it had finished (on_stop: return)"
            sys.stderr.write(f"harness: training was STOPPED by the harness at {notice.where}{notice.because}; {then}. "
                             f"See `harness explain {notice.output_dir}`.\n")
            sys.stderr.flush()
        if raising:
            self._actions.mark_raised()
            raise HarnessStopped(notice.step, notice.output_dir, notice.codes, notice.attempt, notice.action)

    def begin(self) -> None:
        """At train begin: record the attempt in run.json (rank 0), then ``on_run_start`` and ``inspect_dataset``."""
        ctx, trainer, hooks = self.ctx, self.trainer, self.ctx.manager.hooks
        if ctx.is_main:
            write_run_marker(ctx.run_dir, since=self.attached_at)  # `harness wrap`'s closing summary reads it (nothing outside wrap)
            try:  # the run card's facts: nice to have, never worth a crash
                resumed = str(ctx.resumed_from) if ctx.resumed_from is not None else None
                facts = run_facts(trainer, ctx.world_size, ctx.stage)
                facts["plugins"] = list(ctx.manager.names)  # the plugins that ran, in order (a user's --only, checkable)
                facts["plugin_classes"] = {name: class_path(ctx.manager.plugin(name)) for name in ctx.manager.names}
                self._attempt = start_attempt(ctx.run_dir, facts, resumed, int(trainer.state.global_step))
                self._actions.attempt = self._attempt + 1  # the report numbers attempts from 1
            except Exception:  # noqa: BLE001
                log.exception("harness: could not record the run in %s", ctx.run_dir / "run.json")
        hooks.on_run_start(ctx, trainer)
        if trainer.train_dataset is not None:
            hooks.inspect_dataset(ctx, trainer.train_dataset, "train")
        if getattr(trainer, "eval_dataset", None) is not None:
            hooks.inspect_dataset(ctx, trainer.eval_dataset, "eval")

    # -- the end of a call ---------------------------------------------------------------------------

    def _release_lock(self) -> None:
        if self._lock_dir is not None:
            rundir.release(self._lock_dir, id(self))

    def _finish_run(self, status: str, error: BaseException | None) -> None:
        """Record how this train() call ended, write the report (rank 0), hand it to ``on_report``.

        Rank 0 first collects the other ranks' run ends (``_collect_rank_ends``),
        then hands the trackers the last findings (``after_run_end``).
        """
        ctx = self.ctx
        self._mark_attempt(ENDED, recorded_status(status, error), error)
        if not ctx.is_main:
            return
        files = None
        known = len(ctx.findings)
        try:
            self._collect_rank_ends(status, error)
            self._after_run_end()
            known = len(ctx.findings)  # what comes after this came while the trackers closed
            self._record_end(recorded_status(status, error), int(self.trainer.state.global_step), error)
            if ctx.options.report:
                files = self._write_report()
        except Exception:  # noqa: BLE001 - the report must never turn a finished run into a crash
            log.exception("harness: the report could not be written; rebuild it with `harness report %s`", ctx.run_dir.parent)
        finally:
            ctx.manager.hooks.on_report(ctx, files)  # trackers close here, report or not
        if files is not None and any(f.time >= self._report_time for f in ctx.findings[known:]):
            try:  # a tracker reported while closing (TRACKING_DEGRADED): the local report must show it
                self._write_report()
            except Exception:  # noqa: BLE001
                log.exception("harness: the report could not be rewritten with the last findings")

    def _record_end(self, status: str, end_step: int, error: BaseException | None) -> None:
        """How this call ended: in the run lock first (it needs no new space), then in run.json. run.json that cannot be
        replaced (a full disk, a read-only remount) is said on the console, and the readers take the end from the lock
        instead of calling the run killed."""
        ctx = self.ctx
        in_lock = rundir.record_end(self._lock_dir or ctx.run_dir, status, end_step)
        try:
            end_attempt(ctx.run_dir, status, end_step, error, self._attempt, ranks=self._rank_ends())
        except OSError as exc:
            kept = f"; the end is kept in {rundir.lock_path(ctx.run_dir)}, which report and explain read" if in_lock else ""
            log.error("harness: run.json could not be updated at the end (%s: %s): training %s at step %d%s.",
                      type(exc).__name__, exc.strerror or exc, status, end_step, kept)

    def _write_report(self) -> Any:
        from harness.report import write_report

        ctx = self.ctx
        files = write_report(ctx.run_dir, ctx.manager, ctx.config, plots=ctx.options.report_plots)
        self._report_time = time.time()
        log.info("harness: report written to %s (%s)", files.html, files.report.verdict.line())
        return files

    def _mark_attempt(self, state: str, status: str | None = None, error: BaseException | None = None) -> None:
        """This rank's attempt marker (``ranks/attempt.rank-<r>``, :mod:`harness.lib.rank_markers`): ``running`` at
        start, ``ended`` after on_run_end, with this rank's status, exception and failure time when it did not complete."""
        if self.ctx.world_size <= 1:
            return
        try:
            step = int(self.trainer.state.global_step) if state == ENDED and self.trainer is not None else None
        except Exception:  # noqa: BLE001 - the step is nice to have
            step = None
        try:
            write_marker(self.ctx.run_dir, self.ctx.rank, state, status=status, error=error,
                         ended=self._failed_at or time.time(), step=step)
        except OSError:
            pass

    def _rank_ends(self) -> list[dict[str, Any]] | None:
        """Rank 0, at the end of a call: how every rank ended, from the markers (for run.json); None with one process."""
        if self.ctx.world_size <= 1:
            return None
        ends = []
        for rank in range(self.ctx.world_size):
            end = read_marker(marker_path(self.ctx.run_dir, rank), rank)
            if end is not None and end.state == ENDED and end.status is not None:
                ends.append(end.as_dict())
        return ends

    def _wait_for_ranks(self, timeout: float, quiet: bool = False) -> None:
        """Until every rank whose marker rank 0 can see (a shared run directory) has ended, at most ``timeout`` s."""
        ranks = range(1, self.ctx.world_size)
        deadline = time.monotonic() + timeout
        pending: list[int] = []
        while time.monotonic() < deadline:
            # a marker that is missing, a link or unreadable (None) is nothing to wait for: only one that says running
            pending = [r for r in ranks if (end := read_marker(marker_path(self.ctx.run_dir, r), r)) is not None and end.state != ENDED]
            if not pending:
                return
            time.sleep(0.1)
        if quiet:
            return
        log.warning("harness: ranks %s did not finish within %.0f s; the report may miss their last files", pending, timeout)


def recorded_status(status: str, error: BaseException | None) -> str:
    """How run.json records a train() call that ended with ``status`` (:func:`harness.lib.runinfo.status_of`); the
    plugins' ``on_run_end`` still gets ``crashed`` for a Ctrl-C (the hook's documented statuses: a plugin's crash
    handling, a short wait or a FAILED tracker run, fits an interrupt too)."""
    return status_of(status, error)


def refuse_if_locked(run_dir: Path) -> None:
    """Rank 0 at attach, before anything is written: ``RunDirLockedError`` if another process runs in ``run_dir``.

    The lock is held only while ``train()`` runs (see :meth:`RunLifecycle.run_train`).
    """
    holder = id(run_dir)
    rundir.acquire(run_dir, holder)
    rundir.release(run_dir, holder)


def class_path(plugin: Any) -> str:
    """``module:Class`` of a plugin, so that ``harness report`` can rebuild plugins that were given as objects."""
    return f"{type(plugin).__module__}:{type(plugin).__qualname__}"
