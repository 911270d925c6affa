"""The data ledger around a resume (harness.lib.ledger): attempts, what was trained before and what came next."""
from __future__ import annotations

from pathlib import Path

from harness.lib.ledger import LedgerWriter, around_resume, iter_records, last_attempt, ledger_path, read_ledger


def _record(step: int, micro_batch: int = 0) -> dict[str, object]:
    return {"step": step, "micro_batch": micro_batch, "epoch": 0, "batch_hash": f"b{step}.{micro_batch}",
            "sample_hashes": [f"h{step}.{micro_batch}"], "sample_ids": [step * 10 + micro_batch]}


def _attempt(run_dir: Path, start: int, steps: range, resume_step: int | None = None) -> LedgerWriter:
    writer = LedgerWriter(run_dir, rank=0, fsync_every=1, resume_step=resume_step)
    writer.start(step=start, world_size=1, resumed_from=None if resume_step is None else f"checkpoint-{resume_step}")
    for step in steps:
        writer.write_step([_record(step, 0), _record(step, 1)])
    return writer


def _steps(records: list[dict[str, object]]) -> list[tuple[object, object, object]]:
    return sorted((r["attempt"], r["step"], r["micro_batch"]) for r in records)


def test_a_resume_sees_what_was_trained_up_to_it_and_what_the_killed_run_did_next(tmp_path: Path) -> None:
    _attempt(tmp_path, 0, range(1, 7)).close()  # attempt 1 trained steps 1..6, then was killed
    resumed = _attempt(tmp_path, 4, range(0), resume_step=4)  # attempt 2 resumes checkpoint-4
    assert resumed.attempt == 2
    before, after = around_resume(tmp_path, 0, 4)
    assert _steps(before) == [(1, s, m) for s in range(1, 5) for m in (0, 1)]
    assert _steps(after) == [(1, s, m) for s in (5, 6) for m in (0, 1)]
    resumed.close()


def test_the_running_attempt_is_left_out_and_the_newest_earlier_attempt_wins(tmp_path: Path) -> None:
    _attempt(tmp_path, 0, range(1, 7)).close()  # attempt 1: steps 1..6
    _attempt(tmp_path, 4, range(5, 9), resume_step=4).close()  # attempt 2: resumed at 4, trained 5..8
    running = _attempt(tmp_path, 5, range(6, 8), resume_step=5)  # attempt 3: resumed at 5, already trained 6, 7
    assert running.attempt == 3 and last_attempt(ledger_path(tmp_path, 0)) == 3
    before, after = around_resume(tmp_path, 0, 5)
    assert _steps(before) == [(1, s, m) for s in range(1, 5) for m in (0, 1)] + [(2, 5, 0), (2, 5, 1)]
    assert _steps(after) == [(2, s, m) for s in (6, 7, 8) for m in (0, 1)]  # attempt 2's next steps, not attempt 1's
    running.close()


def test_a_line_cut_by_a_kill_is_skipped_and_attempts_stay_distinct(tmp_path: Path) -> None:
    _attempt(tmp_path, 0, range(1, 3)).close()
    path = ledger_path(tmp_path, 0)
    with open(path, "ab") as handle:
        handle.write(b'{"attempt": 1, "step": 3, "micro')  # killed mid-line
    resumed = _attempt(tmp_path, 2, range(3, 4), resume_step=2)
    assert resumed.attempt == 2
    resumed.close()
    frame = read_ledger(tmp_path)
    assert sorted(zip(frame.attempt, frame.step)) == [(1, 1), (1, 1), (1, 2), (1, 2), (2, 3), (2, 3)]


def test_read_ledger_marks_steps_trained_past_the_resumed_checkpoint(tmp_path: Path) -> None:
    _attempt(tmp_path, 0, range(1, 5)).close()
    _attempt(tmp_path, 2, range(3, 5), resume_step=2).close()
    frame = read_ledger(tmp_path)
    superseded = sorted(set(zip(frame.attempt[frame.superseded], frame.step[frame.superseded])))
    assert superseded == [(1, 3), (1, 4)]
    assert list(frame.columns)[-1] == "superseded" and set(frame.sample_id) == {s * 10 + m for s in range(1, 5) for m in (0, 1)}


def test_no_ledger_means_nothing_around_the_resume(tmp_path: Path) -> None:
    assert around_resume(tmp_path, 0, 3) == ([], [])
    assert last_attempt(ledger_path(tmp_path, 0)) == 0


def test_the_per_step_fast_path_writes_the_same_lines_as_records(tmp_path: Path) -> None:
    """``write_hashes`` formats lines itself (the per-step path); they must be the bytes ``write_step`` writes."""
    cases = [(0, "00ff", ["0a", "0b"], None), (1, "01", [], [1, 2]), (2, "02", ["0c"], ['a"b', "ü"])]
    writer = LedgerWriter(tmp_path, rank=0)
    writer.write_hashes(5, 1, cases)
    writer.write_step([{"step": 5, "micro_batch": m, "epoch": 1, "batch_hash": b, "sample_hashes": s, "sample_ids": i}
                       for m, b, s, i in cases])
    writer.close()
    lines = [line for line in writer.path.read_text().splitlines() if '"event"' not in line]
    assert len(lines) == 6 and lines[:3] == lines[3:]


KILLED_ATTEMPT = """
import os, signal, sys
from pathlib import Path
from harness.lib.ledger import LedgerWriter
writer = LedgerWriter(Path(sys.argv[1]), rank=0, fsync_every=1000)
writer.start(step=0, world_size=1, resumed_from=None)
for step in range(1, 7):
    writer.write_hashes(step, 0, [(0, f"{step:016x}", [f"{step:016x}"], [step])])
os.kill(os.getpid(), signal.SIGKILL)  # no close, no fsync: what the page cache holds is all there is
"""


def test_a_kill_9_loses_no_step_and_the_resumed_attempt_continues_the_file(tmp_path: Path) -> None:
    import signal
    import subprocess
    import sys

    result = subprocess.run([sys.executable, "-c", KILLED_ATTEMPT, str(tmp_path)], capture_output=True, text=True, timeout=120)
    assert result.returncode == -signal.SIGKILL, result.stderr
    kept = [r.get("step") for r in iter_records(ledger_path(tmp_path, 0))]  # as the killed run left it: with its unwritten window
    assert kept == [0, 1, 2, 3, 4, 5, 6]
    resumed = LedgerWriter(tmp_path, rank=0, resume_step=4)
    resumed.start(step=4, world_size=1, resumed_from="checkpoint-4")
    before, after = around_resume(tmp_path, 0, 4)
    assert resumed.attempt == 2 and [r["step"] for r in before] == [1, 2, 3, 4] and [r["step"] for r in after] == [5, 6]
    for step in range(5, 8):
        resumed.write_step([_record(step)])
    resumed.close()
    raw = ledger_path(tmp_path, 0).read_bytes()
    assert b"\0" not in raw and raw.endswith(b"\n")
    frame = read_ledger(tmp_path)
    assert sorted(set(zip(frame.attempt, frame.step))) == [(1, s) for s in range(1, 7)] + [(2, s) for s in range(5, 8)]
    assert sorted(set(frame.step[frame.superseded])) == [5, 6]
