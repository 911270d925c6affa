"""wrap's closing summary counts the findings of this job only: an earlier job that trained into the same output_dir
left its findings in the run directory (a fresh job there is a new attempt), and they are said, not counted."""
from __future__ import annotations

import json
import time
from pathlib import Path

from handmade_runs import finding_record as _finding, make_run
from harness.launch.summary import closing_summary
from harness.lib.wrapped_runs import read_run_markers, read_run_markers_since, write_run_marker


def test_findings_of_an_earlier_job_in_the_same_run_directory_are_not_this_jobs(tmp_path: Path) -> None:
    began = time.time()
    old = _finding(time=began - 3600)  # NONFINITE_LOSS, error, made an hour before this job attached
    run_dir = make_run(tmp_path / "out", findings=[old])
    assert "NONFINITE_LOSS" in closing_summary([run_dir])  # without the job's start: every finding, as before
    summary = closing_summary({run_dir: began})
    assert "verdict: healthy" in summary and "findings: none (1 finding(s) of earlier jobs in this run directory not counted)" in summary, summary
    new = _finding(time=began + 5, id="new00001")
    (run_dir / "findings.jsonl").write_text(json.dumps(old) + "\n" + json.dumps(new) + "\n", encoding="utf-8")
    summary = closing_summary({run_dir: began})
    assert "findings: NONFINITE_LOSS x1 (error) (1 finding(s) of earlier jobs" in summary, summary


def test_the_marker_keeps_the_time_of_the_jobs_first_train(tmp_path: Path) -> None:
    stop_dir = tmp_path / "wrap"
    stop_dir.mkdir()
    env = {"HARNESS_STOP_DIR": str(stop_dir)}
    run_dir = tmp_path / "out" / "harness"
    run_dir.mkdir(parents=True)
    assert write_run_marker(run_dir, env=env, since=100.0) is not None
    write_run_marker(run_dir, env=env, since=200.0)  # a second train() call of the same job
    assert read_run_markers_since(stop_dir) == {run_dir.resolve(): 100.0}
    assert read_run_markers(stop_dir) == [run_dir.resolve()]
    assert write_run_marker(run_dir, env={}) is None  # not under wrap: nothing written


def test_a_run_without_its_findings_file_is_not_summarised_as_without_findings(tmp_path: Path) -> None:
    run_dir = make_run(tmp_path / "out", run_json={"attempts": [{"started": 1.0, "resumed_from": None, "start_step": 0,
                                                                 "status": "stopped", "end_step": 4}]})
    (run_dir / "findings.jsonl").unlink()
    summary = closing_summary([run_dir])
    assert "findings: not known (findings.jsonl is missing)" in summary, summary
    assert "no finding at warning or above" not in summary and "findings not known: findings.jsonl is missing" in summary
