"""The gradient-accumulation loss trap, judged from the step loss and one recomputed micro-batch mean (pure logic)."""
from __future__ import annotations

import math
from typing import Any

import pytest
import torch

from harness.lib.ga_scaling import judge_ga_scaling
from harness.lib.world_scaling import own_mean_loss


@pytest.mark.parametrize(("step_loss", "scale"), [(24.2, 4.0), (6.1, None), (1.52, 0.25), (8.0, None)])
def test_a_step_loss_nearer_ga_times_the_mean_than_the_mean(step_loss: float, scale: float | None) -> None:
    found = judge_ga_scaling(step_loss, micro_loss=6.05, recomputed=6.05, accumulation=4)
    assert (found.scale if found else None) == scale  # 8.0 is 1.32x: below sqrt(4), micro-batches that differ


def test_no_accumulation_or_no_finite_numbers_is_no_judgement() -> None:
    assert judge_ga_scaling(24.0, 6.0, 6.0, accumulation=1) is None
    assert judge_ga_scaling(math.nan, 6.0, 6.0, accumulation=4) is None
    assert judge_ga_scaling(24.0, 6.0, 0.0, accumulation=4) is None


def test_the_recomputed_mean_is_the_token_weighted_mean_and_leaves_training_mode(tmp_path: Any, tokenizer: Any, lm_rows: Any) -> None:
    from transformers import Trainer, TrainingArguments

    from harness.lib.tiny import build_tiny_llama

    args = TrainingArguments(output_dir=str(tmp_path), use_cpu=True, report_to="none")
    trainer = Trainer(model=build_tiny_llama(tokenizer, seed=0), args=args)
    model = trainer.model
    batch = {k: torch.tensor(lm_rows[:3][k]) for k in ("input_ids", "labels", "attention_mask")}
    batch["labels"][1, :20] = -100  # rows with different label counts
    mean = own_mean_loss(trainer, batch)
    with torch.no_grad():
        model.eval()
        reference = model(**batch).loss  # HF's own per-token mean over the micro-batch
        model.train()
    assert model.training and float(mean) == pytest.approx(float(reference), rel=1e-5)
