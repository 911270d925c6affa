"""The step guard on a real run context (catalog, config, plugin manager): agreement, rollback, the one read. No Trainer."""
from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch

from harness.core.actions import Action
from harness.core.hookspecs import hookimpl
from harness.hf.guard import StepGuard, forget_late_skip
from harness.hf.step_record import StepRecord
from unit_context import run_context


def _guard(tmp_path: Path, policy: dict[str, str] | None = None, **kwargs: object) -> tuple[StepGuard, StepRecord, object, object]:
    ctx, probe = run_context(tmp_path / "harness", policy)
    record = StepRecord()
    return StepGuard(ctx, lambda: record, **kwargs), record, ctx, probe  # type: ignore[arg-type]


def test_nothing_pending_agrees_continue(tmp_path: Path) -> None:
    guard, record, ctx, _ = _guard(tmp_path)
    assert guard.guard(model=None, optimizer=None) is Action.CONTINUE
    assert record.agreed is Action.CONTINUE


@pytest.mark.parametrize("asked", ["skip_step", "save_and_stop", "stop"])
def test_a_finding_s_action_becomes_the_agreed_action_and_the_pending_one_is_consumed(tmp_path: Path, asked: str) -> None:
    guard, record, ctx, _ = _guard(tmp_path, {"PROBE_FAULT": asked})
    finding = ctx.report("PROBE_FAULT", "bad batch", plugin="probe")
    assert finding.action == asked and ctx.pending_action is Action(asked)
    assert guard.guard(model=None, optimizer=None) is Action(asked)
    assert record.agreed is Action(asked)
    assert ctx.pending_action is Action.CONTINUE  # agreed once: the next step starts clean
    assert guard.guard(model=None, optimizer=None) is Action.CONTINUE


def test_rollback_without_a_handler_saves_and_stops(tmp_path: Path) -> None:
    guard, record, ctx, _ = _guard(tmp_path, {"PROBE_FAULT": "rollback"})
    ctx.report("PROBE_FAULT", "bad batch", plugin="probe")
    assert guard.guard(model=None, optimizer=None) is Action.SAVE_AND_STOP
    assert record.agreed is Action.SAVE_AND_STOP


def test_rollback_with_a_handler_stays_a_rollback(tmp_path: Path) -> None:
    guard, record, ctx, _ = _guard(tmp_path, {"PROBE_FAULT": "rollback"}, rollback_available=True)
    ctx.report("PROBE_FAULT", "bad batch", plugin="probe")
    assert guard.guard(model=None, optimizer=None) is Action.ROLLBACK


def test_the_strongest_pending_action_wins(tmp_path: Path) -> None:
    guard, _, ctx, _ = _guard(tmp_path, {"PROBE_FAULT": "skip_step"})
    ctx.report("PROBE_FAULT", "bad batch", plugin="probe")
    ctx.pending_action = Action.STOP  # e.g. a plugin's HarnessStop in the same step
    assert guard.guard(model=None, optimizer=None) is Action.STOP


def test_a_skip_asked_after_the_guard_is_forgotten_at_the_next_step_but_a_stop_is_not(tmp_path: Path) -> None:
    _, _, ctx, _ = _guard(tmp_path)
    ctx.pending_action = Action.SKIP_STEP
    forget_late_skip(ctx)
    assert ctx.pending_action is Action.CONTINUE
    ctx.pending_action = Action.STOP
    forget_late_skip(ctx)
    assert ctx.pending_action is Action.STOP


