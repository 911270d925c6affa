"""Ctrl-C (KeyboardInterrupt) in training is recorded and reported as an interrupt, not as a crash of training."""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from transformers import TrainerCallback

import harness
from harness.hf.lifecycle import recorded_status


class _CtrlC(TrainerCallback):
    def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        if state.global_step == 2:
            raise KeyboardInterrupt


def test_ctrl_c_is_recorded_as_interrupted_not_crashed(make_trainer: Any) -> None:
    trainer = make_trainer(max_steps=5, callbacks=[_CtrlC()])
    harness.attach(trainer)
    with pytest.raises(KeyboardInterrupt):
        trainer.train()
    run_dir = Path(trainer.args.output_dir) / "harness"
    attempt = json.loads((run_dir / "run.json").read_text(encoding="utf-8"))["attempts"][-1]
    assert attempt["status"] == "interrupted" and attempt["end_step"] == 2, attempt
    report = (run_dir / "report.md").read_text(encoding="utf-8")
    assert "**Verdict: failed.** training was interrupted (Ctrl-C / SIGINT) after step 2 (attempt 1)" in report
    assert "crashed" not in report and "KeyboardInterrupt: " not in report


def test_only_a_keyboard_interrupt_is_an_interrupt() -> None:
    assert recorded_status("crashed", KeyboardInterrupt()) == "interrupted"
    assert recorded_status("crashed", RuntimeError("boom")) == "crashed"
    assert recorded_status("crashed", SystemExit(1)) == "crashed"
    assert recorded_status("completed", None) == "completed" and recorded_status("stopped", None) == "stopped"
