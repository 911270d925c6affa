"""The DeepSpeed optimizer guard: a skip drives the engine's optimizer down its own overflow path.

The end-to-end case runs a real DeepSpeed engine per ZeRO stage on CPU in a
child process (``deepspeed_probe.py``: one process, gloo), so that this
pytest process never holds a ``torch.distributed`` process group.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

from harness.core.actions import Action
from harness.hf.guard import StepGuard
from harness.hf.optimizers.deepspeed import guard_deepspeed_optimizer, has_overflow_path, step_with_forced_overflow
from harness.hf.step_record import StepRecord
from unit_context import run_context

PROBE = Path(__file__).with_name("deepspeed_probe.py")


@pytest.mark.slow  # a DeepSpeed engine per ZeRO stage (about 20 s warm; the first build of DeepSpeed's CPU comm op takes minutes)
def test_a_skip_holds_on_a_real_deepspeed_engine_at_every_zero_stage() -> None:
    pytest.importorskip("deepspeed")
    env = {**os.environ, "DS_ACCELERATOR": "cpu", "PYTHONPATH": os.pathsep.join([str(PROBE.parent), os.environ.get("PYTHONPATH", "")])}
    done = subprocess.run([sys.executable, str(PROBE), "0", "1", "2", "3"], env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-4000:]
    results = {r["stage"]: r for r in (json.loads(line[len("PROBE "):]) for line in done.stdout.splitlines() if line.startswith("PROBE "))}
    assert sorted(results) == [0, 1, 2, 3], done.stdout[-2000:]
    expected = {0: ("AdamW", False), 1: ("DeepSpeedZeroOptimizer", True), 2: ("DeepSpeedZeroOptimizer", True),
                3: ("DeepSpeedZeroOptimizer_Stage3", True)}
    for stage, got in results.items():
        assert (got["optimizer"], got["overflow_path"]) == expected[stage], got
        assert got["agreed"] == "skip_step"
        assert got["params_equal_after_skip"] and got["state_tensors"] > 0 and got["state_equal_after_skip"], got
        assert got["overflow_after_skip"] and got["loss_scale_kept"] and got["lr_held"], got
        assert got["skipped_steps"] == 1 and got["global_steps"] == 3, got  # the engine counted the skip as its own
        assert got["not_applied"] == [], got
        # the measurement can fail: the update let through afterwards moves every parameter and the schedule
        assert got["params_changed_after_continue"] == 4 and got["lr_moved_after_continue"], got
        assert not got["optimizer_skipped_after_continue"]


def test_which_deepspeed_optimizers_have_an_overflow_path_to_force() -> None:
    pytest.importorskip("deepspeed")
    from deepspeed.runtime.zero.stage3 import DeepSpeedZeroOptimizer_Stage3
    from deepspeed.runtime.zero.stage_1_and_2 import DeepSpeedZeroOptimizer

    assert has_overflow_path(DeepSpeedZeroOptimizer) and has_overflow_path(DeepSpeedZeroOptimizer_Stage3)
    assert not has_overflow_path(torch.optim.AdamW)  # ZeRO stage 0, fp32: the plain torch optimizer


def _skipping_guard(tmp_path: Path) -> tuple[StepGuard, StepRecord, Any]:
    ctx, _ = run_context(tmp_path / "harness")
    record = StepRecord()
    return StepGuard(ctx, lambda: record, in_training_step=lambda: True), record, ctx


def test_a_plain_torch_optimizer_under_zero_stage_0_drops_the_gradients_and_flags_the_skip(tmp_path: Path) -> None:
    guard, record, ctx = _skipping_guard(tmp_path)
    layer = torch.nn.Linear(3, 3)
    optimizer = torch.optim.AdamW(layer.parameters(), lr=0.5)
    guard_deepspeed_optimizer(optimizer, guard, engine=layer)
    layer(torch.ones(2, 3)).sum().backward()
    before = layer.weight.detach().clone()
    ctx.pending_action = Action.SKIP_STEP
    assert optimizer.step() is None
    assert torch.equal(layer.weight, before) and layer.weight.grad is None and optimizer.overflow is True
    assert optimizer.state_dict()["state"] == {}  # no optimizer state was created by the skipped step
    layer(torch.ones(2, 3)).sum().backward()
    optimizer.step()  # let through: the flag the guard set is cleared first, the update happens
    assert optimizer.overflow is False and not torch.equal(layer.weight, before)
    assert record.agreed is Action.CONTINUE and not record.optimizer_skipped


def test_a_second_guard_on_the_same_optimizer_is_not_installed(tmp_path: Path) -> None:
    guard, _, _ = _skipping_guard(tmp_path)
    optimizer = torch.optim.SGD(torch.nn.Linear(2, 2).parameters(), lr=0.1)
    guard_deepspeed_optimizer(optimizer, guard, engine=None)
    first = optimizer.step
    guard_deepspeed_optimizer(optimizer, guard, engine=None)
    assert optimizer.step is first


class _Zero12Like(torch.optim.SGD):
    """The attributes ZeRO-1/2 has: an overflow check consulted by step, a loss-scale update, a bf16 check switch."""

    overflow = False

    def __init__(self, params: Any) -> None:
        super().__init__(params, lr=0.1)
        self.check_grad_overflow = False
        self.scale_updates = 0

    def check_overflow(self) -> bool:
        self.overflow = False
        return False

    def _update_scale(self, overflow: bool) -> None:
        self.scale_updates += 1

    def step(self, closure: Any = None) -> Any:
        overflow = self.check_overflow() if self.check_grad_overflow else False
        self._update_scale(overflow)
        if overflow:
            self.zero_grad(set_to_none=True)
            return None
        return super().step(closure)


def test_forced_overflow_answers_overflow_freezes_the_scale_and_restores_everything() -> None:
    layer = torch.nn.Linear(2, 2)
    optimizer = _Zero12Like(layer.parameters())
    layer(torch.ones(1, 2)).sum().backward()
    before = layer.weight.detach().clone()
    optimizer._global_grad_norm = 1.0
    step_with_forced_overflow(optimizer, optimizer.step, (), {})
    assert torch.equal(layer.weight, before) and optimizer.overflow is True
    assert optimizer.scale_updates == 0  # the loss scale did not move
    assert optimizer._global_grad_norm is None  # not inf: the gradients were not infinite
    assert optimizer.check_grad_overflow is False and "check_overflow" not in vars(optimizer) and "_update_scale" not in vars(optimizer)
    layer(torch.ones(1, 2)).sum().backward()
    optimizer.step()  # the real methods are back
    assert optimizer.scale_updates == 1 and not torch.equal(layer.weight, before)
