"""The absolute anchors on real Trainers: runs bad from their first steps, classifiers judged against ln(labels), evaluations.

Each run is a tiny model built from a config (GPT-2, Llama, BERT) trained by
the real ``transformers.Trainer`` with the default plugins. Before the
anchors, the GPT-2 and fine-tune runs here were "healthy", and every clean
classifier got INITIAL_LOSS_ANOMALY for starting at ln 3 rather than ln(vocab).
"""
from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import pytest
import torch

import harness
from conftest import FAULTS, findings_of
from harness.lib.tiny_zoo import build_tiny_model
from harness.report.record import RunRecord
from harness.report.verdict import HEALTHY, verdict_of

LOUD = ("warning", "error", "critical")
QUIET: dict[str, Any] = {}  # every default plugin


def _loud(out: Any) -> list[tuple[str, int]]:
    return [(f["code"], f["step"]) for f in findings_of(out) if f["severity"] in LOUD]


def _losses(trainer: Any) -> list[float]:
    return [h["loss"] for h in trainer.state.log_history if "loss" in h]


def test_a_gpt2_from_scratch_at_learning_rate_1_is_never_healthy(make_trainer: Any, tokenizer: Any, tmp_path: Path) -> None:
    """The newcomer's run: loss 5.6, 5.6, 5.4, then above ln V and up to 60. A finding within two steps of the first loss over
    ln V, LOSS_DIVERGENCE, LOSS_NOT_RECOVERED at the end, and a verdict that is not healthy."""
    trainer = make_trainer(model=build_tiny_model("gpt2", tokenizer, hidden_size=64), max_steps=30, learning_rate=1.0, warmup_steps=5)
    harness.attach(trainer, config=QUIET)
    trainer.train()
    losses, ln_v = _losses(trainer), math.log(len(tokenizer))
    over = next(step for step, loss in enumerate(losses, 1) if step > 1 and loss > ln_v)
    (above,) = findings_of(trainer.args.output_dir, "LOSS_ABOVE_START")
    assert above["severity"] == "warning" and over <= above["step"] <= over + 2, (losses, above["step"])
    assert above["evidence"]["untrained_basis"] == f"ln(vocab={len(tokenizer)})"
    codes = {code for code, _ in _loud(trainer.args.output_dir)}
    assert {"LOSS_DIVERGENCE", "LOSS_NOT_RECOVERED"} <= codes, codes
    verdict = verdict_of(RunRecord.load(Path(trainer.args.output_dir) / "harness"))
    assert verdict.label != HEALTHY and "LOSS_ABOVE_START" in verdict.reason


def test_a_fine_tune_that_blows_up_at_step_2_is_found_and_said_not_recovered(make_trainer: Any, tokenizer: Any, tmp_path: Path) -> None:
    pretrain = make_trainer(output_dir=tmp_path / "pre", max_steps=60, learning_rate=5e-3)
    pretrain.train()
    start = _losses(pretrain)[-1]
    tune = make_trainer(output_dir=tmp_path / "tune", model=pretrain.model, max_steps=40, learning_rate=5e-2)
    harness.attach(tune, config=QUIET)
    tune.train()
    losses = _losses(tune)
    assert losses[0] < start * 1.2 and max(losses[1:4]) > math.log(len(tokenizer)), losses  # the blow-up the test is about
    (above,) = findings_of(tune.args.output_dir, "LOSS_ABOVE_START")
    assert above["step"] <= 4 and above["evidence"]["start"] == pytest.approx(losses[0], rel=1e-3)
    (ended,) = findings_of(tune.args.output_dir, "LOSS_NOT_RECOVERED")
    assert ended["evidence"]["level"] > losses[0] * 1.1


