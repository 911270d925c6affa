"""Several ranks crash: the verdict, explain, wrap's summary and the Attempts table name the rank that failed first and
why, with the ranks that failed after it (a failed collective) as secondary; older rank markers still read."""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from handmade_runs import make_run
from harness.launch.summary import closing_summary
from harness.lib.rank_markers import first_failure, read_marker, read_markers, short_error, write_marker
from harness.report.build import attempts_with_outcome
from harness.report.record import RunRecord
from harness.report.verdict import verdict_of

T0 = 1_700_000_000.0
GLOO = ("RuntimeError: [/__w/pytorch/pytorch/third_party/gloo/gloo/transport/tcp/pair.cc:553] Connection closed by peer "
        "[127.0.0.1]:17842. This is typically caused by a remote worker crashing. Check the logs of the remote worker "
        "before reporting an error. GLHF!")
CRASHED = {"world_size": 2, "attempts": [{"started": T0, "resumed_from": None, "start_step": 0, "status": "crashed",
                                          "ended": T0 + 30, "end_step": 9, "error": GLOO}]}


def _marker(run_dir: Path, rank: int, text: str) -> None:
    (run_dir / "ranks").mkdir(exist_ok=True)
    (run_dir / "ranks" / f"attempt.rank-{rank}").write_text(text, encoding="utf-8")


def _crash(run_dir: Path, rank: int, error: str, at: float) -> None:
    fields: dict[str, Any] = {"status": "crashed", "error": error, "ended": at, "step": 9}
    _marker(run_dir, rank, "ended\n" + json.dumps(fields))


def test_the_rank_that_raised_first_is_named_and_the_gloo_error_is_secondary(tmp_path: Path) -> None:
    run_dir = make_run(tmp_path / "out", run_json=CRASHED, findings=[])
    _crash(run_dir, 0, short_error(GLOO) or "", T0 + 12)
    _crash(run_dir, 1, "ValueError: injected crash on rank 1 at step 10", T0 + 10)
    line = verdict_of(RunRecord.load(run_dir)).line()
    assert line.startswith("failed: training crashed after step 9: rank 1 raised ValueError: injected crash on rank 1 at step 10 "
                           "(rank 0 then failed with RuntimeError: Connection closed by peer [127.0.0.1]:17842)"), line
    assert "pair.cc" not in line and "GLHF" not in line
    (row,) = attempts_with_outcome(RunRecord.load(run_dir))
    assert row["outcome"] == "crashed" and row["error"].startswith("rank 1 raised ValueError: injected crash"), row
    assert "rank 1 raised ValueError" in closing_summary([run_dir])


def test_a_communication_error_is_secondary_even_when_it_came_first(tmp_path: Path) -> None:
    """Rank 0's collective timed out before rank 1's own error reached its marker: rank 1's error is still the cause."""
    run_dir = make_run(tmp_path / "out", run_json=CRASHED, findings=[])
    _crash(run_dir, 0, "RuntimeError: Connection reset by peer", T0 + 5)
    _crash(run_dir, 1, "KeyError: 'input_ids'", T0 + 10)
    assert "rank 1 raised KeyError: 'input_ids' (rank 0 then failed with RuntimeError: Connection reset by peer)" in verdict_of(RunRecord.load(run_dir)).line()
    # two real errors: the earlier one is first
    _crash(run_dir, 0, "ZeroDivisionError: division by zero", T0 + 5)
    assert "rank 0 raised ZeroDivisionError: division by zero (rank 1 then failed with KeyError" in verdict_of(RunRecord.load(run_dir)).line()


def test_rank_0_from_run_json_when_its_marker_says_nothing(tmp_path: Path) -> None:
    """A run of an older version on rank 0 (marker 'running'), or rank 0 killed before its marker: run.json's error stands in."""
    run_dir = make_run(tmp_path / "out", run_json=CRASHED, findings=[])
    _marker(run_dir, 0, "running")
    _crash(run_dir, 1, "ValueError: boom", T0 + 10)
    assert "rank 1 raised ValueError: boom (rank 0 then failed with RuntimeError: Connection closed by peer" in verdict_of(RunRecord.load(run_dir)).line()


def test_old_markers_and_stale_markers_keep_the_old_verdict(tmp_path: Path) -> None:
    run_dir = make_run(tmp_path / "out", run_json=CRASHED, findings=[])
    _marker(run_dir, 0, "running")
    _marker(run_dir, 1, "ended")  # an older version's marker: no status, no error
    old = verdict_of(RunRecord.load(run_dir)).line()
    assert old.startswith("failed: training crashed after step 9 with RuntimeError: [/__w/pytorch") and "rank 1" not in old
    _crash(run_dir, 1, "ValueError: from an earlier call", T0 - 100)  # before this attempt started: not this call's
    assert verdict_of(RunRecord.load(run_dir)).line() == old
    assert read_marker(run_dir / "ranks" / "attempt.rank-0") is not None
    assert [(e.rank, e.state, e.status) for e in read_markers(run_dir)] == [(0, "running", None), (1, "ended", "crashed")]


def test_run_json_copy_names_the_ranks_of_an_earlier_attempt(tmp_path: Path) -> None:
    """The Attempts table of attempt 1 reads run.json's copy of the rank ends (the markers now hold attempt 2's)."""
    first = dict(CRASHED["attempts"][0], ranks=[
        {"rank": 0, "status": "crashed", "error": "RuntimeError: Connection closed by peer [127.0.0.1]:1", "ended": T0 + 12, "step": 9},
        {"rank": 1, "status": "crashed", "error": "ValueError: injected", "ended": T0 + 10, "step": 9}])
    second = {"started": T0 + 100, "resumed_from": "/x/checkpoint-5", "start_step": 5, "status": "completed", "ended": T0 + 200, "end_step": 14}
    run_dir = make_run(tmp_path / "out", run_json={"world_size": 2, "attempts": [first, second]}, findings=[])
    _marker(run_dir, 1, "ended")
    rows = attempts_with_outcome(RunRecord.load(run_dir))
    assert rows[0]["error"] == "rank 1 raised ValueError: injected (rank 0 then failed with RuntimeError: Connection closed by peer [127.0.0.1]:1)"
    assert "error" not in rows[1]
    assert verdict_of(RunRecord.load(run_dir)).label == "healthy"


def test_marker_round_trip_and_short_errors(tmp_path: Path) -> None:
    write_marker(tmp_path, 1, "running")
    assert (tmp_path / "ranks" / "attempt.rank-1").read_text() == "running"
    write_marker(tmp_path, 1, "ended", status="completed", error=None, ended=T0, step=3)
    assert (tmp_path / "ranks" / "attempt.rank-1").read_text() == "ended"  # a completed rank's marker is as before
    write_marker(tmp_path, 1, "ended", status="crashed", error=ValueError("bad\nsecond line"), ended=T0, step=3)
    end = read_marker(tmp_path / "ranks" / "attempt.rank-1")
    assert end is not None and (end.rank, end.status, end.error, end.ended, end.step) == (1, "crashed", "ValueError: bad", T0, 3)
    assert short_error(GLOO) == "RuntimeError: Connection closed by peer [127.0.0.1]:17842"
    assert short_error(RuntimeError()) == "RuntimeError"
    assert first_failure([]) == (None, [])
