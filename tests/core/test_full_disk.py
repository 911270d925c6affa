"""Issue 44 item 1: a full disk under the run directory never stops training; what could not be written is written later.

On a real tmpfs that the test fills (``fault_injector.fill_disk_at_step``, ``harness.testing.disk_fault``) and frees.
"""
from __future__ import annotations

import json
import logging
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

import harness
from conftest import findings_of
from harness.core.appendfile import OUTAGES, LineAppender
from harness.core.findings import Finding, FindingsFile, Severity, read_findings
from harness.core.jsonl import read_jsonl as harness_read_jsonl
from harness.testing.disk_fault import FILLER, fill_disk, free_disk


@pytest.fixture(autouse=True)
def _no_outage_left() -> Iterator[None]:
    """OUTAGES is the process's: a test's outage must not reach the next test's run."""
    yield
    OUTAGES.active.clear()
    OUTAGES.take_over()


def _line(i: int) -> str:
    return json.dumps({"step": i, "pad": "x" * 150}) + "\n"


def read_jsonl(path: Path) -> list[dict[str, Any]]:
    """As the harness's readers see the file: a torn line (a write the full disk took in part) skipped."""
    return list(harness_read_jsonl(path))


def _said(caplog: pytest.LogCaptureFixture, words: str) -> int:
    return sum(words in record.getMessage() for record in caplog.records)


def test_a_full_disk_holds_the_lines_and_writes_them_in_order_once_it_can(small_tmpfs: Path, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.WARNING, logger="harness")
    folder = small_tmpfs / "harness"
    steps = LineAppender(folder / "steps.jsonl")
    findings = FindingsFile(folder / "findings.jsonl")
    assert all(steps.write(_line(i)) for i in range(1, 4))
    fill_disk(small_tmpfs)
    held = [steps.write(_line(i)) for i in range(4, 60)]  # never raises (the file's last page takes a few lines first)
    finding = Finding(code="TEST_FAULT", severity=Severity.WARNING, plugin="t", message="made while the disk was full", step=7)
    assert findings.append(finding) and not findings.append(finding)  # held, and known: not twice
    assert held[-1] is False and steps.holding == held.count(False) > 30 and str(folder) in OUTAGES.active
    assert _said(caplog, f"cannot write to {folder}") == 1 and "No space left on device" in caplog.text
    free_disk(small_tmpfs)
    assert steps.write(_line(60)) and steps.holding == 0
    assert [r["step"] for r in read_jsonl(folder / "steps.jsonl")] == list(range(1, 61))  # in order, none twice
    assert str(folder) in OUTAGES.active  # the findings file still holds its line: the outage is not over yet
    findings.close()
    assert [f.message for f in read_findings(folder / "findings.jsonl")] == ["made while the disk was full"]
    (outage,) = OUTAGES.take_over()
    assert outage.errno == 28 and outage.until is not None and outage.files == {"steps.jsonl", "findings.jsonl"}
    assert _said(caplog, f"{folder} can be written again") == 1


def test_a_line_the_disk_took_in_part_is_written_again_whole(small_tmpfs: Path) -> None:
    """A write that fills the last free page leaves a torn line; the next write ends it with a newline and writes the
    line again whole (readers skip the torn one): no record glued to a fragment."""
    path = small_tmpfs / "harness" / "metrics.jsonl"
    metrics = LineAppender(path)
    metrics.write(_line(1))
    fill_disk(small_tmpfs)
    filler = small_tmpfs / FILLER
    os.truncate(filler, filler.stat().st_size - 8192)  # two free pages: a 20 KB line goes in part
    big = json.dumps({"step": 2, "pad": "y" * 20_000}) + "\n"
    assert not metrics.write(big) and 0 < path.stat().st_size - len(_line(1)) < len(big)
    free_disk(small_tmpfs)
    assert metrics.write(_line(3))
    assert [r["step"] for r in read_jsonl(path)] == [1, 2, 3]
    assert path.read_text().count("\n") == 4  # the torn fragment is a line of its own


def test_the_ledger_holds_its_lines_while_the_disk_is_full(small_tmpfs: Path) -> None:
    """The data ledger's mapped writer: a window that cannot be allocated, then a write that fails, hold the lines;
    the next write after space returns writes them, in order, none twice."""
    from harness.core.mapped_lines import MappedLines

    path = small_tmpfs / "harness" / "ledger" / "rank-0.jsonl"
    path.parent.mkdir(parents=True)
    ledger = MappedLines(path, window=4096)
    for i in range(1, 11):
        ledger.write(_line(i).encode())
    fill_disk(small_tmpfs)
    for i in range(11, 81):  # past the mapped window: no new window, no plain write
        ledger.write(_line(i).encode())
    assert ledger.holding > 0 and str(path.parent) in OUTAGES.active
    free_disk(small_tmpfs)
    ledger.write(_line(81).encode())
    ledger.close()
    assert ledger.holding == 0 and [r["step"] for r in read_jsonl(path)] == list(range(1, 82))
    (outage,) = OUTAGES.take_over()
    assert outage.errno == 28 and outage.files == {"rank-0.jsonl"}