def test_one_read_per_step_hands_host_floats_to_the_plugins(tmp_path: Path) -> None:
    guard, record, ctx, probe = _guard(tmp_path, current_lr=lambda: 0.125)
    ctx.step = 7
    record.add_step_loss_part(torch.tensor(1.5), torch.tensor(3.0))  # each micro-batch's share of the step loss, and its own loss
    record.add_step_loss_part(torch.tensor(0.25), torch.tensor(float("nan")))
    record.grad_norm = torch.tensor(3.0)
    probe.queue(ctx, torch.tensor([1, 2]))  # a plugin's deferred device tensor rides the same transfer
    reads = ctx.reads.reads
    guard.guard(model=None, optimizer=None)
    assert ctx.reads.reads == reads + 1
    (step, grad_norm, loss, reads_then) = probe.before_step[0]
    assert (step, grad_norm, loss) == (7, 3.0, 1.75) and type(grad_norm) is float and type(loss) is float
    assert reads_then == reads + 1  # read before on_before_optimizer_step
    assert probe.deferred_seen == [[[1, 2]]]
    assert record.values_read and record.step_loss == 1.75 and record.grad_norm == 3.0 and record.lr == 0.125
    assert record.micro_losses[0] == 3.0 and math.isnan(record.micro_losses[1])  # the micro-batch losses, in the same read
    assert all(type(v) is float for v in record.micro_losses)
    guard.read_step_values(record)  # step end: already read, no second transfer
    assert ctx.reads.reads == reads + 1


def test_the_step_loss_falls_back_to_the_sum_of_training_step_losses(tmp_path: Path) -> None:
    guard, record, ctx, _ = _guard(tmp_path)
    record.add_micro_batch_loss(torch.tensor(2.0))
    record.add_micro_batch_loss(torch.tensor(0.5))
    guard.read_step_values(record)
    assert record.step_loss == 2.5 and record.grad_norm is None and record.micro_batches == 2


def test_a_host_grad_norm_is_kept_as_a_float_without_a_transfer(tmp_path: Path) -> None:
    guard, record, ctx, _ = _guard(tmp_path)
    record.grad_norm = 4  # some engines return a Python number
    reads = ctx.reads.reads
    guard.read_step_values(record)
    assert record.grad_norm == 4.0 and type(record.grad_norm) is float
    assert ctx.reads.reads == reads  # nothing was queued, nothing copied


def test_guard_time_is_counted_only_outside_training_step(tmp_path: Path) -> None:
    inside = [False]
    guard, record, _, _ = _guard(tmp_path, in_training_step=lambda: inside[0])
    guard.guard(model=None, optimizer=None)
    assert record.guard_time > 0
    inner = StepRecord()
    guard._record = lambda: inner  # the next step, under DeepSpeed: the guard runs inside training_step
    inside[0] = True
    guard.guard(model=None, optimizer=None)
    assert inner.guard_time == 0.0


def test_optimizer_skip_and_skip_not_applied(tmp_path: Path) -> None:
    guard, record, ctx, _ = _guard(tmp_path)
    guard.note_optimizer_skip(True)
    assert record.optimizer_skipped
    ctx.step = 4
    guard.skip_not_applied("SomeOptimizer")
    (finding,) = [f for f in ctx.findings if f.code == "SKIP_NOT_APPLIED"]
    assert finding.step == 4 and finding.severity.value == "critical" and "SomeOptimizer" in finding.message
    assert finding.action == "continue"


class AgreedProbe:
    """Records on_step_agreed: fired after the agreement (the shared view is there) and before the update."""

    name = "agreed_probe"

    def __init__(self) -> None:
        self.seen: list[tuple[int, object, object, object, object]] = []

    @hookimpl
    def on_step_agreed(self, ctx: object, step: int, action: object, model: object, optimizer: object) -> None:
        self.seen.append((step, action, model, optimizer, ctx.pending_action))  # type: ignore[attr-defined]


