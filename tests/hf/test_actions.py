"""Agreed actions on a real ``TrainerControl``, rollback through an injected handler, ACTION_TAKEN. No Trainer run."""
from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from transformers import TrainerControl

from harness.core.actions import Action
from harness.hf.actions import ActionExecutor, RollbackHandler
from unit_context import run_context


class Handler:
    def __init__(self) -> None:
        self.requests: list[tuple[int, Any]] = []

    def request(self, step: int, cause: Any) -> None:
        self.requests.append((step, cause))


@pytest.mark.parametrize(
    ("action", "save", "stop"),
    [(Action.CONTINUE, False, False), (Action.SKIP_STEP, False, False), (Action.SAVE_AND_STOP, True, True),
     (Action.STOP, False, True), (Action.ROLLBACK, True, True)],
)
def test_actions_without_a_rollback_handler(tmp_path: Path, action: Action, save: bool, stop: bool) -> None:
    ctx, _ = run_context(tmp_path / "harness")
    executor, control = ActionExecutor(ctx), TrainerControl()
    executor.apply(action, control)
    assert (control.should_save, control.should_training_stop, executor.stopped) == (save, stop, stop)


def test_a_rollback_goes_to_the_injected_handler_with_its_cause(tmp_path: Path) -> None:
    ctx, _ = run_context(tmp_path / "harness", {"PROBE_FAULT": "rollback"})
    handler = Handler()
    assert isinstance(handler, RollbackHandler)
    ctx.step = 5
    cause = ctx.report("PROBE_FAULT", "bad batch", plugin="probe")
    executor, control = ActionExecutor(ctx, handler), TrainerControl()
    executor.apply(Action.ROLLBACK, control)
    assert handler.requests == [(5, cause)]
    assert control.should_training_stop and not control.should_save and executor.stopped  # the runner resumes instead


@pytest.mark.parametrize("with_handler", [False, True])
def test_action_taken_names_the_cause_and_what_was_done(tmp_path: Path, with_handler: bool) -> None:
    ctx, _ = run_context(tmp_path / "harness", {"PROBE_FAULT": "rollback"})
    ctx.step = 3
    cause = ctx.report("PROBE_FAULT", "bad batch", plugin="probe")
    ActionExecutor(ctx, Handler() if with_handler else None).record(Action.ROLLBACK, 3)
    taken = ctx.findings[-1]
    assert taken.code == "ACTION_TAKEN" and taken.step == 3 and taken.evidence == {"action": "rollback", "cause": cause.id}
    assert "after PROBE_FAULT from plugin 'probe' on rank 0" in taken.message
    assert ("roll back to the last good checkpoint" in taken.message) is with_handler
    assert ("rollback needs a stage runner" in taken.message) is not with_handler


def test_a_stop_asked_in_step_end_stops_one_process_at_once(tmp_path: Path) -> None:
    ctx, _ = run_context(tmp_path / "harness")
    executor = ActionExecutor(ctx)
    assert executor.late_stop(2) is None  # nothing pending
    ctx.pending_action = Action.SKIP_STEP
    assert executor.late_stop(2) is None  # a skip cannot apply after the update
    ctx.pending_action = Action.STOP
    assert executor.late_stop(2) is Action.STOP and ctx.pending_action is Action.CONTINUE
    assert ctx.findings[-1].code == "ACTION_TAKEN" and ctx.findings[-1].step == 2


def test_with_several_processes_a_late_stop_waits_for_the_next_agreement(tmp_path: Path) -> None:
    ctx, _ = run_context(tmp_path / "harness", world_size=2)
    ctx.pending_action = Action.STOP
    assert ActionExecutor(ctx).late_stop(2) is None and ctx.pending_action is Action.STOP
