"""metrics_log keeps every logged metric in harness/metrics.jsonl, on rank 0 only."""
from __future__ import annotations

from pathlib import Path
from typing import Any

import harness
from conftest import read_jsonl


def test_every_logged_step_is_kept_with_loss_and_lr(make_trainer: Any) -> None:
    trainer = make_trainer(max_steps=4, logging_steps=2)
    harness.attach(trainer)
    trainer.train()
    rows = read_jsonl(Path(trainer.args.output_dir) / "harness" / "metrics.jsonl")
    logged = [r for r in rows if "loss" in r]
    assert [r["step"] for r in logged] == [2, 4]
    assert all(r["loss"] > 0 and "learning_rate" in r and "grad_norm" in r for r in logged)
    assert any("train_runtime" in r for r in rows)


def test_disabled_writes_nothing(make_trainer: Any) -> None:
    trainer = make_trainer(max_steps=2)
    harness.attach(trainer, config={"disable": ["metrics_log"]})
    trainer.train()
    assert not (Path(trainer.args.output_dir) / "harness" / "metrics.jsonl").exists()
