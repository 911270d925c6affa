"""loss_baseline: the first loss against ln(vocab), and micro-batches whose labels are all masked."""
from __future__ import annotations

from typing import Any

import pytest

import harness
from conftest import findings_of


def test_a_fresh_model_starts_near_ln_vocab_and_stays_silent(make_trainer: Any) -> None:
    trainer = make_trainer(max_steps=3)
    harness.attach(trainer, config={"plugins": ["loss_baseline"], "loss_baseline": {"expect": "scratch"}})
    trainer.train()
    assert findings_of(trainer.args.output_dir) == []


def test_a_blown_up_initialisation_is_far_above(make_trainer: Any) -> None:
    trainer = make_trainer(max_steps=2)
    for p in trainer.model.lm_head.parameters():
        p.data.mul_(200.0)
    harness.attach(trainer, config={"plugins": ["loss_baseline"]})
    trainer.train()
    (finding,) = findings_of(trainer.args.output_dir, "INITIAL_LOSS_ANOMALY")
    assert finding["step"] == 1 and finding["severity"] == "warning" and finding["evidence"]["ratio"] > 1.5
    assert "far above" in finding["message"]


@pytest.mark.parametrize(("expect", "severity"), [("scratch", "warning"), ("auto", "info")])
def test_a_model_that_already_knows_the_data_is_far_below(make_trainer: Any, lm_rows: Any, tmp_path: Any, expect: str, severity: str) -> None:
    repetitive = lm_rows.select([0] * 64)
    warm = make_trainer(output_dir=tmp_path / "warm", max_steps=40, learning_rate=3e-3)
    warm.train_dataset = repetitive
    warm.train()
    again = make_trainer(output_dir=tmp_path / "again", max_steps=1)
    again.model = warm.model
    again.model_wrapped = warm.model
    again.train_dataset = repetitive
    harness.attach(again, config={"plugins": ["loss_baseline"], "loss_baseline": {"expect": expect}})
    again.train()
    (finding,) = findings_of(again.args.output_dir, "INITIAL_LOSS_ANOMALY")
    assert finding["severity"] == severity and finding["evidence"]["ratio"] < 0.5 and "far below" in finding["message"]


def test_micro_batches_with_every_label_masked(make_trainer: Any, lm_rows: Any) -> None:
    rows = lm_rows.select(range(16)).map(lambda row, i: {"labels": [-100] * len(row["labels"]) if 8 <= i < 12 else row["labels"]}, with_indices=True)
    trainer = make_trainer(max_steps=4, train_sampling_strategy="sequential")
    trainer.train_dataset = rows
    harness.attach(trainer, config={"plugins": ["loss_baseline"]})
    trainer.train()
    (finding,) = findings_of(trainer.args.output_dir, "ALL_LABELS_MASKED")
    assert finding["step"] == 3 and finding["evidence"]["micro_batches"] == [0]
