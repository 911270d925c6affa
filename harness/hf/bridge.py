"""The Trainer bridge: translates a ``transformers.Trainer`` run into harness hooks and carries out actions.

HF callbacks never see the batch or the per-micro-batch loss, and
``TrainerControl`` cannot skip an optimizer step. So ``attach()`` adds one
``TrainerCallback`` AND wraps, on the trainer instance only:

- ``train``: run start/end bookkeeping; ``on_run_end`` fires even after a crash
  (:mod:`harness.hf.lifecycle`);
- ``training_step``: ``inspect_batch`` before every micro-batch
  (:mod:`harness.hf.tap`);
- ``compute_loss``: ``on_loss`` with the micro-batch loss, before backward
  (under DeepSpeed the engine steps inside backward, so after is too late);
- the optimizer step: a guard that fires ``on_before_optimizer_step``,
  agrees the action across ranks and skips the update when asked
  (:mod:`harness.hf.guard`). Plain runs guard ``AcceleratedOptimizer.step``;
  DeepSpeed runs guard the engine's own optimizer, which steps inside
  ``engine.step()`` (:mod:`harness.hf.optimizers`).

The :class:`Bridge` only wires these parts together and routes the
callback's events to them; each part lives in its own module.
"""
from __future__ import annotations

import functools
import logging
import time
from pathlib import Path
from typing import Any, Callable

from harness.core.actions import Action
from harness.core.config import Catalog, ResolvedConfig
from harness.core.context import RunContext
from harness.core.distributed import DistInfo
from harness.core.manager import HarnessPluginManager
from harness.hf.actions import ActionExecutor, RollbackHandler
from harness.hf.callback import HarnessCallback
from harness.hf.checkpoint_state import CheckpointState
from harness.hf.guard import StepGuard, current_lr, forget_late_skip
from harness.hf.isolation import IsolationReporter
from harness.hf.lifecycle import RunLifecycle, refuse_if_locked
from harness.hf.optimizers import install_optimizer_guard
from harness.hf.step_record import StepRecord
from harness.hf.tap import MicroBatchTap
from harness.hf.tracker_feed import TrackerFeed
from harness.lib import rundir
from harness.lib.hashing import masked_lm_run

log = logging.getLogger("harness.bridge")


