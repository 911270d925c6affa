"""Which learning rate the first update after a resume follows (pure logic, host floats)."""
from __future__ import annotations

import pytest
import torch

from harness.lib.lr_resume import base_lr, describe, judge_lr_at_resume, schedule_factor


def test_the_restored_schedule_wins_over_a_new_learning_rate() -> None:
    lr = judge_lr_at_resume(saved=5e-5, configured=2e-4, restored_base=5e-5, applied=5e-5 * 2 / 3, factor=2 / 3)
    assert lr.winner == "restored" and lr.configured_would_give == pytest.approx(2e-4 * 2 / 3)
    assert "NOT in effect" in describe(lr)


def test_a_new_learning_rate_in_the_schedule_is_in_effect() -> None:
    lr = judge_lr_at_resume(saved=5e-5, configured=2e-4, restored_base=2e-4, applied=2e-4 * 2 / 3, factor=2 / 3)
    assert lr.winner == "configured" and "(in effect" in describe(lr)


def test_without_a_known_factor_the_restored_base_decides() -> None:
    assert judge_lr_at_resume(5e-5, 2e-4, restored_base=5e-5, applied=4e-5, factor=None).winner == "restored"
    assert judge_lr_at_resume(5e-5, 2e-4, restored_base=2e-4, applied=4e-5, factor=None).winner == "configured"


def test_a_stale_first_lr_is_decided_by_the_base_and_an_lr_set_by_hand_by_neither() -> None:
    assert judge_lr_at_resume(5e-5, 2e-4, restored_base=5e-5, applied=0.0, factor=0.0).winner == "restored"
    # max_steps 10 -> 20 as well: the first update still uses optimizer.pt's stale LR (0, the old decay's end)
    assert judge_lr_at_resume(5e-5, 2e-4, restored_base=5e-5, applied=0.0, factor=0.5).winner == "restored"
    assert judge_lr_at_resume(5e-5, 2e-4, restored_base=None, applied=2e-4 * 0.5, factor=0.5).winner == "configured"
    lr = judge_lr_at_resume(5e-5, 2e-4, restored_base=1e-3, applied=5e-4, factor=0.5)
    assert lr.winner == "neither" and "follows neither" in describe(lr)


def test_factor_and_base_are_read_from_a_real_lambda_scheduler() -> None:
    from transformers import get_scheduler

    optimizer = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=1e-3)
    scheduler = get_scheduler("linear", optimizer, num_warmup_steps=0, num_training_steps=30)
    for _ in range(10):
        optimizer.step()
        scheduler.step()
    assert schedule_factor(scheduler) == pytest.approx(20 / 30) and base_lr(scheduler) == pytest.approx(1e-3)
    assert optimizer.param_groups[0]["lr"] == pytest.approx(1e-3 * schedule_factor(scheduler))
    assert schedule_factor(torch.optim.lr_scheduler.StepLR(optimizer, 5)) is None and base_lr(None) is None
