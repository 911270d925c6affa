"""The cross-rank loss trap, judged from one micro-batch's loss, its own mean and the label counts (pure logic, and the
recomputed mean of heads other than a causal LM's)."""
from __future__ import annotations

import math
from typing import Any

import pytest
import torch

from harness.lib.world_scaling import judge_world_scaling, label_count, loss_source, own_mean_loss, world_loss_scale

# two ranks, no accumulation, 8 labels each: num_items_in_batch 16; the micro-batch's own mean 1.1
MEAN, LOCAL, GLOBAL = 1.1, 8.0, 16.0


@pytest.mark.parametrize(
    ("loss", "verdict"),
    [
        (2 * MEAN, True),  # BERT's classifier: its own mean, times the world size
        (2 * MEAN * 1.15, True),  # dropout in training, none in the eval-mode recomputation
        (2 * MEAN * LOCAL / GLOBAL, False),  # normalised by num_items_in_batch: the Trainer's assumption holds
        (2 * MEAN * LOCAL / GLOBAL * 0.9, False),
        (2 * MEAN * 5, None),  # neither: a loss this cannot read (a custom compute_loss) is no judgement
    ],
)
def test_the_loss_is_read_as_the_nearer_of_own_mean_and_normalised(loss: float, verdict: bool | None) -> None:
    assert judge_world_scaling(loss, MEAN, LOCAL, GLOBAL, scale=2) is verdict


def test_uneven_ranks_and_accumulation_move_the_normalised_reading_not_the_own_mean() -> None:
    # rank 0 holds 30 of 40 labels: normalised, its loss is 2 x 1.1 x 0.75 = 1.65; its own mean times two is 2.2
    assert judge_world_scaling(2 * MEAN * 30 / 40, MEAN, 30, 40, scale=2) is False
    assert judge_world_scaling(2 * MEAN, MEAN, 30, 40, scale=2) is True
    # four processes, accumulation 2: the first micro-batch holds 1/8 of the step's labels
    assert judge_world_scaling(4 * MEAN, MEAN, 8, 64, scale=4) is True
    assert judge_world_scaling(4 * MEAN / 8, MEAN, 8, 64, scale=4) is False


def test_no_judgement_when_the_readings_cannot_be_told_apart_or_numbers_are_missing() -> None:
    assert judge_world_scaling(2.2, MEAN, 19, 20, scale=2) is None  # this rank held 95% of the step's labels
    assert judge_world_scaling(2.2, MEAN, 8, 16, scale=1) is None  # no scaling
    assert judge_world_scaling(math.nan, MEAN, 8, 16, scale=2) is None
    assert judge_world_scaling(2.2, MEAN, 0, 16, scale=2) is None  # no label on this rank's micro-batch
    assert judge_world_scaling(2.2, 0.0, 8, 16, scale=2) is None


def test_labels_are_counted_as_the_trainer_counts_num_items_in_batch() -> None:
    labels = torch.tensor([[-100, 3, 4, -100], [5, 6, 7, 8]])
    assert int(label_count({"labels": labels}, shifts_labels=False)) == 6
    assert int(label_count({"labels": labels}, shifts_labels=True)) == 5  # a causal LM's first position predicts nothing
    assert int(label_count({"labels": torch.tensor([0, 2, 1])}, shifts_labels=False)) == 3  # a classifier: one per row
    assert label_count({"input_ids": labels}, shifts_labels=False) is None


def _trainer(tmp_path: Any, model: Any, **args: Any) -> Any:
    from transformers import Trainer, TrainingArguments

    return Trainer(model=model, args=TrainingArguments(output_dir=str(tmp_path), use_cpu=True, report_to="none", **args))


@pytest.mark.parametrize("family", ["bert", "llama"])
def test_a_classifier_s_own_mean_is_the_mean_over_its_rows(tmp_path: Any, tokenizer: Any, family: str) -> None:
    from harness.lib.tiny_zoo import build_tiny_model

    trainer = _trainer(tmp_path, build_tiny_model(family, tokenizer, "sequence_classification", num_labels=3))
    encoded = tokenizer(["one short line.", "a longer line here. and a second.", "three"], padding=True, return_tensors="pt")
    batch = {**encoded, "labels": torch.tensor([0, 1, 2])}
    mean = own_mean_loss(trainer, batch)
    with torch.no_grad():
        trainer.model.eval()
        reference = trainer.model(**batch).loss  # the head's own CrossEntropyLoss mean over the micro-batch
        trainer.model.train()
    assert trainer.model.training and float(mean) == pytest.approx(float(reference), rel=1e-4)
    assert not trainer._loss_shifts_labels and trainer.model_accepts_loss_kwargs  # why the Trainer scales its loss


def test_without_labels_there_is_nothing_to_recompute(tmp_path: Any, tokenizer: Any) -> None:
    from harness.lib.tiny import build_tiny_llama

    trainer = _trainer(tmp_path, build_tiny_llama(tokenizer, seed=0))
    assert own_mean_loss(trainer, {"input_ids": torch.tensor([[1, 2, 3]])}) is None


def test_the_loss_source_names_the_head_a_subclass_or_a_loss_function(tmp_path: Any, tokenizer: Any) -> None:
    from transformers import Trainer, TrainingArguments

    from harness.lib.tiny_zoo import build_tiny_model

    model = build_tiny_model("bert", tokenizer, "sequence_classification", num_labels=3)
    assert loss_source(_trainer(tmp_path, model)) == "BertForSequenceClassification's loss"

    class Mine(Trainer):
        def compute_loss(self, *args: Any, **kwargs: Any) -> Any:
            return super().compute_loss(*args, **kwargs)

    args = TrainingArguments(output_dir=str(tmp_path), use_cpu=True, report_to="none")
    assert loss_source(Mine(model=model, args=args)) == "Mine.compute_loss"

    def focal(outputs: Any, labels: Any, num_items_in_batch: Any = None) -> Any:
        return outputs.logits.sum()

    assert loss_source(Trainer(model=model, args=args, compute_loss_func=focal)).startswith("compute_loss_func ")


def test_one_process_is_never_scaled(tmp_path: Any, tokenizer: Any) -> None:
    from harness.lib.tiny import build_tiny_llama

    trainer = _trainer(tmp_path, build_tiny_llama(tokenizer, seed=0))
    assert trainer.args.average_tokens_across_devices and world_loss_scale(trainer) == 1
