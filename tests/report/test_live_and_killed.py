"""A run whose last train() call never recorded its end: still training (its process holds the run lock on this host)
or killed, and then at which step (the batched steps.jsonl lags the ledger and metrics.jsonl); what explain says to do
next. Run directories by hand (tests/handmade_runs.py), the lock held by a real process where it matters."""
from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Iterator

import pytest

from cli_in_process import harness_in_process
from conftest import REPO
from handmade_runs import finding_record, make_run
from harness.core.errors import RunDirLockedError
from harness.launch.summary import closing_summary
from harness.lib import rundir
from harness.report.record import RunRecord
from harness.report.verdict import verdict_of

T0 = 1_700_000_000.0  # attempts start then (files written by the test are newer)


def running_run(output_dir: Path, steps: int = 5, **attempt: Any) -> Path:
    """A run directory whose only attempt is still ``running`` in run.json (killed, or training now); no findings."""
    entry = {"started": T0, "resumed_from": None, "start_step": 0, "status": "running", "host": socket.gethostname(), **attempt}
    run_dir = make_run(output_dir, run_json={"attempts": [entry]}, findings=[])
    rows = [{"step": s, "loss": 5.0 - s / 100, "time": T0 + s} for s in range(1, steps + 1)]
    (run_dir / "steps.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    return run_dir


@pytest.fixture
def lock_holder() -> Iterator[Any]:
    """Start a process that takes the run lock of a run directory (as rank 0 does for a train() call) and keeps it."""
    started: list[subprocess.Popen[str]] = []

    def hold(run_dir: Path) -> subprocess.Popen[str]:
        code = ("import sys, time; from harness.lib import rundir; rundir.acquire(sys.argv[1], 1); "
                "print('held', flush=True); time.sleep(120)")
        process = subprocess.Popen([sys.executable, "-c", code, str(run_dir)], cwd=REPO, stdout=subprocess.PIPE, text=True)
        started.append(process)
        assert process.stdout is not None and process.stdout.readline().strip() == "held"
        return process

    yield hold
    for process in started:
        process.kill()
        process.wait()


def write_lock(run_dir: Path, pid: int, host: str) -> None:
    (run_dir / ".lock").write_text(json.dumps({"pid": pid, "host": host, "since": T0}), encoding="utf-8")


def dead_pid() -> int:
    process = subprocess.Popen([sys.executable, "-c", "pass"])
    process.wait()
    return process.pid


# -- 1. a live run is "running", not "failed" --------------------------------------------------------------------------------

def test_a_run_whose_lock_a_live_process_holds_is_running_not_failed(tmp_path: Path, lock_holder: Any, capsys: Any,
                                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    run_dir = running_run(tmp_path / "out", steps=7)
    process = lock_holder(run_dir)
    verdict = verdict_of(RunRecord.load(run_dir))
    assert verdict.label == "running", verdict.line()
    assert verdict.line().startswith(
        f"running: the last train() call is in progress (pid {process.pid} on this host; attempt 1), at step 7 so far;"), verdict.line()
    report = harness_in_process(capsys, monkeypatch, "report", str(tmp_path / "out"), "--no-plots")
    assert report.returncode == 0, report.stderr[-2000:]
    markdown = (run_dir / "report.md").read_text(encoding="utf-8")
    assert "**Verdict: running.**" in markdown and "failed" not in markdown.split("\n\n", 2)[1], markdown[:1500]
    with pytest.raises(RunDirLockedError):  # reading the lock left the holder's lock in place
        rundir.acquire(run_dir, 99)


def test_a_lock_this_process_holds_reads_as_running_and_stays_held(tmp_path: Path) -> None:
    """The report of a run training in this very process: the lock file is not opened (closing any descriptor of it would
    drop this process's record lock)."""
    run_dir = running_run(tmp_path / "out")
    rundir.acquire(run_dir, 1)
    try:
        assert verdict_of(RunRecord.load(run_dir)).line().startswith(
            f"running: the last train() call is in progress (pid {os.getpid()} on this host; attempt 1), at step 5 so far")
        code = "import sys; from harness.lib import rundir; rundir.acquire(sys.argv[1], 1)"
        other = subprocess.run([sys.executable, "-c", code, str(run_dir)], cwd=REPO, capture_output=True, text=True, timeout=60)
        assert other.returncode != 0 and "RunDirLockedError" in other.stderr, other.stderr[-2000:]
    finally:
        rundir.release(run_dir, 1)


def test_a_dead_holder_on_this_host_is_killed(tmp_path: Path) -> None:
    run_dir = running_run(tmp_path / "out")
    pid = dead_pid()
    write_lock(run_dir, pid, socket.gethostname())
    verdict = verdict_of(RunRecord.load(run_dir))
    assert verdict.label == "failed"
    assert (f"never reached its end at step 5 or later (the last step recorded): killed: pid {pid} on this host no "
            "longer holds its run lock (attempt 1)") in verdict.reason, verdict.reason


def test_a_live_pid_that_does_not_hold_the_lock_is_killed(tmp_path: Path) -> None:
    """The pid of a killed run, given to another process since: the kernel says nobody holds the lock."""
    run_dir = running_run(tmp_path / "out")
    write_lock(run_dir, os.getpid(), socket.gethostname())  # alive, but holds no lock on the file
    verdict = verdict_of(RunRecord.load(run_dir))
    assert verdict.label == "failed" and f"killed: pid {os.getpid()} on this host no longer holds" in verdict.reason


def test_a_lock_of_another_host_keeps_the_killed_reading(tmp_path: Path) -> None:
    run_dir = running_run(tmp_path / "out")
    write_lock(run_dir, os.getpid(), "gpu-node-7")
    verdict = verdict_of(RunRecord.load(run_dir))
    assert verdict.label == "failed", verdict.line()
    assert "killed, or still running on gpu-node-7 (pid" in verdict.reason


def test_a_run_without_a_lock_file_keeps_the_killed_reading(tmp_path: Path) -> None:
    verdict = verdict_of(RunRecord.load(running_run(tmp_path / "out")))
    assert verdict.label == "failed" and "at step 5 or later (the last step recorded): killed, or still running elsewhere" in verdict.reason


def test_a_lock_that_is_a_symbolic_link_is_not_followed(tmp_path: Path, lock_holder: Any) -> None:
    """A received run directory is data: its .lock may point at any file, a held lock of another run included."""
    live = running_run(tmp_path / "live")
    lock_holder(live)
    received = running_run(tmp_path / "received")
    (received / ".lock").symlink_to(live / ".lock")
    assert rundir.read_holder(received) is None
    assert verdict_of(RunRecord.load(received)).label == "failed"
    assert verdict_of(RunRecord.load(live)).label == "running"


# -- 2. the step a killed run reached: the last any record knows -------------------------------------------------------------

def ledger_line(attempt: int, step: int) -> str:
    return json.dumps({"attempt": attempt, "step": step, "micro_batch": 0, "epoch": 0, "batch_hash": "ab" * 8,
                       "sample_hashes": ["cd" * 8], "sample_ids": None}) + "\n"


def write_ledger(run_dir: Path, attempt: int, steps: range, nul_tail: int = 4096, rank: int = 0) -> Path:
    """``ledger/rank-<r>.jsonl`` as a killed mapped writer leaves it: a start line, a line per step, then NUL bytes."""
    path = run_dir / "ledger" / f"rank-{rank}.jsonl"
    path.parent.mkdir(exist_ok=True)
    start = json.dumps({"event": "start", "attempt": attempt, "step": steps.start - 1, "world_size": 1, "resumed_from": None})
    path.write_bytes((start + "\n" + "".join(ledger_line(attempt, s) for s in steps)).encode() + b"\0" * nul_tail)
    return path


def killed_at_55(tmp_path: Path) -> Path:
    """Killed in step 56: steps.jsonl (flushed every 10 steps and at logs) has 55, the ledger 56."""
    run_dir = running_run(tmp_path / "out", steps=55)
    write_lock(run_dir, dead_pid(), socket.gethostname())
    return run_dir


def test_a_killed_run_ends_at_the_ledgers_last_step(tmp_path: Path) -> None:
    run_dir = killed_at_55(tmp_path)
    write_ledger(run_dir, 1, range(1, 57))
    run = RunRecord.load(run_dir)
    assert run.attempt_end_step(-1) == 55 and run.last_known_step(-1) == 56
    reason = verdict_of(run).reason
    assert "never reached its end at step 56 or later (the last step recorded)" in reason and "step 55" not in reason, reason


def test_a_killed_run_ends_at_the_last_step_metrics_jsonl_logged(tmp_path: Path) -> None:
    run_dir = killed_at_55(tmp_path)
    logged = [{"step": s, "loss": 2.0} for s in range(1, 57)] + [{"step": 56, "eval_loss": 2.1}]
    (run_dir / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in logged) + '{"step": 57, "lo', encoding="utf-8")
    assert "at step 56 or later (the last step recorded)" in verdict_of(RunRecord.load(run_dir)).reason  # the torn line is not a step


def test_the_ledger_of_an_earlier_attempt_does_not_speak_for_the_last(tmp_path: Path) -> None:
    """Attempt 1 trained to 80 and was killed; attempt 2 resumed from checkpoint-50 and was killed before the ledger got
    a line (data_hash off, or killed before its first step): the files' last lines are attempt 1's."""
    attempts = [{"started": T0, "resumed_from": None, "start_step": 0, "status": "running"},
                {"started": time.time() + 5, "resumed_from": "/out/checkpoint-50", "start_step": 50, "status": "running"}]
    run_dir = make_run(tmp_path / "out", run_json={"attempts": attempts}, findings=[])
    rows = [{"step": s, "time": T0 + s} for s in range(1, 81)] + [{"step": s, "time": attempts[1]["started"] + s} for s in (51, 52)]
    (run_dir / "steps.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    write_ledger(run_dir, 1, range(1, 81))
    (run_dir / "metrics.jsonl").write_text(json.dumps({"step": 80, "loss": 1.0}) + "\n", encoding="utf-8")
    reason = verdict_of(RunRecord.load(run_dir)).reason
    assert "never reached its end at step 52 or later (the last step recorded)" in reason, reason
    # attempt 2 started its ledger and trained nothing yet: its start line is the last
    path = write_ledger(run_dir, 1, range(1, 81))
    with open(path, "r+b") as handle:
        data = handle.read().rstrip(b"\0")
        handle.seek(0)
        handle.truncate()
        handle.write(data + json.dumps({"event": "start", "attempt": 2, "step": 50}).encode() + b"\n")
    os.utime(path, (attempts[1]["started"] + 1, attempts[1]["started"] + 1))
    assert RunRecord.load(run_dir).last_known_step(-1) == 52


def test_only_the_tail_of_a_huge_ledger_is_read(tmp_path: Path) -> None:
    """A ledger of 64 GiB (sparse here): reading it whole would take minutes and all memory."""
    run_dir = killed_at_55(tmp_path)
    path = run_dir / "ledger" / "rank-0.jsonl"
    path.parent.mkdir()
    with open(path, "wb") as handle:
        handle.truncate(64 << 30)  # a hole: reads as NUL bytes, costs no disk
        handle.seek(0, os.SEEK_END)
        handle.write(b"\n" + ledger_line(1, 56).encode() + b"\0" * (1 << 20))  # then a killed writer's 1 MiB window
    began = time.monotonic()
    reason = verdict_of(RunRecord.load(run_dir)).reason
    assert time.monotonic() - began < 5
    assert "at step 56 or later (the last step recorded)" in reason, reason


def test_a_ledger_that_is_a_symbolic_link_is_not_read(tmp_path: Path) -> None:
    run_dir = killed_at_55(tmp_path)
    elsewhere = write_ledger(tmp_path, 1, range(1, 90))
    (run_dir / "ledger").mkdir()
    (run_dir / "ledger" / "rank-0.jsonl").symlink_to(elsewhere)
    assert RunRecord.load(run_dir).last_known_step(-1) == 55


# -- 3. explain says what to do about a call that did not end well -----------------------------------------------------------

def explained(capsys: Any, monkeypatch: pytest.MonkeyPatch, output_dir: Path) -> str:
    result = harness_in_process(capsys, monkeypatch, "explain", str(output_dir))
    assert result.returncode == 0, result.stderr[-2000:]
    return " ".join(result.stdout.split())


def test_explain_names_the_resume_point_of_a_killed_run_without_findings(tmp_path: Path, capsys: Any,
                                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    killed_at_55(tmp_path)
    text = explained(capsys, monkeypatch, tmp_path / "out")
    assert "No findings." in text
    assert f"next: harness resume-point {tmp_path / 'out'} (names the newest proven checkpoint to resume from" in text, text


@pytest.mark.parametrize(("status", "why"), [("interrupted", "to go on where the interrupted call left off"),
                                             ("stopped", "once the cause of the stop (above) is dealt with")])
def test_explain_names_the_resume_point_of_an_interrupted_or_stopped_run(tmp_path: Path, capsys: Any, status: str, why: str,
                                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    findings = [finding_record(code="LOSS_SPIKE", action="stop", step=4)] if status == "stopped" else []
    make_run(tmp_path / "out", findings=findings, run_json={"attempts": [
        {"started": T0, "resumed_from": None, "start_step": 0, "status": status, "ended": T0 + 9, "end_step": 4}]})
    text = explained(capsys, monkeypatch, tmp_path / "out")
    assert f"next: harness resume-point {tmp_path / 'out'} (names the newest proven checkpoint" in text and why in text, text


def test_explain_says_a_live_run_is_still_training(tmp_path: Path, capsys: Any, monkeypatch: pytest.MonkeyPatch,
                                                   lock_holder: Any) -> None:
    process = lock_holder(running_run(tmp_path / "out"))
    text = explained(capsys, monkeypatch, tmp_path / "out")
    assert "Verdict: running: the last train() call is in progress" in text
    assert f"next: the run is still training (pid {process.pid})" in text and "resume-point" not in text, text


def test_explain_adds_no_run_step_to_a_completed_run(tmp_path: Path, capsys: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    make_run(tmp_path / "out", findings=[])
    text = explained(capsys, monkeypatch, tmp_path / "out")
    assert "No findings." in text and "next:" not in text, text


def test_wraps_summary_of_a_live_run_says_running(tmp_path: Path, lock_holder: Any) -> None:
    run_dir = running_run(tmp_path / "out")
    lock_holder(run_dir)
    assert "verdict: running: the last train() call is in progress" in closing_summary([run_dir])