class Bridge:
    """Owns the run context of one trainer and wires the parts that feed it."""

    def __init__(self, trainer: Any, resolved: ResolvedConfig, catalog: Catalog, rollback: RollbackHandler | None = None,
                 show_notes: bool = True) -> None:
        self.trainer = trainer
        args = trainer.args
        dist = DistInfo(rank=args.process_index, world_size=args.world_size, local_rank=args.local_process_index)
        run_dir = Path(resolved.model.output_dir or args.output_dir or "trainer_output") / "harness"
        rundir.check_writable(run_dir)  # a clear error now, not a PermissionError from inside train()
        rundir.refuse_links(run_dir)  # a copied or received run may hold links: writes through them land elsewhere
        if dist.is_main:
            refuse_if_locked(run_dir)  # before config.yaml (or anything else) is written
        if dist.is_main and show_notes:
            for note in resolved.notes:
                log.warning("harness: note: %s.", note)
        manager = HarnessPluginManager(resolved.model.max_plugin_errors)
        for name in resolved.enabled:
            manager.register(catalog.entries[name])
        self.ctx = ctx = RunContext(resolved, catalog.codes, manager, run_dir, dist)
        ctx.trainer = trainer
        ctx.masked_lm = masked_lm_run(trainer)
        self.isolation = IsolationReporter(ctx)
        if dist.is_main:
            (run_dir / "config.yaml").write_text(resolved.to_yaml(), encoding="utf-8")
        for name in manager.names:
            manager.hooks.configure(name, ctx, resolved.options_for(name))
        self.record = StepRecord()  # replaced at every step begin, never reset field by field
        # the record and the tap's flag are read several times a step: through partial(getattr, ...), a C-level call
        current_record = functools.partial(getattr, self, "record")
        self.tap = MicroBatchTap(ctx, trainer, current_record)
        self.guard = StepGuard(
            ctx,
            current_record,
            rollback_available=rollback is not None,
            in_training_step=functools.partial(getattr, self.tap, "in_training_step"),
            current_lr=functools.partial(current_lr, trainer),
        )
        self.actions = ActionExecutor(ctx, rollback)
        self.checkpoint_state = CheckpointState(ctx, trainer)
        self.lifecycle = RunLifecycle(ctx, trainer, self.checkpoint_state, self.actions)
        self.is_deepspeed = False
        self._last_step_end: float | None = None  # host clock of the last step end: the next step's time
        trainer.add_callback(HarnessCallback(self))
        self.feed = TrackerFeed(resolved.model.trackers, is_main=dist.is_main, mlflow_plugin="mlflow" in resolved.enabled)  # report_to's trackers get metrics, findings
        self.feed.install(trainer)
        if self.feed.enabled:
            ctx.metric_observers.append(self.feed.note_metrics)
            ctx.finding_observers.append(self.feed.note_finding)
            self.lifecycle.after_run_end = lambda: self.feed.flush_findings(trainer.state.global_step, final=True)
        self.tap.install(trainer)
        trainer.train = self.lifecycle.wrap_train(trainer.train)

    def run_train(self, train: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        """Run one ``train()`` call under the harness (also used by ``harness wrap``'s auto-attach)."""
        return self.lifecycle.run_train(train, args, kwargs)

    # -- callback events --------------------------------------------------------------------------

    def train_begin(self) -> None:
        ctx, trainer = self.ctx, self.trainer
        self.is_deepspeed = install_optimizer_guard(trainer, self.guard)  # the optimizer exists and is prepared now
        ctx.step = trainer.state.global_step
        self._last_step_end = time.perf_counter()
        ctx.micro_step = 0  # ctx.step is the last completed step until the first micro-batch arrives
        self.tap.begin_train()
        self.lifecycle.begin()
        self.checkpoint_state.dispatch_resume()

    def step_begin(self) -> None:
        forget_late_skip(self.ctx)
        self.ctx.start_step()  # nothing queued for a step that died half-way reaches this one
        self.ctx.micro_step = 0
        self.record = StepRecord(data_time=self.tap.take_data_time())

    def step_end(self, state: Any, control: Any) -> Any:
        ctx, record = self.ctx, self.record
        self.guard.read_step_values(record)  # no guard ran this step (a Trainer that never stepped the optimizer)
        step = state.global_step
        now = time.perf_counter()
        step_time = now - self._last_step_end if self._last_step_end is not None else None
        self._last_step_end = now
        metrics = record.metrics(step_time)
        if record.agreed is not Action.CONTINUE and ctx.is_main:
            self.actions.record(record.agreed, step)
        ctx.step = step
        ctx.manager.hooks.on_step_end(ctx, step, metrics)
        self.feed.note_step(bool(metrics.get("skipped")))
        late = self.actions.late_stop(step)  # one process: a stop asked in on_step_end stops at this step
        action = late if late is not None else record.agreed
        after, cause = ctx.take_after_update()  # a stop asked for after the update (preemption): this step is kept
        if after.stops_training and not action.stops_training:
            if ctx.is_main:
                self.actions.record(after, step, updated=action is Action.CONTINUE, cause=cause)
            action = after
        elif after is Action.SAVE_AND_STOP and action in (Action.ROLLBACK, Action.STOP):
            # the same step also agreed a stop without a save, or a rollback (the runner would restart in this process and
            # train on past the preemption): the save is what the preemption needs (the update was not applied)
            if ctx.is_main:
                self.actions.record(after, step, cause=cause)
            action = after
        else:
            cause = None
        self.actions.apply(action, control, cause)
        return control

    def log(self, state: Any, logs: dict[str, float]) -> None:
        self.ctx.manager.hooks.on_log(self.ctx, state.global_step, logs)

    def evaluate(self, state: Any, metrics: dict[str, float]) -> None:
        self.ctx.manager.hooks.on_evaluate(self.ctx, state.global_step, metrics)

    def save(self, state: Any) -> None:
        self.checkpoint_state.save(state.global_step)

    def train_end(self) -> None:
        self.ctx.step_batches = []  # the last step's batches (device tensors, by reference) do not outlive train()
        self.ctx.flush_findings()