def test_on_step_agreed_fires_after_the_agreement_with_the_agreed_action(tmp_path: Path) -> None:
    from harness.core.registry import PluginEntry

    guard, record, ctx, _ = _guard(tmp_path, {"PROBE_FAULT": "skip_step"})
    probe = AgreedProbe()
    ctx.manager.register(PluginEntry(probe.name, "object", lambda: probe))
    ctx.step = 5
    ctx.report("PROBE_FAULT", "bad batch", plugin="probe")
    model, optimizer = object(), object()
    assert guard.guard(model=model, optimizer=optimizer) is Action.SKIP_STEP
    assert probe.seen == [(5, Action.SKIP_STEP, model, optimizer, Action.CONTINUE)]  # the pending action was consumed by agree()
    guard.guard(model=model, optimizer=optimizer)
    assert probe.seen[-1][1] is Action.CONTINUE


def test_alone_the_agreement_skips_the_exchange_and_a_plugin_still_gets_its_own_values(tmp_path: Path) -> None:
    """One process: the exchange would hand the row straight back, so no row is packed; a plugin's shared values must
    still come back from ``ctx.shared`` (cut to its slot, as the exchange cuts them)."""
    guard, _, ctx, _ = _guard(tmp_path, {"PROBE_FAULT": "skip_step"})
    packed: list[list[int]] = []
    pack = ctx.exchange.pack
    ctx.exchange.pack = lambda header: packed.append(list(header)) or pack(header)  # type: ignore[method-assign]
    ctx.reserve("ids", 2, owner="probe")
    ctx.report("PROBE_FAULT", "bad batch", plugin="probe")
    ctx.share("ids", [5, 6, 7], owner="probe")
    assert guard.guard(model=None, optimizer=None) is Action.SKIP_STEP
    assert ctx.shared("ids", owner="probe") == [[5, 6]] and ctx.shared_cut("ids", owner="probe") == [0]
    assert guard.guard(model=None, optimizer=None) is Action.CONTINUE
    assert ctx.shared("ids", owner="probe") is None and packed == []  # nothing shared at this step


def _probed(record: StepRecord, loss: float, mean: float) -> None:
    """Rank 0 of two, one micro-batch of 4 labels out of the step's 8: the Trainer scaled its loss by 2."""
    from harness.hf.loss_probe import LossProbe

    probe = LossProbe(torch.tensor(mean), torch.tensor(4), torch.tensor(8.0), 2, "BertForSequenceClassification's loss")
    probe.loss = torch.tensor(loss)
    record.add_step_loss_part(probe.loss, probe.loss)
    record.add_micro_batch_loss(probe.loss)
    record.add_local_items(probe.local_items, probe.global_items, 2)
    record.probe = probe


@pytest.mark.parametrize("earlier", [False, True])
@pytest.mark.parametrize(("loss", "own_mean", "recorded"), [(2.2, True, 1.1), (1.1, False, 1.1)])
def test_the_probed_step_is_judged_in_its_one_read_before_the_record_is_corrected(
    tmp_path: Path, loss: float, own_mean: bool, recorded: float, earlier: bool
) -> None:
    """A head that returned its own mean (2.2 = 2 x 1.1) and one normalised by num_items_in_batch (1.1 = 2 x 1.1 x 4/8)
    both end as the rank's own mean 1.1, from the probed step on, whatever an earlier train() call's model was judged;
    the verdict reaches on_step_end's metrics."""
    from harness.lib.world_scaling import WORLD_SCALING_KEY

    guard, record, ctx, _ = _guard(tmp_path)
    _probed(record, loss, mean=1.1)
    if earlier:
        record.add_own_mean_share(2)  # the tap kept an earlier call's verdict until this probe's
    reads = ctx.reads.reads
    guard.guard(model=None, optimizer=None)
    assert ctx.reads.reads == reads + 1  # the probe rode the step's one transfer
    assert record.step_loss == pytest.approx(recorded) and record.logged_loss == pytest.approx(recorded)
    judged = record.metrics(step_time=None)[WORLD_SCALING_KEY]
    assert judged.own_mean is own_mean and judged.factor == pytest.approx(loss / 1.1) and judged.global_items == 8.0
    assert WORLD_SCALING_KEY not in StepRecord().metrics(step_time=None)  # only the probed step carries it
