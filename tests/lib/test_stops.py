"""Stop markers, the stderr banner and `harness wrap`'s exit-status rule (pure logic, milliseconds)."""
from __future__ import annotations

import json
import os
import stat
from dataclasses import replace
from pathlib import Path

import pytest

from harness.lib.stops import (
    EXIT_STOPPED, STOP_DIR_ENV, StopNotice, banner, read_markers, wrap_summary, wrapped_exit_status, write_marker,
)

NOTICE = StopNotice(step=11, action="stop", output_dir="/runs/clm", codes=("DATA_REPEATED", "RESUME_DATA_POSITION"),
                    messages=("4 samples repeated.", "micro-batch 0 of step 11 is not the saved batch."), attempt=2)


def test_exit_stopped_is_ex_tempfail_and_neither_a_crash_nor_a_usage_error() -> None:
    assert EXIT_STOPPED == 75 and EXIT_STOPPED not in (0, 1, 2)


@pytest.mark.parametrize(
    ("status", "notices", "expected"),
    [
        (0, [], 0),  # a clean run keeps its own status
        (3, [], 3),
        (0, [NOTICE], 75),  # the script ignored the stop and exited 0
        (1, [NOTICE], 1),  # a crash that was not HarnessStopped: the command's status wins
        (1, [replace(NOTICE, raised=True)], 75),  # HarnessStopped left the script uncaught
        (3, [replace(NOTICE, raised=True)], 3),  # the script chose its own status
        (137, [NOTICE], 137),  # killed by a signal after the stop
        (0, [StopNotice(step=4, action="rollback", output_dir="/r")], 0),  # a stage runner's rollback went on training
    ],
)
def test_wrapped_exit_status(status: int, notices: list[StopNotice], expected: int) -> None:
    assert wrapped_exit_status(status, notices) == expected


def test_banner_names_the_codes_step_attempt_action_and_explain() -> None:
    text = banner(NOTICE)
    lines = text.splitlines()
    assert lines[0].startswith("=") and "HARNESS STOPPED TRAINING" in lines[0] and set(lines[-1]) == {"="}
    assert "at step 11 (attempt 2) after DATA_REPEATED, RESUME_DATA_POSITION" in text
    assert "action: stop" in text and "RESUME_DATA_POSITION: micro-batch 0 of step 11" in text
    assert "Next: harness explain /runs/clm" in text and "exits 75" in text
    assert max(len(line) for line in lines) <= 100


def test_a_rollback_banner_does_not_claim_the_run_ended() -> None:
    text = banner(StopNotice(step=4, action="rollback", output_dir="/r", codes=("LOSS_SPIKE",), messages=("x",)))
    assert "ROLLING BACK" in text and "did NOT reach" not in text and "exits 75" not in text


def test_marker_round_trip_in_the_wrap_directory_only(tmp_path: Path) -> None:
    assert write_marker(NOTICE, env={}) is None  # not under harness wrap: nothing written
    assert write_marker(NOTICE, env={STOP_DIR_ENV: str(tmp_path / "gone")}) is None  # never creates wrap's directory
    assert not (tmp_path / "gone").exists()
    path = write_marker(NOTICE, env={STOP_DIR_ENV: str(tmp_path)})
    assert path is not None and path.parent == tmp_path and json.loads(path.read_text())["format"] == "train-harness-stop/1"
    other = StopNotice(step=11, action="stop", output_dir="/runs/clm", rank=1, pid=os.getpid())
    write_marker(other, env={STOP_DIR_ENV: str(tmp_path)})
    (tmp_path / "stop.rank-9.pid-1.json").write_text("{not json", encoding="utf-8")  # damaged: skipped
    (tmp_path / "stop.rank-8.pid-1.json").write_text('{"format": "other"}', encoding="utf-8")
    assert read_markers(tmp_path) == [NOTICE, other]  # rank 0 (who knows the causes) first
    assert not list(tmp_path.glob(".*.tmp"))


def test_marker_rewritten_when_raised(tmp_path: Path) -> None:
    env = {STOP_DIR_ENV: str(tmp_path)}
    write_marker(NOTICE, env=env)
    write_marker(replace(NOTICE, raised=True), env=env)
    (notice,) = read_markers(tmp_path)
    assert notice.raised and wrapped_exit_status(1, [notice]) == EXIT_STOPPED


def test_unwritable_wrap_directory_is_not_an_error(tmp_path: Path) -> None:
    tmp_path.chmod(stat.S_IRUSR | stat.S_IXUSR)
    try:
        if os.access(tmp_path, os.W_OK):
            pytest.skip("running as root: permissions do not bind")
        assert write_marker(NOTICE, env={STOP_DIR_ENV: str(tmp_path)}) is None
    finally:
        tmp_path.chmod(stat.S_IRWXU)


def test_wrap_summary_says_which_status_won() -> None:
    assert "exit status 75 (the command itself exited 0)" in wrap_summary([NOTICE], 0, 75)
    kept = wrap_summary([NOTICE], 3, 3)
    assert "own exit status 3 is kept" in kept and "harness explain /runs/clm" in kept and "step 11 (attempt 2)" in kept