def _classification_rows(tokenizer: Any, lm_rows: Any, labels: int, seq: int = 16, n: int = 64, float_labels: bool = False) -> Any:
    from datasets import Dataset

    ids = [row[:seq] for row in lm_rows["input_ids"][:n]]
    target: list[Any] = [float(i % 7) / 7 for i in range(n)] if float_labels else [sum(r) % labels for r in ids]
    return Dataset.from_dict({"input_ids": ids, "attention_mask": [[1] * seq for _ in ids], "labels": target})


@pytest.mark.parametrize(("family", "labels"), [("bert", 3), ("llama", 2)])
def test_a_clean_classifier_starts_at_ln_labels_and_is_silent(make_trainer: Any, tokenizer: Any, lm_rows: Any, family: str, labels: int) -> None:
    """run_glue.py's BERT with 3 labels starts at 1.10 = ln 3, a Llama head with 2 at 0.69: not ln(vocab)."""
    model = build_tiny_model(family, tokenizer, "sequence_classification", num_labels=labels, hidden_size=32)
    trainer = make_trainer(model=model, train_dataset=_classification_rows(tokenizer, lm_rows, labels), max_steps=24, learning_rate=5e-4,
                           per_device_train_batch_size=8)
    harness.attach(trainer, config=QUIET)
    trainer.train()
    assert _loud(trainer.args.output_dir) == []
    assert abs(_losses(trainer)[0] - math.log(labels)) < 0.3


def test_a_classifier_with_a_blown_up_head_is_judged_against_ln_labels(make_trainer: Any, tokenizer: Any, lm_rows: Any) -> None:
    model = build_tiny_model("bert", tokenizer, "sequence_classification", num_labels=3, hidden_size=32)
    model.classifier.bias.data.copy_(torch.tensor([40.0, 0.0, 0.0]))  # a head initialised to bet everything on one class
    trainer = make_trainer(model=model, train_dataset=_classification_rows(tokenizer, lm_rows, 3), max_steps=2)
    harness.attach(trainer, config={"plugins": ["loss_baseline"]})
    trainer.train()
    (finding,) = findings_of(trainer.args.output_dir, "INITIAL_LOSS_ANOMALY")
    assert finding["evidence"]["basis"] == "ln(num_labels=3)" and "far above" in finding["message"]


def test_a_regression_head_is_not_judged_and_says_so_once(make_trainer: Any, tokenizer: Any, lm_rows: Any) -> None:
    model = build_tiny_model("bert", tokenizer, "sequence_classification", num_labels=1, hidden_size=32)
    trainer = make_trainer(model=model, train_dataset=_classification_rows(tokenizer, lm_rows, 1, float_labels=True), max_steps=8)
    harness.attach(trainer, config=QUIET)
    trainer.train()
    assert [(f["code"], f["severity"]) for f in findings_of(trainer.args.output_dir)] == [("LOSS_UNANCHORED", "info")]
    assert "regression" in findings_of(trainer.args.output_dir)[0]["message"]


def test_float_labels_on_a_multi_label_head_are_not_judged(make_trainer: Any, tokenizer: Any, lm_rows: Any) -> None:
    """problem_type unset: transformers picks multi-label BCE for float labels; the start is not held against ln(labels)."""
    from datasets import Dataset

    rows = _classification_rows(tokenizer, lm_rows, 3)
    rows = Dataset.from_dict({**rows.to_dict(), "labels": [[float(i % 2), 1.0, 0.0] for i in range(len(rows))]})
    model = build_tiny_model("bert", tokenizer, "sequence_classification", num_labels=3, hidden_size=32)
    trainer = make_trainer(model=model, train_dataset=rows, max_steps=4)
    harness.attach(trainer, config=QUIET)
    trainer.train()
    assert [f["code"] for f in findings_of(trainer.args.output_dir)] == ["LOSS_UNANCHORED"]


