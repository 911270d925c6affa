"""Carrying out an agreed action on the Trainer, and the ``ACTION_TAKEN`` finding that says so.

``TrainerControl`` can save and stop but not skip: the skip itself happens in
the optimizer adapters (:mod:`harness.hf.optimizers`); here the step's
agreed action becomes ``should_save``/``should_training_stop``. A rollback
needs someone who can restart training from an older checkpoint (a stage
runner): that is a :class:`RollbackHandler` handed to ``attach(...,
rollback=handler)``. Without one a rollback saves and stops instead.

A stop is loud (:mod:`harness.lib.stops`): at the step it happens rank 0
prints a banner on stderr naming the causes, the step, the attempt and
``harness explain``, and every rank leaves a marker for ``harness wrap``.
"""
from __future__ import annotations

from dataclasses import replace
from typing import Any, Protocol, runtime_checkable

from harness.core.actions import Action
from harness.core.codes import ACTION_TAKEN
from harness.core.console import write_stderr
from harness.core.context import RunContext
from harness.core.findings import Finding
from harness.lib.stops import STOPPING_ACTIONS, StopNotice, banner, write_marker

STOP_CODES = ("PLUGIN_STOP",)  # undecided codes (action continue) that stop training all the same


@runtime_checkable
class RollbackHandler(Protocol):
    """Told when every rank agreed to roll back; restarts training after ``train()`` returns (stages/runner.py)."""

    def request(self, step: int, cause: Finding | None) -> None: ...


class ActionExecutor:
    """Applies agreed actions to ``TrainerControl``; knows whether this ``train()`` call was stopped by one."""

    def __init__(self, ctx: RunContext, rollback: RollbackHandler | None = None) -> None:
        self.ctx = ctx
        self.rollback = rollback
        self.stopped = False  # an action ended the current train() call (reset by the lifecycle per call)
        self.notice: StopNotice | None = None  # how it was stopped, once it was
        self.attempt: int | None = None  # this train() call's number in the report (rank 0; set by the lifecycle)
        self._since = 0  # ctx.findings before this call: causes are looked for after it

    def begin_call(self) -> None:
        """A new ``train()`` call: nothing stopped yet."""
        self.stopped, self.notice, self.attempt = False, None, None
        self._since = len(self.ctx.findings)

    def apply(self, action: Action, control: Any, cause: Finding | None = None) -> None:
        """Make the agreed ``action`` the Trainer's control flags; ``cause``: the finding behind a stop asked for directly."""
        if action is Action.ROLLBACK and self.rollback is not None:
            control.should_training_stop = True  # the runner resumes from the last good checkpoint
            causes = [f for f in self.ctx.findings if f.action == Action.ROLLBACK.value]
            self._stopped(Action.ROLLBACK)
            self.rollback.request(self.ctx.step, causes[-1] if causes else None)
            return
        if action in (Action.SAVE_AND_STOP, Action.ROLLBACK):
            control.should_save = True
            control.should_training_stop = True
            self._stopped(Action.SAVE_AND_STOP, cause)
        elif action is Action.STOP:
            control.should_training_stop = True
            self._stopped(Action.STOP, cause)

    def _stopped(self, action: Action, cause: Finding | None = None) -> None:
        """The first stop of this call: the banner (rank 0) and the marker for ``harness wrap`` (every rank)."""
        self.stopped = True
        if self.notice is not None:
            return
        causes = self.causes(self.ctx.step) or ([cause] if cause is not None else [])
        self.notice = notice = StopNotice(
            step=self.ctx.step, action=action.value, output_dir=str(self.ctx.run_dir.parent),
            codes=tuple(f.code for f in causes), messages=tuple(f.message for f in causes),
            attempt=self.attempt, rank=self.ctx.rank,
        )
        if self.ctx.is_main:
            write_stderr(banner(notice).rstrip("\n"))  # through tqdm's write: never on the progress bar's line
        if notice.ends_training:
            write_marker(notice)

    def mark_raised(self) -> StopNotice | None:
        """``HarnessStopped`` is about to leave ``train()``: say so in the marker (wrap's exit status depends on it)."""
        if self.notice is not None:
            self.notice = replace(self.notice, raised=True)
            write_marker(self.notice)
        return self.notice

    def causes(self, step: int) -> list[Finding]:
        """The findings of this call that asked to stop, one per code, the one that decided at ``step`` last."""
        stopping = [f for f in self._candidates(Action.STOP) if f.action in STOPPING_ACTIONS or f.code in STOP_CODES]
        decider = self._decider(stopping, step)
        by_code: dict[str, Finding] = {}
        for finding in stopping:
            by_code.setdefault(finding.code, finding)
        ordered = [f for f in by_code.values() if decider is None or f.code != decider.code]
        return ordered + ([by_code[decider.code]] if decider is not None else [])

    def _candidates(self, action: Action) -> list[Finding]:
        """This call's findings that can have caused ``action``: for a stop, those that asked to stop (a skip asked
        earlier did not stop training); for a skip, any that asked for more than ``continue``."""
        found = [f for f in self.ctx.findings[self._since:] if f.code != "ACTION_TAKEN"]
        if action.stops_training:
            stopping = [f for f in found if f.action in STOPPING_ACTIONS or f.code in STOP_CODES]
            if stopping:
                return stopping
        return [f for f in found if f.action not in (None, "continue")]

    @staticmethod
    def _decider(causes: list[Finding], step: int) -> Finding | None:
        recent = [f for f in causes if f.step is not None and f.step >= step - 1]
        return recent[-1] if recent else (causes[-1] if causes else None)

    def late_stop(self, step: int) -> Action | None:
        """One process: a stop asked after the guard (in ``on_step_end``) still stops at this step.

        Returns the action to apply instead of the agreed one, or None. With
        several processes the next guard agrees it, so every rank stops alike.
        """
        ctx = self.ctx
        if ctx.world_size != 1 or not ctx.pending_action.stops_training:
            return None
        action, ctx.pending_action = ctx.pending_action, Action.CONTINUE
        self.record(action, step)
        return action

    def record(self, action: Action, step: int, updated: bool = False, cause: Finding | None = None) -> None:
        """The ``ACTION_TAKEN`` finding: what the harness did at ``step`` and the finding that caused it.

        ``updated``: the stop came after the step's update (``ctx.stop_after_update``), which was applied.
        """
        ctx = self.ctx
        cause = cause or self._decider(self._candidates(action), step)
        because = f" after {cause.code} from plugin '{cause.plugin}' on rank {cause.rank}" if cause else ""
        what = {
            Action.SKIP_STEP: "skipped the optimizer update",
            Action.SAVE_AND_STOP: "applied the update, saved a checkpoint and stopped" if updated
            else "skipped the optimizer update, saved a checkpoint and stopped",
            Action.STOP: "stopped training",
            Action.ROLLBACK: "skipped the update and stopped to roll back to the last good checkpoint"
            if self.rollback is not None
            else "skipped the update and stopped (rollback needs a stage runner; saved a checkpoint)",
        }[action]
        ctx.report(
            ACTION_TAKEN.code,
            f"harness {what} at step {step}{because}.",
            step=step,
            evidence={"action": action.value, "cause": cause.id if cause else None, "update_applied": updated},
            plugin="harness",
        )
