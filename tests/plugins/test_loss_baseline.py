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


def test_a_second_train_call_checks_its_first_loss_again(make_trainer: Any) -> None:
    """The step-end hook idles after the first step's check; the next train() call wakes it for its own first step."""
    trainer = make_trainer(max_steps=2)
    for p in trainer.model.lm_head.parameters():
        p.data.mul_(200.0)
    ctx = harness.attach(trainer, config={"plugins": ["loss_baseline"]})
    trainer.train()
    assert ctx.manager.is_idle("loss_baseline", "on_step_end")
    for p in trainer.model.lm_head.parameters():
        p.data.mul_(200.0)  # blown up again for the second call
    trainer.train()
    assert len(findings_of(trainer.args.output_dir, "INITIAL_LOSS_ANOMALY")) == 2


@pytest.mark.parametrize(("expect", "severity"), [("scratch", "warning"), ("auto", None)])
def test_a_model_that_already_knows_the_data_is_far_below(make_trainer: Any, lm_rows: Any, tmp_path: Any, expect: str, severity: str | None) -> None:
    """Told 'scratch', a low first loss is a warning; 'auto' sees trained weights (norms moved) and expects it low."""
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
    found = findings_of(again.args.output_dir, "INITIAL_LOSS_ANOMALY")
    if severity is None:
        assert found == []
        return
    (finding,) = found
    assert finding["severity"] == severity and finding["evidence"]["ratio"] < 0.5 and "far below" in finding["message"]
    assert finding["evidence"]["weights"] == "trained"


def test_micro_batches_with_every_label_masked(make_trainer: Any, lm_rows: Any) -> None:
    rows = lm_rows.select(range(16)).map(lambda row, i: {"labels": [-100] * len(row["labels"]) if 8 <= i < 12 else row["labels"]}, with_indices=True)
    trainer = make_trainer(max_steps=4, train_sampling_strategy="sequential")
    trainer.train_dataset = rows
    harness.attach(trainer, config={"plugins": ["loss_baseline"]})
    trainer.train()
    (finding,) = findings_of(trainer.args.output_dir, "ALL_LABELS_MASKED")
    assert finding["step"] == 3 and finding["evidence"]["micro_batches"] == [0]
    # a plain Trainer with its own collator: the check is the collator's and the dataset's, not TRL's max_length
    assert finding["evidence"]["trainer"] == "Trainer" and finding["evidence"]["max_length"] is None
    assert "max_length" not in finding["message"] and "decode one of these micro-batches' rows" in finding["message"]


def test_an_all_masked_batch_s_nan_loss_names_the_masked_batch_as_its_cause(make_trainer: Any, lm_rows: Any) -> None:
    """The Trainer's per-token mean over no labelled token is 0/0: NONFINITE_LOSS says the batch is the cause, not a module."""
    rows = lm_rows.select(range(16)).map(lambda row, i: {"labels": [-100] * len(row["labels"]) if 8 <= i < 12 else row["labels"]}, with_indices=True)
    trainer = make_trainer(max_steps=4, train_sampling_strategy="sequential")
    trainer.train_dataset = rows
    harness.attach(trainer, config={"plugins": ["loss_baseline", "nan_guard"]})
    trainer.train()
    (nan,) = findings_of(trainer.args.output_dir, "NONFINITE_LOSS")
    assert nan["step"] == 3 and nan["evidence"]["all_labels_masked"] == [0]
    assert "the masked batch is the cause" in nan["message"] and "first_nonfinite_module" not in nan["evidence"]


def test_trl_sft_s_masked_labels_check_names_max_length() -> None:
    from trl import SFTConfig

    from harness.plugins.loss_baseline import masked_labels_check

    class SFTTrainer:  # the check reads the class name and its arguments only
        args = SFTConfig(output_dir="unused", max_length=128, completion_only_loss=True, report_to="none", use_cpu=True, bf16=False)
        data_collator = None

    check = masked_labels_check(SFTTrainer())
    assert check.max_length == 128 and "truncates at max_length=128" in check.check


def _trainer(tmp_path: Any, tokenizer: Any, rows: Any, cls: Any = None, model: Any = None, **args: Any) -> Any:
    from transformers import Trainer, TrainingArguments

    from harness.lib.tiny import build_tiny_llama

    settings = dict(output_dir=str(tmp_path / "out"), max_steps=2, per_device_train_batch_size=2, gradient_accumulation_steps=4,
                    learning_rate=1e-3, report_to="none", logging_steps=1, use_cpu=True, save_strategy="no", disable_tqdm=True, seed=0)
    settings.update(args)
    return (cls or Trainer)(model=model or build_tiny_llama(tokenizer, seed=0), args=TrainingArguments(**settings), train_dataset=rows)


def _per_micro_batch_mean() -> type:
    from transformers import Trainer

    class PerMicroBatchMean(Trainer):
        def compute_loss(self, model: Any, inputs: Any, return_outputs: bool = False, num_items_in_batch: Any = None) -> Any:
            outputs = model(**inputs)  # ignores num_items_in_batch: the GA trap
            return (outputs.loss, outputs) if return_outputs else outputs.loss

    return PerMicroBatchMean