def test_an_eval_loss_that_climbs_while_training_memorises_is_eval_loss_rising(make_trainer: Any, tokenizer: Any, lm_rows: Any) -> None:
    """Eight training rows learnt by heart over 60 steps: the training loss falls to near 0, the eval loss on other rows climbs."""
    trainer = make_trainer(train_dataset=lm_rows.select(range(8)), eval_dataset=lm_rows.select(range(48, 64)), max_steps=60,
                           learning_rate=1e-2, eval_strategy="steps", eval_steps=10, per_device_eval_batch_size=16)
    harness.attach(trainer, config=QUIET)
    trainer.train()
    evals = [h["eval_loss"] for h in trainer.state.log_history if "eval_loss" in h]
    (rising,) = findings_of(trainer.args.output_dir, "EVAL_LOSS_RISING")
    assert rising["severity"] == "info" and "training loss fell" in rising["message"], evals  # overfitting: information
    assert rising["evidence"]["eval_loss"] > min(evals) * 1.05


def _sentence_count_rows(tokenizer: Any, labels: int) -> Any:
    """Corpus lines labelled by how many sentences they hold (a task a tiny classifier half learns in 30 steps)."""
    from datasets import Dataset

    from harness.lib.tiny import corpus_lines

    lines = corpus_lines()
    rows = Dataset.from_dict({"text": lines, "label": [min(line.count(". ") + 1, labels) - 1 for line in lines]})
    return rows.map(lambda r: tokenizer(r["text"], truncation=True, max_length=48), remove_columns=["text"])


def _classifier_run(family: str, tokenizer: Any, make_trainer: Any, faults: dict[str, Any], **args: Any) -> Any:
    from transformers import DataCollatorWithPadding

    model = build_tiny_model(family, tokenizer, "sequence_classification", num_labels=2)
    trainer = make_trainer(model=model, train_dataset=_sentence_count_rows(tokenizer, 2), data_collator=DataCollatorWithPadding(tokenizer),
                           max_steps=40, per_device_train_batch_size=32, **args)
    harness.attach(trainer, config={"plugins": ["defaults", FAULTS], "fault_injector": faults})
    trainer.train()
    return trainer


@pytest.mark.slow  # 40 steps of batch 32
def test_a_corrupted_batch_of_a_classifier_with_32_rows_is_a_loss_spike_at_its_step(make_trainer: Any, tokenizer: Any) -> None:
    """Random tokens with wrong labels in the batch of step 35 of a GPT-2 classifier (batch 32): LOSS_SPIKE there, the
    sampling floor of 32 rows (level/sqrt(32)) notwithstanding; nothing else loud."""
    trainer = _classifier_run("gpt2", tokenizer, make_trainer, {"corrupt_at_steps": [35]})
    spikes = findings_of(trainer.args.output_dir, "LOSS_SPIKE")
    assert [f["step"] for f in spikes] == [35], _loud(trainer.args.output_dir)
    assert {code for code, _ in _loud(trainer.args.output_dir)} <= {"LOSS_SPIKE", "FAULT_REPRODUCED", "DUPLICATE_SAMPLES", "GRAD_NORM_SPIKE"}


@pytest.mark.slow  # 40 steps of batch 32
def test_a_classifier_whose_learning_rate_blows_up_is_above_its_start_and_not_recovered(make_trainer: Any, tokenizer: Any) -> None:
    """1000x the learning rate from step 10 of a Llama classifier: the loss goes far over ln 2 at once."""
    trainer = _classifier_run("llama", tokenizer, make_trainer, {"lr_scale_from_step": 10, "lr_scale": 1000.0})
    (above,) = findings_of(trainer.args.output_dir, "LOSS_ABOVE_START")[:1]
    assert 10 <= above["step"] <= 12 and above["evidence"]["untrained_basis"] == "ln(num_labels=2)"
    assert above["evidence"]["earlier_findings"][0]["code"] == "LR_SCHEDULE_MISMATCH"  # the cause the run found first
    assert [f["severity"] for f in findings_of(trainer.args.output_dir, "LOSS_NOT_RECOVERED")] == ["warning"]
