"""Issue 44 item 12: a run directory deleted while training is made again at the next checkpoint and at the end."""
from __future__ import annotations

import logging
import os
import shutil
from pathlib import Path
from typing import Any

import pytest
from transformers import TrainerCallback

import harness
from conftest import findings_of, read_jsonl


class DeleteRunDir(TrainerCallback):
    """``rm -rf <output_dir>/harness`` at the end of one step, as a clean-up script might."""

    def __init__(self, run_dir: Path, step: int) -> None:
        self.run_dir, self.step = run_dir, step
        self.lock_later: str | None = None  # the lock file's text two steps after the save that made the folder again

    def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        if state.global_step == self.step:
            shutil.rmtree(self.run_dir)
        if state.global_step == self.step + 3:
            lock = self.run_dir / ".lock"
            self.lock_later = lock.read_text() if lock.is_file() else None


def test_a_run_directory_deleted_mid_run_is_made_again_with_its_findings(make_trainer: Any, tmp_path: Path,
                                                                        caplog: pytest.LogCaptureFixture) -> None:
    """Deleted at step 3: the finding of step 2 is written again at the save of step 4, later step records land in
    the new folder, the lock is held again, and the console says it once (today: every later finding was written to
    removed files, and the lock was gone)."""
    caplog.set_level(logging.WARNING, logger="harness")
    out = tmp_path / "run"
    deleter = DeleteRunDir(out / "harness", 3)
    trainer = make_trainer(output_dir=out, max_steps=8, save_strategy="steps", save_steps=4, callbacks=[deleter])
    harness.attach(trainer, plugins=["harness.testing:FaultInjector"],
                   config={"fault_injector": {"report_at_step": 2, "report_in": "on_step_end"}})
    trainer.train()
    assert trainer.state.global_step == 8
    assert [f["step"] for f in findings_of(out, "TEST_FAULT")] == [2]
    steps = [r["step"] for r in read_jsonl(out / "harness" / "steps.jsonl")]
    assert steps and steps[-1] == 8 and 3 not in steps  # the lines before the deletion went with it
    assert sum("was deleted while training" in r.getMessage() for r in caplog.records) == 1
    assert (out / "harness" / "run.json").is_file() and (out / "harness" / "report.md").is_file()
    assert deleter.lock_later is not None and f'"pid": {os.getpid()}' in deleter.lock_later  # held again from the save on