def test_a_compute_loss_that_ignores_num_items_in_batch_is_ga_loss_scaling(tmp_path: Any, tokenizer: Any, lm_rows: Any) -> None:
    trainer = _trainer(tmp_path, tokenizer, lm_rows, cls=_per_micro_batch_mean())
    harness.attach(trainer, config={"plugins": ["loss_baseline"]})
    trainer.train()
    (finding,) = findings_of(trainer.args.output_dir, "GA_LOSS_SCALING")
    ev = finding["evidence"]
    assert finding["step"] == 1 and ev["scale"] == 4 and 3.5 < ev["factor"] < 4.5
    assert ev["micro_batch_loss"] == pytest.approx(ev["recomputed_micro_batch_mean"], rel=1e-4) and ev["model_accepts_loss_kwargs"] is True
    assert findings_of(trainer.args.output_dir, "INITIAL_LOSS_ANOMALY") == []  # 4x ln(V) is explained, not blamed on init


def test_the_playbook_fix_loss_is_scaled_for_ga_false_silences_it(tmp_path: Any, tokenizer: Any, lm_rows: Any) -> None:
    fixed = type("Fixed", (_per_micro_batch_mean(),), {"loss_is_scaled_for_ga": False})  # the Trainer now divides by GA
    trainer = _trainer(tmp_path, tokenizer, lm_rows, cls=fixed)
    harness.attach(trainer, config={"plugins": ["loss_baseline"]})
    trainer.train()
    assert findings_of(trainer.args.output_dir) == []


def test_a_loss_divided_twice_is_ga_loss_scaling_below_one(tmp_path: Any, tokenizer: Any, lm_rows: Any) -> None:
    from transformers import Trainer

    class DividedTwice(Trainer):
        loss_is_scaled_for_ga = False  # wrong: the model already normalised by num_items_in_batch

    trainer = _trainer(tmp_path, tokenizer, lm_rows, cls=DividedTwice)
    harness.attach(trainer, config={"plugins": ["loss_baseline"]})
    trainer.train()
    (finding,) = findings_of(trainer.args.output_dir, "GA_LOSS_SCALING")
    assert finding["evidence"]["scale"] == 0.25 and 0.2 < finding["evidence"]["factor"] < 0.3 and "1/4" in finding["message"]
    assert findings_of(trainer.args.output_dir, "INITIAL_LOSS_ANOMALY") == []


def test_the_trainers_own_loss_with_gradient_accumulation_is_silent(tmp_path: Any, tokenizer: Any, lm_rows: Any) -> None:
    trainer = _trainer(tmp_path, tokenizer, lm_rows)
    harness.attach(trainer, config={"plugins": ["loss_baseline"]})
    trainer.train()
    assert findings_of(trainer.args.output_dir) == []


@pytest.mark.slow  # 30 warm-up steps before the run under test
def test_trained_weights_with_labels_that_copy_the_input_still_leak(tmp_path: Any, tokenizer: Any, lm_rows: Any) -> None:
    """A collator bug that needs no ln(V): after the model's own shift every target is the token at the same position."""
    leaky = lm_rows.map(lambda row: {"labels": [-100, *row["input_ids"][:-1]]})
    warm = _trainer(tmp_path / "warm", tokenizer, leaky, max_steps=30, gradient_accumulation_steps=1, per_device_train_batch_size=8, learning_rate=3e-3)
    warm.train()  # learns to copy: a low first loss for the next run
    again = _trainer(tmp_path / "again", tokenizer, leaky, model=warm.model, max_steps=1, gradient_accumulation_steps=1)
    harness.attach(again, config={"plugins": ["loss_baseline"]})
    again.train()
    (finding,) = findings_of(again.args.output_dir, "INITIAL_LOSS_ANOMALY")
    ev = finding["evidence"]
    assert ev["weights"] == "trained" and ev["ratio"] < 0.5 and ev["copy_fraction"] > 0.9 and "leak" in finding["message"]


def test_a_classifier_whose_loss_ignores_num_items_in_batch_is_ga_loss_scaling_naming_the_head(tmp_path: Any, tokenizer: Any) -> None:
    """BertForSequenceClassification accepts loss kwargs but means over its own micro-batch: the Trainer, which then
    does not divide by gradient_accumulation_steps, makes the step loss GA times ln(3). One label per row (1-D): the
    recomputation once covered causal LMs only, and this run was silent."""
    from datasets import Dataset
    from transformers import DataCollatorWithPadding

    from harness.lib.tiny import corpus_lines
    from harness.lib.tiny_zoo import build_tiny_model

    lines = corpus_lines()[:16]
    rows = Dataset.from_dict({"text": lines, "label": [i % 3 for i in range(len(lines))]})
    rows = rows.map(lambda r: tokenizer(r["text"], truncation=True, max_length=32), remove_columns=["text"])
    trainer = _trainer(tmp_path, tokenizer, rows, model=build_tiny_model("bert", tokenizer, "sequence_classification", num_labels=3),
                       max_steps=1, gradient_accumulation_steps=2)
    trainer.data_collator = DataCollatorWithPadding(tokenizer)
    harness.attach(trainer, config={"plugins": ["loss_baseline"]})
    trainer.train()
    (finding,) = findings_of(trainer.args.output_dir, "GA_LOSS_SCALING")
    ev = finding["evidence"]
    assert finding["step"] == 1 and ev["scale"] == 2 and 1.6 < ev["factor"] < 2.4
    assert "BertForSequenceClassification's loss returned micro-batch 0's own mean" in finding["message"]
    assert findings_of(trainer.args.output_dir, "INITIAL_LOSS_ANOMALY") == []  # 2 ln 3 is explained, not blamed on init
