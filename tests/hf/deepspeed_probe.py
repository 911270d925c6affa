"""Run by test_optimizer_deepspeed.py in its own process: a real DeepSpeed engine on CPU, the harness guard on its optimizer.

One process, ``torch.distributed`` over gloo (``DS_ACCELERATOR=cpu``), so the
pytest process never holds a process group. For each ZeRO stage given on the
command line it skips step 1 through the guard, lets step 2 through, and
prints one JSON line per stage with what changed.
"""
from __future__ import annotations

import json
import os
import socket
import sys
import tempfile
from pathlib import Path
from typing import Any


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def _flat_state(optimizer: Any) -> list[Any]:
    import torch

    inner = getattr(optimizer, "optimizer", optimizer)
    return [v.detach().clone() for s in inner.state.values() for v in s.values() if torch.is_tensor(v) and v.dim() > 0]


def run_stage(stage: int, run_dir: Path) -> dict[str, Any]:
    import deepspeed
    import torch

    from harness.core.actions import Action
    from harness.hf.guard import StepGuard
    from harness.hf.optimizers.deepspeed import guard_deepspeed_optimizer, has_overflow_path
    from harness.hf.step_record import StepRecord
    from unit_context import run_context

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Tanh(), torch.nn.Linear(8, 2))
    config = {
        "train_micro_batch_size_per_gpu": 4,
        "gradient_accumulation_steps": 1,
        "optimizer": {"type": "AdamW", "params": {"lr": 0.05, "torch_adam": True}},
        "scheduler": {"type": "WarmupLR", "params": {"warmup_min_lr": 0.01, "warmup_max_lr": 0.05, "warmup_num_steps": 10}},
        "zero_optimization": {"stage": stage},
    }
    engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=config)
    ctx, _ = run_context(run_dir)
    record = StepRecord()
    guard = StepGuard(ctx, lambda: record, in_training_step=lambda: True)
    optimizer = engine.optimizer
    guard_deepspeed_optimizer(optimizer, guard, engine)
    x, y = torch.randn(4, 8), torch.randn(4, 2)

    def params() -> list[Any]:
        with deepspeed.zero.GatheredParameters(list(engine.module.parameters()), enabled=stage == 3):
            return [p.detach().clone() for p in engine.module.parameters()]

    def step(action: Action) -> None:
        ctx.pending_action = action
        loss = torch.nn.functional.mse_loss(engine(x), y)
        engine.backward(loss)
        engine.step()

    step(Action.CONTINUE)  # optimizer state exists from here on
    before, state_before = params(), _flat_state(optimizer)
    schedule_before = engine.lr_scheduler.last_batch_iteration
    scale_before = getattr(optimizer, "loss_scale", None)
    step(Action.SKIP_STEP)
    after_skip, state_after_skip = params(), _flat_state(optimizer)
    schedule_after_skip = engine.lr_scheduler.last_batch_iteration
    skipped_agreed = record.agreed.value
    overflow_after_skip = bool(getattr(optimizer, "overflow", False))
    step(Action.CONTINUE)
    after_go = params()
    schedule_after_go = engine.lr_scheduler.last_batch_iteration
    return {
        "stage": stage,
        "optimizer": type(optimizer).__name__,
        "overflow_path": has_overflow_path(optimizer),
        "agreed": skipped_agreed,
        "params_equal_after_skip": all(torch.equal(a, b) for a, b in zip(before, after_skip)),
        "state_tensors": len(state_before),
        "state_equal_after_skip": len(state_before) == len(state_after_skip)
        and all(torch.equal(a, b) for a, b in zip(state_before, state_after_skip)),
        "lr_held": schedule_before == schedule_after_skip,
        "overflow_after_skip": overflow_after_skip,
        "loss_scale_kept": getattr(optimizer, "loss_scale", None) == scale_before,
        "skipped_steps": int(engine.skipped_steps),
        "global_steps": int(engine.global_steps),
        "lr_moved_after_continue": schedule_after_go == schedule_after_skip + 1,
        "params_changed_after_continue": sum(not torch.equal(a, b) for a, b in zip(after_skip, after_go)),
        "not_applied": [f.message for f in ctx.findings if f.code == "SKIP_NOT_APPLIED"],
        "optimizer_skipped_after_continue": record.optimizer_skipped,
    }


def main() -> None:
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(_free_port()), RANK="0", LOCAL_RANK="0", WORLD_SIZE="1")
    sys.path.insert(0, str(Path(__file__).parent))
    import deepspeed

    deepspeed.init_distributed(dist_backend="gloo")
    with tempfile.TemporaryDirectory() as tmp:
        for stage in [int(s) for s in sys.argv[1:]]:
            print("PROBE " + json.dumps(run_stage(stage, Path(tmp) / f"stage-{stage}" / "harness")), flush=True)


if __name__ == "__main__":
    main()