def test_training_goes_on_when_the_run_directory_fills_up(small_tmpfs: Path, make_trainer: Any, caplog: pytest.LogCaptureFixture) -> None:
    """A real run on a 16 MB tmpfs, filled at step 4 and freed at step 9: all 12 steps train, a finding made while the
    disk was full is on disk at the end, steps.jsonl has every step once, and RUN_DIR_WRITE_FAILED names the folder
    and errno 28 (today: OSError [Errno 28] out of Trainer.train at the next harness write)."""
    caplog.set_level(logging.WARNING, logger="harness")
    trainer = make_trainer(output_dir=small_tmpfs / "out", max_steps=12)
    harness.attach(trainer, plugins=["harness.testing:FaultInjector"], config={
        "fault_injector": {"fill_disk_at_step": 4, "free_disk_at_step": 9, "report_at_step": 6, "report_in": "on_step_end"}})
    trainer.train()
    out = small_tmpfs / "out"
    assert trainer.state.global_step == 12
    assert [r["step"] for r in read_jsonl(out / "harness" / "steps.jsonl")] == list(range(1, 13))
    assert [f["step"] for f in findings_of(out, "TEST_FAULT")] == [6]
    (failed,) = findings_of(out, "RUN_DIR_WRITE_FAILED")
    assert failed["evidence"]["errno"] == 28 and failed["evidence"]["folder"] == str(out / "harness")
    assert "findings.jsonl" in failed["evidence"]["files"] and failed["evidence"]["dropped_lines"] == 0
    assert not findings_of(out, "INTERNAL_PLUGIN_ERROR") and not findings_of(out, "PLUGIN_DISABLED")
    assert _said(caplog, "cannot write to") == 1 and _said(caplog, "can be written again") == 1


def test_a_run_json_that_cannot_be_replaced_at_the_end_is_no_killed_run(small_tmpfs: Path, make_trainer: Any,
                                                                       caplog: pytest.LogCaptureFixture) -> None:
    """Issue 44 item 8: the disk fills as the run ends, so run.json cannot be replaced at the end. The console says so
    and the end is kept in the run lock: the verdict is the completed run's, with a note (today: 'killed: pid N no
    longer holds its run lock' for a run that completed with exit 0)."""
    from harness.report.record import RunRecord
    from harness.report.verdict import verdict_of

    caplog.set_level(logging.WARNING, logger="harness")
    out = small_tmpfs / "out"
    trainer = make_trainer(output_dir=out, max_steps=5)
    harness.attach(trainer, plugins=["harness.testing:FaultInjector"], config={"fault_injector": {"fill_disk_at_run_end": True}})
    trainer.train()
    assert "run.json could not be updated at the end" in caplog.text and "training completed at step 5" in caplog.text
    free_disk(out)
    run = RunRecord.load(out / "harness")
    assert run.last_status == "completed" and run.attempt_end_step(-1) == 5
    verdict = verdict_of(run)
    assert "killed" not in verdict.reason and "training completed at step 5" in verdict.reason, verdict.reason
    assert any("taken from the run lock" in note for note in run.damage_notes())


@pytest.mark.slow  # two processes under torchrun
def test_two_ranks_train_on_when_the_run_directory_fills_and_neither_waits_for_the_other(small_tmpfs: Path, tmp_path: Path) -> None:
    """The unmodified example on two processes (DDP on gloo), its output_dir on a 16 MB tmpfs filled after step 4 and
    freed after step 9; rank 1 alone makes a finding while the disk is full. Both ranks train every step and exit 0
    (no rank hangs in the step exchange for the other's failed write), rank 1's finding and both ranks' ledger lines
    of the full stretch are on disk at the end, and each process records the outage it met once."""
    from conftest import torchrun, wrapped_example, write_yaml

    out = small_tmpfs / "out"
    config = write_yaml(tmp_path / "h.yaml", {"plugins": ["defaults", "harness.testing:FaultInjector"], "fault_injector": {
        "fill_disk_at_step": 4, "free_disk_at_step": 9, "report_at_step": 6, "report_on_rank": 1, "report_in": "on_step_end"}})
    done = wrapped_example(out, config, launcher=torchrun(2), steps=14, save_steps=0)
    assert done.returncode == 0, done.stderr[-3000:]
    run_dir = out / "harness"
    assert [r["step"] for r in harness_read_jsonl(run_dir / "steps.jsonl")] == list(range(1, 15))
    assert [(f["step"], f["rank"]) for f in findings_of(out, "TEST_FAULT")] == [(6, 1)]
    for rank in (0, 1):
        ledger = sorted({r["step"] for r in harness_read_jsonl(run_dir / "ledger" / f"rank-{rank}.jsonl") if r.get("step", 0) > 0})
        assert ledger == list(range(1, 15)), (rank, ledger)
    failed = findings_of(out, "RUN_DIR_WRITE_FAILED")  # one per process that met it, naming that process's files
    assert sorted(f["rank"] for f in failed) == [0, 1], [(f["rank"], f["evidence"]) for f in failed]
    assert all(f["evidence"]["errno"] == 28 and f["evidence"]["dropped_lines"] == 0 for f in failed)
    assert not findings_of(out, "INTERNAL_PLUGIN_ERROR") and not findings_of(out, "RANK_HANG")
