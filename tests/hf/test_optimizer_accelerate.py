"""The accelerate optimizer guard on a real ``AcceleratedOptimizer``: a skip changes nothing, a continue steps."""
from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from accelerate import Accelerator
from accelerate.optimizer import AcceleratedOptimizer

from harness.core.actions import Action
from harness.hf.guard import StepGuard
from harness.hf.optimizers.accelerate import guard_accelerated_optimizer
from harness.hf.step_record import StepRecord
from unit_context import run_context


def _setup(tmp_path: Path, optimizer_cls: type = torch.optim.AdamW) -> tuple[Any, Any, Any, StepRecord, Any]:
    ctx, _ = run_context(tmp_path / "harness")
    record = StepRecord()
    guard = StepGuard(ctx, lambda: record)
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 1))
    model, optimizer = Accelerator(cpu=True).prepare(model, optimizer_cls(model.parameters(), lr=0.1))
    assert isinstance(optimizer, AcceleratedOptimizer)
    guard_accelerated_optimizer(optimizer, guard, model)
    return ctx, model, optimizer, record, guard


def _backward(model: Any) -> None:
    model(torch.randn(3, 4)).pow(2).sum().backward()


def _state(optimizer: Any) -> list[torch.Tensor]:
    return [v.clone() for s in optimizer.optimizer.state.values() for v in s.values() if torch.is_tensor(v)]


@pytest.mark.parametrize("optimizer_cls", [torch.optim.AdamW, torch.optim.SGD])
def test_skip_keeps_params_and_optimizer_state_and_continue_steps(tmp_path: Path, optimizer_cls: type) -> None:
    ctx, model, optimizer, record, _ = _setup(tmp_path, optimizer_cls)
    _backward(model)
    optimizer.step()  # a normal step first, so that AdamW has state to keep
    optimizer.zero_grad()
    params, state = [p.detach().clone() for p in model.parameters()], _state(optimizer)
    _backward(model)
    ctx.pending_action = Action.SKIP_STEP
    assert optimizer.step() is None
    assert all(torch.equal(a, b) for a, b in zip(params, model.parameters()))
    after = _state(optimizer)
    assert len(after) == len(state) and all(torch.equal(a, b) for a, b in zip(state, after))
    assert optimizer.step_was_skipped and record.agreed is Action.SKIP_STEP  # the Trainer holds the LR scheduler on this flag
    optimizer.zero_grad()
    _backward(model)
    optimizer.step()  # continue: the update happens and the skip flag is cleared
    assert not optimizer.step_was_skipped and record.agreed is Action.CONTINUE and not record.optimizer_skipped
    assert all(not torch.equal(a, b) for a, b in zip(params, model.parameters()))
    if optimizer_cls is torch.optim.AdamW:
        moments = [(a, b) for a, b in zip(state, _state(optimizer)) if a.dim() > 0]  # exp_avg, exp_avg_sq (not the step count)
        assert moments and all(not torch.equal(a, b) for a, b in moments)


def test_one_guard_per_step_after_a_second_install(tmp_path: Path) -> None:
    ctx, model, optimizer, _, guard = _setup(tmp_path)
    first = optimizer.step
    guard_accelerated_optimizer(optimizer, guard, model)  # a second train() call
    assert optimizer.step is first
    _backward(model)
    optimizer.step()
    assert len(ctx.manager.plugin("probe").before_step) == 1  # one guard ran: on_before_optimizer_step once


def test_a_skip_under_a_grad_scaler_keeps_the_scale_and_the_next_step_can_unscale(tmp_path: Path) -> None:
    ctx, _ = run_context(tmp_path / "harness")
    record = StepRecord()
    model = torch.nn.Linear(4, 1)
    scaler = torch.amp.GradScaler("cpu", init_scale=1024.0)
    optimizer = AcceleratedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), device_placement=False, scaler=scaler)
    guard_accelerated_optimizer(optimizer, StepGuard(ctx, lambda: record), model)
    weight = model.weight.detach().clone()
    scaler.scale(model(torch.ones(2, 4)).sum()).backward()
    scaler.unscale_(optimizer.optimizer)  # what the Trainer's gradient clipping does before the step
    ctx.pending_action = Action.SKIP_STEP
    optimizer.step()
    assert torch.equal(model.weight, weight) and scaler.get_scale() == 1024.0
    optimizer.zero_grad()
    scaler.scale(model(torch.ones(2, 4)).sum()).backward()
    scaler.unscale_(optimizer.optimizer)  # would raise "unscale_() has already been called" without the scaler reset
    optimizer.step()
    assert not torch.equal(model.weight, weight)
