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
    assert taken.code == "ACTION_TAKEN" and taken.step == 3 and taken.evidence == {"action": "rollback", "cause": cause.id, "update_applied": False}
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


# -- a stop is loud: the banner on rank 0, the marker for harness wrap ----------------------------------------------


def test_a_stop_prints_the_banner_once_and_leaves_a_marker(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    from harness.lib.stops import STOP_DIR_ENV, read_markers

    wrap_dir = tmp_path / "wrap"
    wrap_dir.mkdir()
    monkeypatch.setenv(STOP_DIR_ENV, str(wrap_dir))
    ctx, _ = run_context(tmp_path / "out" / "harness", {"PROBE_FAULT": "stop"})
    executor = ActionExecutor(ctx)
    executor.begin_call()
    executor.attempt = 2
    ctx.step = 7
    ctx.report("PROBE_FAULT", "the probe saw a bad batch", plugin="probe")
    executor.apply(Action.STOP, TrainerControl())
    executor.apply(Action.STOP, TrainerControl())  # a second stop in the same call says nothing more
    err = capsys.readouterr().err
    assert err.count("HARNESS STOPPED TRAINING") == 1
    assert "at step 7 (attempt 2) after PROBE_FAULT" in err and f"harness explain {tmp_path / 'out'}" in err
    (notice,) = read_markers(wrap_dir)
    assert (notice.step, notice.codes, notice.attempt, notice.action, notice.raised) == (7, ("PROBE_FAULT",), 2, "stop", False)
    assert executor.mark_raised() is not None and read_markers(wrap_dir)[0].raised


def test_stop_causes_are_this_calls_with_the_decider_last(tmp_path: Path) -> None:
    ctx, _ = run_context(tmp_path / "harness", {"PROBE_FAULT": "stop"})
    executor = ActionExecutor(ctx)
    ctx.step = 2
    ctx.report("PROBE_FAULT", "from an earlier train() call", plugin="probe")
    executor.begin_call()
    assert executor.causes(3) == []  # the earlier call's finding is not this call's cause
    ctx.step = 5
    first = ctx.report("PROBE_FAULT", "again", plugin="probe")
    ctx.report("PLUGIN_STOP", "plugin 'probe' asked to stop", plugin="probe")
    assert [f.code for f in executor.causes(5)] == ["PROBE_FAULT", "PLUGIN_STOP"]
    assert executor.causes(5)[0] is first


def test_a_rollback_handed_to_a_runner_is_announced_but_leaves_no_marker(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    from harness.lib.stops import STOP_DIR_ENV, read_markers

    monkeypatch.setenv(STOP_DIR_ENV, str(tmp_path))
    ctx, _ = run_context(tmp_path / "out" / "harness", {"PROBE_FAULT": "rollback"})
    executor = ActionExecutor(ctx, Handler())
    executor.begin_call()
    ctx.report("PROBE_FAULT", "bad batch", plugin="probe")
    executor.apply(Action.ROLLBACK, TrainerControl())
    assert "HARNESS ROLLING BACK" in capsys.readouterr().err
    assert read_markers(tmp_path) == [] and executor.notice is not None and not executor.notice.ends_training


def test_other_ranks_write_a_marker_but_print_nothing(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    from harness.core.distributed import DistInfo
    from harness.lib.stops import STOP_DIR_ENV, read_markers

    monkeypatch.setenv(STOP_DIR_ENV, str(tmp_path))
    ctx, _ = run_context(tmp_path / "out" / "harness")
    ctx.dist, ctx.rank, ctx.is_main = DistInfo(rank=1, world_size=2, local_rank=1), 1, False
    executor = ActionExecutor(ctx)
    executor.begin_call()
    executor.apply(Action.SAVE_AND_STOP, TrainerControl())
    assert capsys.readouterr().err == ""
    (notice,) = read_markers(tmp_path)
    assert notice.rank == 1 and notice.action == "save_and_stop"
