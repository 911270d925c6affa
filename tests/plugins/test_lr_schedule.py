"""lr_schedule: the applied LR against the configured schedule; warmup lost at a resume; a scheduler moving on skipped steps."""
from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

import harness
from conftest import FAULTS, findings_of

SCHEDULE = {"max_steps": 12, "warmup_steps": 6, "lr_scheduler_type": "cosine", "learning_rate": 1e-3}


def _train(make_trainer: Any, faults: dict[str, Any] | None = None, resume: str | None = None, **args: Any) -> Any:
    trainer = make_trainer(**{**SCHEDULE, **args})
    harness.attach(trainer, config={"plugins": ["lr_schedule", "nan_guard", FAULTS], "fault_injector": faults or {}})
    trainer.train(resume_from_checkpoint=resume)
    return trainer


def _lr_findings(out: Any) -> list[dict[str, Any]]:
    return [f for f in findings_of(out) if f["code"].startswith("LR_")]


def test_a_clean_schedule_with_a_skipped_step_is_silent(make_trainer: Any) -> None:
    trainer = _train(make_trainer, {"nonfinite_loss_at_steps": [3]})
    assert findings_of(trainer.args.output_dir, "NONFINITE_LOSS")  # the skip happened, and the scheduler held still
    assert _lr_findings(trainer.args.output_dir) == []


def test_warmup_removed_at_a_resume_is_a_mismatch_at_the_first_update(make_trainer: Any, tmp_path: Path) -> None:
    out = tmp_path / "run"
    _train(make_trainer, {"stop_at_step": 6}, output_dir=out, save_strategy="steps", save_steps=4)
    assert _lr_findings(out) == []
    _train(make_trainer, resume=str(out / "checkpoint-4"), output_dir=out, warmup_steps=0)
    (mismatch,) = _lr_findings(out)
    # step 5 still runs on the LR restored from scheduler.pt; the new shape shows from the next scheduler step on
    assert mismatch["code"] == "LR_SCHEDULE_MISMATCH" and mismatch["step"] == 6
    evidence = mismatch["evidence"]
    assert evidence["changed_at_resume"] == {"warmup": [6, 0]} and evidence["position"] == 5
    assert evidence["expected_lr"] == pytest.approx(1e-3 * 5 / 6)  # still warming up in the run's own schedule
    assert evidence["applied_lr"] == pytest.approx(1e-3 * 0.5 * (1 + 0.25881904510252074), rel=1e-4)  # cosine without warmup
    assert "warmup removed" in mismatch["message"] and "checkpoint-4" in mismatch["message"]


def test_an_lr_changed_behind_the_schedule_is_found_at_that_step(make_trainer: Any) -> None:
    trainer = _train(make_trainer, {"lr_scale_at_steps": [8], "lr_scale": 100.0})
    (mismatch,) = _lr_findings(trainer.args.output_dir)
    assert mismatch["code"] == "LR_SCHEDULE_MISMATCH" and mismatch["step"] == 8
    assert mismatch["evidence"]["applied_lr"] == pytest.approx(100 * mismatch["evidence"]["expected_lr"])


def test_a_scheduler_that_steps_on_a_skipped_step_is_named(make_trainer: Any) -> None:
    faults = {"report_at_step": 3, "action": "skip_step", "advance_scheduler_at_steps": [3]}
    trainer = _train(make_trainer, faults)
    (advanced,) = _lr_findings(trainer.args.output_dir)  # the position follows the scheduler: no mismatch on top
    assert advanced["code"] == "LR_ADVANCED_ON_SKIPPED_STEP" and advanced["step"] == 3
    assert advanced["evidence"]["position_before"] == 2 and advanced["evidence"]["position_after"] == 3
    (summary,) = findings_of(trainer.args.output_dir, "SKIPPED_STEPS")
    assert summary["evidence"]["scheduler_advanced"] == [3] and summary["severity"] == "warning"
