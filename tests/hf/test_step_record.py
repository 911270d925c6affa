"""The step record: a fresh one per step, nothing carried over but the next step's data-loader time. No Trainer."""
from __future__ import annotations

import dataclasses
from pathlib import Path
from types import SimpleNamespace

import torch

from harness.core.actions import Action
from harness.hf.bridge import Bridge
from harness.hf.loss_probe import LossProbe
from harness.hf.step_record import StepRecord
from harness.hf.tap import MicroBatchTap, _TimedIterator
from unit_context import run_context


def _used(record: StepRecord) -> StepRecord:
    """A record as a step leaves it: every field set."""
    record.add_micro_batch_loss(torch.tensor(1.0))
    record.add_step_loss_part(torch.tensor(0.5), torch.tensor(1.0))
    record.tokens, record.grad_norm, record.lr, record.logged_loss = 64, 2.0, 0.1, 1.0
    record.agreed, record.values_read, record.optimizer_skipped = Action.SKIP_STEP, True, True
    record.model_time, record.guard_time = 0.3, 0.01
    record.add_local_items(torch.tensor(3), torch.tensor(8.0), 2)
    record.add_own_mean_share(2)
    record.probe = LossProbe(torch.tensor(1.0), torch.tensor(3), torch.tensor(8.0), 2, "BertForSequenceClassification's loss")
    return record


def test_a_new_record_carries_only_the_data_time() -> None:
    fresh, default = StepRecord(data_time=0.25), StepRecord()
    for field in dataclasses.fields(StepRecord):
        if field.name != "data_time":
            assert getattr(fresh, field.name) == getattr(default, field.name), field.name
    assert fresh.data_time == 0.25
    # and every field a step can set differs from the default, so the comparison above can fail
    used = _used(StepRecord())
    assert all(getattr(used, f.name) != getattr(default, f.name) for f in dataclasses.fields(StepRecord) if f.name != "data_time")


def test_step_begin_replaces_the_record_with_the_tap_s_carried_data_time(tmp_path: Path) -> None:
    ctx, _ = run_context(tmp_path / "harness")
    tap = MicroBatchTap(ctx, trainer=None, record=lambda: bridge.record)
    old = _used(StepRecord(data_time=9.0))
    bridge = SimpleNamespace(ctx=ctx, tap=tap, record=old)
    tap.add_data_time(0.5)
    tap.add_data_time(0.25)  # the Trainer fetched this step's micro-batches before the step began
    ctx.micro_step = 2
    Bridge.step_begin(bridge)  # type: ignore[arg-type]
    assert bridge.record is not old and bridge.record == StepRecord(data_time=0.75)
    assert ctx.micro_step == 0
    assert old.tokens == 64 and old.agreed is Action.SKIP_STEP  # the finished step's record is left as it was
    Bridge.step_begin(bridge)  # type: ignore[arg-type]
    assert bridge.record == StepRecord()  # the data time was taken once


def test_the_timed_iterator_adds_the_wait_to_the_tap() -> None:
    waits: list[float] = []
    timed = _TimedIterator(iter([1, 2]), waits.append)
    assert list(timed) == [1, 2]
    assert len(waits) == 3 and all(w >= 0 for w in waits)  # two items and the StopIteration


def test_losses_are_summed_on_the_device_and_micro_batches_counted() -> None:
    record = StepRecord()
    record.add_micro_batch_loss(torch.tensor(1.0))
    record.add_micro_batch_loss(torch.tensor(2.0))
    record.add_step_loss_part(torch.tensor(0.5), torch.tensor(1.0))
    record.add_step_loss_part(torch.tensor(1.0), torch.tensor(2.0))
    assert torch.is_tensor(record.loss_sum) and float(record.loss_sum) == 3.0
    assert float(record.step_loss) == 1.5 and record.micro_batches == 2
    assert [float(m) for m in record.micro_losses] == [1.0, 2.0]  # each micro-batch's own loss, still on the device


def test_metrics_say_what_the_step_did() -> None:
    record = StepRecord(data_time=0.2)
    record.step_loss, record.grad_norm, record.lr, record.tokens = 1.5, 2.0, 0.01, 128
    record.model_time, record.guard_time, record.optimizer_skipped = 0.5, 0.25, True
    metrics = record.metrics(step_time=1.0)
    assert metrics == {
        "loss": 1.5, "grad_norm": 2.0, "lr": 0.01, "skipped": False, "optimizer_skipped": True, "action": "continue",
        "micro_batches": 0, "tokens": 128, "step_time": 1.0, "data_time": 0.2, "model_time": 0.75,
    }
    record.agreed = Action.SKIP_STEP  # the harness skipped: the optimizer's own skip is not counted on top
    skipped = record.metrics(step_time=None)
    assert skipped["skipped"] and not skipped["optimizer_skipped"] and skipped["action"] == "skip_step"


def test_a_rank_s_scaled_share_of_the_loss_becomes_its_own_mean() -> None:
    """Two ranks averaging tokens: this rank has 3 of the step's 8 labels, their loss sum 6.0. The Trainer hands it
    6.0 / 8 * 2 = 1.5 (over two micro-batches, 1.0 + 0.5); its own mean loss is 6.0 / 3 = 2.0."""
    from harness.hf.guard import StepGuard

    record = StepRecord(step_loss=1.5, logged_loss=1.5, micro_losses=[1.0, 0.5], items_scale=2)
    record.local_items, record.global_items = torch.tensor(3), torch.tensor(8.0)
    StepGuard._to_rank_mean(record, [3], [8.0])
    assert record.step_loss == 2.0 and record.logged_loss == 2.0
    assert record.micro_losses == [1.0 * 8 / 6, 0.5 * 8 / 6]  # each micro-batch's share of the rank's mean
    untouched = StepRecord(step_loss=0.0, items_scale=2)
    StepGuard._to_rank_mean(untouched, [0], [8.0])  # no label on this rank: nothing to divide by
    assert untouched.step_loss == 0.0


def test_a_head_s_own_mean_scaled_by_the_world_size_becomes_the_rank_s_mean_without_label_counts() -> None:
    """BERT's classifier on two ranks: each micro-batch's loss is its own mean times 2 (the Trainer's scale)."""
    from harness.hf.guard import StepGuard

    record = StepRecord(step_loss=2.2, logged_loss=2.2, micro_losses=[2.2])
    record.add_own_mean_share(2)
    StepGuard._to_rank_mean(record, [], [])
    assert record.step_loss == 1.1 and record.logged_loss == 1.1 and record.micro_losses == [1.1]
