"""The Trainer bridge: translates a ``transformers.Trainer`` run into harness hooks and carries out actions.

HF callbacks never see the batch or the per-micro-batch loss, and
``TrainerControl`` cannot skip an optimizer step. So ``attach()`` adds one
``TrainerCallback`` AND wraps, on the trainer instance only:

- ``train``: run start/end bookkeeping; ``on_run_end`` fires even after a crash;
- ``training_step``: ``inspect_batch`` before every micro-batch;
- ``compute_loss``: ``on_loss`` with the micro-batch loss, before backward
  (under DeepSpeed the engine steps inside backward, so after is too late);
- the optimizer step: a guard that fires ``on_before_optimizer_step``,
  agrees the action across ranks and skips the update when asked. Plain
  runs guard ``AcceleratedOptimizer.step``; DeepSpeed runs guard the engine's
  own optimizer, which steps inside ``engine.step()``.
"""
from __future__ import annotations

import functools
import json
import logging
import os
import time
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any, Callable

from transformers import TrainerCallback

from harness import checkpoints, rundir
from harness.actions import Action, strongest
from harness.config import Catalog, ResolvedConfig, load_config
from harness.context import RunContext
from harness.core_codes import ACTION_TAKEN, CHECKPOINT_INCOMPLETE, INTERNAL_PLUGIN_ERROR, PLUGIN_DISABLED, PLUGIN_STOP, SKIP_NOT_APPLIED
from harness.distributed import DistInfo
from harness.errors import NoCompleteCheckpointError
from harness.manager import HarnessPluginManager
from harness.runinfo import end_attempt, run_facts, start_attempt
from harness.tokens import token_positions

RANK_END_WAIT_S = 90.0  # rank 0 waits this long at most for the other ranks' run-end files

log = logging.getLogger("harness")
STATE_DIR = checkpoints.STATE_DIR


def attach(trainer: Any, config: Any = None, plugins: list[Any] | None = None) -> RunContext:
    """Attach the harness to ``trainer`` (a ``transformers.Trainer`` or TRL subclass); call before ``train()``.

    ``config`` is a YAML path, a dict, or None (then ``HARNESS_CONFIG`` /
    ``HARNESS_PLUGINS`` from the environment, else the defaults). ``plugins``
    adds plugins by name, ``module:Class`` path or object. Attaching twice
    returns the first context.
    """
    existing: Bridge | None = getattr(trainer, "_harness_bridge", None)
    if existing is not None:
        return existing.ctx
    names = [p for p in plugins or [] if isinstance(p, str)]
    objects = [p for p in plugins or [] if not isinstance(p, str)]
    catalog = Catalog.build(extra=objects)
    resolved = load_config(config, catalog, extra_plugins=names + [catalog.add(o) for o in objects])
    bridge = Bridge(trainer, resolved, catalog)
    trainer._harness_bridge = bridge
    return bridge.ctx


class Bridge:
    """Owns the run context of one trainer and the patches that feed it."""

    def __init__(self, trainer: Any, resolved: ResolvedConfig, catalog: Catalog) -> None:
        self.trainer = trainer
        args = trainer.args
        dist = DistInfo(rank=args.process_index, world_size=args.world_size, local_rank=args.local_process_index)
        output_dir = Path(resolved.model.output_dir or args.output_dir or "trainer_output")
        run_dir = output_dir / "harness"
        rundir.check_writable(run_dir)  # a clear error now, not a PermissionError from inside train()
        self._lock_dir = run_dir if dist.is_main else None  # rank 0 holds the run lock while a train() call runs
        if self._lock_dir is not None:  # refused at attach already (before config.yaml is written), held only in train()
            rundir.acquire(self._lock_dir, id(self))
            rundir.release(self._lock_dir, id(self))
        manager = HarnessPluginManager(resolved.model.max_plugin_errors)
        for name in resolved.enabled:
            manager.register(catalog.entries[name])
        self.ctx = RunContext(resolved, catalog.codes, manager, run_dir, dist)
        self.ctx.trainer = trainer
        manager.on_error = self._plugin_failed
        manager.on_stop = self._plugin_stopped
        if dist.is_main:
            (run_dir / "config.yaml").write_text(resolved.to_yaml(), encoding="utf-8")
        for name in manager.names:
            manager.call_plugin(name, "configure", ctx=self.ctx, options=resolved.options_for(name))
        self._loss_sum: Any = None
        self._step_loss: Any = None
        self._micro_batches = 0
        self._step_tokens = 0
        self._optimizer_skipped = False
        self._grad_norm: Any = None
        self._lr: float | None = None
        self._agreed = Action.CONTINUE
        self._data_time = 0.0  # seconds this step waited for its batches
        self._next_data_time = 0.0  # fetched before step_begin, so it belongs to the step about to begin
        self._model_time = 0.0  # seconds in training_step (forward, backward, and under DeepSpeed the update)
        self._guard_time = 0.0  # seconds in the step guard outside training_step
        self._last_step_end: float | None = None
        self._in_training_step = False
        self._in_train = False
        self._stopped = False
        self.is_deepspeed = False
        self._attempt: int | None = None  # this train() call's index in run.json's attempts
        self._report_time = 0.0
        self._install(trainer)

    # -- installation -----------------------------------------------------------------------

    def _install(self, trainer: Any) -> None:
        trainer.add_callback(HarnessCallback(self))
        trainer.training_step = self._wrap_training_step(trainer.training_step)
        trainer.compute_loss = self._wrap_compute_loss(trainer.compute_loss)
        trainer.train = self._wrap_train(trainer.train)
        if hasattr(trainer, "_get_grad_norm"):
            trainer._get_grad_norm = self._wrap_grad_norm(trainer._get_grad_norm)
        if hasattr(trainer, "get_batch_samples"):
            trainer.get_batch_samples = self._wrap_get_batch_samples(trainer.get_batch_samples)

    def _wrap_train(self, train: Callable[..., Any]) -> Callable[..., Any]:
        @functools.wraps(train)
        def harness_train(*args: Any, **kwargs: Any) -> Any:
            return self.run_train(train, args, kwargs)

        return harness_train

    def run_train(self, train: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        """Run one ``train()`` call: ``on_run_end`` always fires, with how the run ended."""
        if self._in_train:
            return train(*args, **kwargs)
        if self._lock_dir is not None:
            rundir.acquire(self._lock_dir, id(self))  # held until this call ends
        self._stopped = False
        self.ctx.pending_action = Action.CONTINUE
        try:
            args, kwargs, resumed = self._resume_dir(args, kwargs)  # True/"last": the last COMPLETE checkpoint
        except BaseException:
            self._release_lock()
            raise
        self._in_train = True
        self.ctx.resumed_from = resumed
        self._attempt = None
        self._mark_attempt("running")
        status, error = "completed", None
        try:
            return train(*args, **kwargs)
        except BaseException as exc:
            status, error = "crashed", exc
            raise
        finally:
            self._in_train = False
            if status == "completed" and self._stopped:
                status = "stopped"
            self.ctx.status = status
            try:
                self.ctx.manager.call("on_run_end", ctx=self.ctx, status=status, error=error)
                self._finish_run(status, error)
            finally:  # also after a KeyboardInterrupt while the report is written
                self._release_lock()
            if status == "crashed":
                log.error("harness: training crashed; findings are in %s", self.ctx.run_dir / "findings.jsonl")

    def _release_lock(self) -> None:
        if self._lock_dir is not None:
            rundir.release(self._lock_dir, id(self))

    def _finish_run(self, status: str, error: BaseException | None) -> None:
        """Record how this train() call ended, write the report (rank 0), hand it to ``on_report``.

        Other ranks write their run-end files (contamination summaries, spilled
        findings) in their own ``on_run_end``; rank 0 waits a bounded time for
        their end markers before reading them (no collective: after a crash a
        rank may be gone, so it does not wait then).
        """
        ctx = self.ctx
        if not ctx.is_main:
            self._mark_attempt("ended")
            return
        files = None
        known = len(ctx.findings)
        try:
            if ctx.world_size > 1 and status != "crashed":
                self._wait_for_ranks(RANK_END_WAIT_S)
            end_attempt(ctx.run_dir, status, int(self.trainer.state.global_step), error, self._attempt)
            if ctx.options.report:
                files = self._write_report()
        except Exception:  # noqa: BLE001 - the report must never turn a finished run into a crash
            log.exception("harness: the report could not be written; rebuild it with `harness report %s`", ctx.run_dir.parent)
        finally:
            ctx.manager.call("on_report", ctx=ctx, report=files)  # trackers close here, report or not
        if files is not None and any(f.time >= self._report_time for f in ctx.findings[known:]):
            try:  # a tracker reported while closing (TRACKING_DEGRADED): the local report must show it
                self._write_report()
            except Exception:  # noqa: BLE001
                log.exception("harness: the report could not be rewritten with the last findings")

    def _write_report(self) -> Any:
        from harness.report import write_report

        ctx = self.ctx
        files = write_report(ctx.run_dir, ctx.manager, ctx.config, plots=ctx.options.report_plots)
        self._report_time = time.time()
        log.info("harness: report written to %s (%s)", files.html, files.report.verdict.line())
        return files

    def _mark_attempt(self, state: str) -> None:
        """This rank's attempt marker (``ranks/attempt.rank-<r>``): ``running`` at start, ``ended`` after on_run_end."""
        if self.ctx.world_size <= 1:
            return
        try:
            marker = self.ctx.path("ranks", f"attempt.rank-{self.ctx.rank}")
            marker.write_text(state, encoding="utf-8")
        except OSError:
            pass

    def _wait_for_ranks(self, timeout: float) -> None:
        """Until every rank whose marker rank 0 can see (a shared run directory) has ended, at most ``timeout`` s."""
        markers = [self.ctx.run_dir / "ranks" / f"attempt.rank-{r}" for r in range(1, self.ctx.world_size)]
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            pending = [m for m in markers if m.exists() and m.read_text(encoding="utf-8").strip() != "ended"]
            if not pending:
                return
            time.sleep(0.1)
        log.warning("harness: ranks %s did not finish within %.0f s; the report may miss their last files", [m.name for m in pending], timeout)

    def _resume_dir(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[tuple[Any, ...], dict[str, Any], Path | None]:
        """The checkpoint this train() call resumes from, and its arguments with ``True``/``"last"`` made that path.

        HF's ``resume_from_checkpoint=True`` takes the highest-numbered folder,
        complete or not (a kill during a save leaves one without
        ``trainer_state.json``, and the resume dies with ``FileNotFoundError``).
        The harness resolves it to the last complete checkpoint itself (see
        ``harness.checkpoints``) and hands the real ``train()`` that path.
        """
        positional = bool(args)
        resume = args[0] if positional else kwargs.get("resume_from_checkpoint")
        if resume is None or resume is False:
            return args, kwargs, None
        if resume is True or (isinstance(resume, str) and resume.strip().lower() == "last"):
            chosen = self._resolve_last()
            value: Any = str(chosen) if chosen is not None else True  # no checkpoint at all: HF's own error
            if positional:
                args = (value, *args[1:])
            else:
                kwargs = {**kwargs, "resume_from_checkpoint": value}
            return args, kwargs, chosen
        return args, kwargs, Path(resume)

    def _resolve_last(self) -> Path | None:
        """The last complete checkpoint of the output dir; a ``CHECKPOINT_INCOMPLETE`` finding per newer folder passed over."""
        ctx = self.ctx
        output_dir = Path(self.trainer.args.output_dir)
        found = checkpoints.resolve_last(output_dir, ctx.world_size)
        chosen = found.chosen
        if ctx.is_main:
            for folder, missing in found.skipped:
                # set aside only when resuming from an older one: save_total_limit would keep it and rotate the good ones away
                moved = checkpoints.set_aside(folder) if chosen is not None else None
                ctx.report(
                    CHECKPOINT_INCOMPLETE.code,
                    f"{folder.name} is incomplete: it lacks {', '.join(missing)} (a save interrupted by a kill, a crash or a "
                    "full disk); "
                    + (f"resume_from_checkpoint=True resumes from {chosen.name} instead." if chosen is not None
                       else "no complete checkpoint is left to resume from.")
                    + (f" It was renamed {moved.name} (kept, outside the checkpoint-* names that the Trainer resumes from and "
                       "rotates)." if moved is not None else ""),
                    step=checkpoints.checkpoint_step(folder),
                    evidence={"checkpoint": str(folder), "missing": missing, "resumed_from": str(chosen) if chosen else None,
                              "renamed_to": str(moved) if moved is not None else None},
                    plugin="harness",
                )
            if chosen is not None and found.chosen_missing:
                ctx.report(
                    CHECKPOINT_INCOMPLETE.code,
                    f"{chosen.name} lacks {', '.join(found.chosen_missing)} (the harness's part of the save did not finish) and no "
                    "older checkpoint is complete: resuming from it anyway; the checks that need the harness state are skipped.",
                    step=checkpoints.checkpoint_step(chosen),
                    evidence={"checkpoint": str(chosen), "missing": found.chosen_missing, "resumed_from": str(chosen)},
                    plugin="harness",
                )
        if chosen is None and found.skipped:
            lacks = "; ".join(f"{p.name} lacks {', '.join(m)}" for p, m in found.skipped[:5])
            raise NoCompleteCheckpointError(
                f"resume_from_checkpoint=True: no complete checkpoint in {output_dir} ({lacks}). Every save there was "
                "interrupted before the Trainer finished it. Fix: name a checkpoint to resume from, or start without "
                "resume_from_checkpoint (the incomplete folders can be deleted)."
            )
        return chosen

    def _wrap_training_step(self, training_step: Callable[..., Any]) -> Callable[..., Any]:
        ctx, call = self.ctx, self.ctx.manager.call

        @functools.wraps(training_step)
        def harness_training_step(model: Any, inputs: Any, *args: Any, **kwargs: Any) -> Any:
            ctx.step = self.trainer.state.global_step + 1
            if ctx.recent_batches.maxlen:
                ctx.recent_batches.append((ctx.step, ctx.micro_step, inputs))
            call("inspect_batch", ctx=ctx, batch=inputs, step=ctx.step, micro_step=ctx.micro_step)
            self._step_tokens += token_positions(inputs)
            self._in_training_step = True
            started = time.perf_counter()
            try:
                loss = training_step(model, inputs, *args, **kwargs)
                self._loss_sum = loss if self._loss_sum is None else self._loss_sum + loss
                self._micro_batches += 1
                return loss
            finally:
                self._model_time += time.perf_counter() - started
                self._in_training_step = False
                ctx.micro_step += 1

        return harness_training_step

    def _wrap_compute_loss(self, compute_loss: Callable[..., Any]) -> Callable[..., Any]:
        ctx, call = self.ctx, self.ctx.manager.call

        @functools.wraps(compute_loss)
        def harness_compute_loss(model: Any, inputs: Any, *args: Any, **kwargs: Any) -> Any:
            seen = dict(inputs) if isinstance(inputs, Mapping) else inputs  # compute_loss may pop "labels"
            result = compute_loss(model, inputs, *args, **kwargs)
            if self._in_training_step:
                loss = (result[0] if isinstance(result, tuple) else result).detach()
                if loss.dim() > 0:
                    loss = loss.mean()  # DataParallel over several GPUs: one loss per replica, as the Trainer averages
                part = loss if self._loss_scaled_for_ga(kwargs.get("num_items_in_batch")) else loss / self._ga_steps()
                self._step_loss = part if self._step_loss is None else self._step_loss + part
                call("on_loss", ctx=ctx, loss=loss, batch=seen, step=ctx.step, micro_step=ctx.micro_step)
            return result

        return harness_compute_loss

    def _loss_scaled_for_ga(self, num_items_in_batch: Any) -> bool:
        """Whether the Trainer treats this loss as already normalised over the whole step (its own rule)."""
        trainer = self.trainer
        fixed = getattr(trainer, "loss_is_scaled_for_ga", None)
        if fixed is not None:
            return bool(fixed)
        accepts = bool(getattr(trainer, "model_accepts_loss_kwargs", False))
        return (accepts and num_items_in_batch is not None) or getattr(trainer, "compute_loss_func", None) is not None

    def _ga_steps(self) -> int:
        trainer = self.trainer
        return int(getattr(trainer, "current_gradient_accumulation_steps", None) or trainer.args.gradient_accumulation_steps or 1)

    def _wrap_get_batch_samples(self, get_batch_samples: Callable[..., Any]) -> Callable[..., Any]:
        """Time the data loader: the Trainer fetches a step's micro-batches here, before the step begins."""

        @functools.wraps(get_batch_samples)
        def harness_get_batch_samples(epoch_iterator: Any, *args: Any, **kwargs: Any) -> Any:
            return get_batch_samples(_TimedIterator(epoch_iterator, self), *args, **kwargs)

        return harness_get_batch_samples

    def _wrap_grad_norm(self, get_grad_norm: Callable[..., Any]) -> Callable[..., Any]:
        @functools.wraps(get_grad_norm)
        def harness_get_grad_norm(*args: Any, **kwargs: Any) -> Any:
            self._grad_norm = get_grad_norm(*args, **kwargs)
            return self._grad_norm

        return harness_get_grad_norm

    def install_step_guard(self) -> None:
        """Called at train begin, once the optimizer exists and is prepared."""
        trainer = self.trainer
        if getattr(trainer, "is_deepspeed_enabled", False):
            self.is_deepspeed = True
            engine = trainer.model_wrapped
            _guard_deepspeed_optimizer(engine.optimizer, self, engine)
        else:
            _guard_accelerated_optimizer(trainer.optimizer, self, trainer.model_wrapped)

    # -- the step guard -------------------------------------------------------------------------

    def guard(self, model: Any, optimizer: Any) -> Action:
        """Fire the pre-step hook, agree the action with every rank, remember it for step end."""
        ctx = self.ctx
        started = time.perf_counter()
        try:
            return self._guard(model, optimizer)
        finally:
            if not self._in_training_step:  # under DeepSpeed the guard runs inside training_step, already timed
                self._guard_time += time.perf_counter() - started

    def _guard(self, model: Any, optimizer: Any) -> Action:
        ctx = self.ctx
        ctx.manager.call(
            "on_before_optimizer_step",
            ctx=ctx,
            step=ctx.step,
            model=model,
            optimizer=optimizer,
            grad_norm=self._grad_norm,
            loss=self._step_loss,
        )
        self._lr = _current_lr(self.trainer)  # the LR this update uses, before the scheduler moves
        action = ctx.agree()
        if action is Action.ROLLBACK and getattr(self.trainer, "_harness_rollback", None) is None:
            action = Action.SAVE_AND_STOP
        self._agreed = action
        return action

    # -- callback events --------------------------------------------------------------------------

    def train_begin(self) -> None:
        ctx, trainer = self.ctx, self.trainer
        self.install_step_guard()
        ctx.step = trainer.state.global_step
        self._last_step_end = time.perf_counter()
        ctx.micro_step = 0  # ctx.step is the last completed step until the first micro-batch arrives
        if ctx.is_main:
            try:  # the run card's facts: nice to have, never worth a crash
                resumed = str(ctx.resumed_from) if ctx.resumed_from is not None else None
                facts = run_facts(trainer, ctx.world_size, ctx.stage)
                facts["plugin_classes"] = {name: _class_path(ctx.manager.plugin(name)) for name in ctx.manager.names}
                self._attempt = start_attempt(ctx.run_dir, facts, resumed, int(trainer.state.global_step))
            except Exception:  # noqa: BLE001
                log.exception("harness: could not record the run in %s", ctx.run_dir / "run.json")
        ctx.manager.call("on_run_start", ctx=ctx, trainer=trainer)
        if trainer.train_dataset is not None:
            ctx.manager.call("inspect_dataset", ctx=ctx, dataset=trainer.train_dataset, split="train")
        if getattr(trainer, "eval_dataset", None) is not None:
            ctx.manager.call("inspect_dataset", ctx=ctx, dataset=trainer.eval_dataset, split="eval")
        if ctx.resumed_from is not None:
            states = _read_state(ctx.resumed_from, ctx.rank)
            for name in ctx.manager.names:
                ctx.manager.call_plugin(name, "on_resume", ctx=ctx, checkpoint_dir=ctx.resumed_from, state=states.get(name))

    def step_begin(self) -> None:
        if self.ctx.pending_action is Action.SKIP_STEP:
            self.ctx.pending_action = Action.CONTINUE  # asked after the last guard: that update is done
        self.ctx.micro_step = 0
        self._loss_sum = None
        self._step_loss = None
        self._micro_batches = 0
        self._step_tokens = 0
        self._optimizer_skipped = False
        self._grad_norm = None
        self._lr = None
        self._agreed = Action.CONTINUE
        self._data_time, self._next_data_time = self._next_data_time, 0.0
        self._model_time = 0.0
        self._guard_time = 0.0

    def add_data_time(self, seconds: float) -> None:
        self._next_data_time += seconds

    def step_end(self, state: Any, control: Any) -> Any:
        ctx = self.ctx
        agreed, self._agreed = self._agreed, Action.CONTINUE
        step = state.global_step
        now = time.perf_counter()
        step_time = now - self._last_step_end if self._last_step_end is not None else None
        self._last_step_end = now
        metrics = {
            "loss": self._loss_sum,
            "grad_norm": self._grad_norm,
            "lr": self._lr,
            "skipped": agreed is not Action.CONTINUE,
            "optimizer_skipped": self._optimizer_skipped and agreed is Action.CONTINUE,
            "action": agreed.value,
            "micro_batches": self._micro_batches,
            "tokens": self._step_tokens,
            "step_time": step_time,
            "data_time": self._data_time,
            "model_time": self._model_time + self._guard_time,
        }
        if agreed is not Action.CONTINUE and ctx.is_main:
            self._record_action(agreed, step)
        ctx.step = step
        ctx.manager.call("on_step_end", ctx=ctx, step=step, metrics=metrics)
        if ctx.world_size == 1 and ctx.pending_action.stops_training:
            agreed, ctx.pending_action = ctx.pending_action, Action.CONTINUE
            self._record_action(agreed, step)
        self._apply(agreed, control)
        return control

    def _apply(self, action: Action, control: Any) -> None:
        handler = getattr(self.trainer, "_harness_rollback", None)
        if action is Action.ROLLBACK and handler is not None:
            control.should_training_stop = True  # the runner resumes from the last good checkpoint
            self._stopped = True
            causes = [f for f in self.ctx.findings if f.action == Action.ROLLBACK.value]
            handler.request(self.ctx.step, causes[-1] if causes else None)
            return
        if action in (Action.SAVE_AND_STOP, Action.ROLLBACK):
            control.should_save = True
            control.should_training_stop = True
            self._stopped = True
        elif action is Action.STOP:
            control.should_training_stop = True
            self._stopped = True

    def _record_action(self, action: Action, step: int) -> None:
        ctx = self.ctx
        causes = [f for f in ctx.findings if f.action not in (None, "continue") and f.code not in ("ACTION_TAKEN",)]
        recent = [f for f in causes if f.step is not None and f.step >= step - 1]
        cause = recent[-1] if recent else (causes[-1] if causes else None)
        because = f" after {cause.code} from plugin '{cause.plugin}' on rank {cause.rank}" if cause else ""
        what = {
            Action.SKIP_STEP: "skipped the optimizer update",
            Action.SAVE_AND_STOP: "skipped the optimizer update, saved a checkpoint and stopped",
            Action.STOP: "stopped training",
            Action.ROLLBACK: "skipped the update and stopped to roll back to the last good checkpoint"
            if getattr(self.trainer, "_harness_rollback", None) is not None
            else "skipped the update and stopped (rollback needs a stage runner; saved a checkpoint)",
        }[action]
        ctx.report(
            ACTION_TAKEN.code,
            f"harness {what} at step {step}{because}.",
            step=step,
            evidence={"action": action.value, "cause": cause.id if cause else None},
            plugin="harness",
        )

    def log(self, state: Any, logs: dict[str, float]) -> None:
        self.ctx.manager.call("on_log", ctx=self.ctx, step=state.global_step, logs=logs)

    def evaluate(self, state: Any, metrics: dict[str, float]) -> None:
        self.ctx.manager.call("on_evaluate", ctx=self.ctx, step=state.global_step, metrics=metrics)

    def save(self, state: Any) -> None:
        ctx = self.ctx
        checkpoint_dir = Path(self.trainer.args.output_dir) / f"checkpoint-{state.global_step}"
        states: dict[str, str] = {}
        for name in ctx.manager.names:
            value = ctx.manager.call_plugin(name, "checkpoint_state", ctx=ctx, step=state.global_step)
            if value is None:
                continue
            try:
                states[name] = json.dumps(value)
            except (TypeError, ValueError) as exc:  # the plugin's state, not the checkpoint, is lost
                ctx.manager.record_error(name, "checkpoint_state", exc)
        # written even when empty: with the marker below it tells a finished harness save from an interrupted one
        target = checkpoint_dir / STATE_DIR / f"rank-{ctx.rank}.json"
        written = False
        try:
            target.parent.mkdir(parents=True, exist_ok=True)
            tmp = target.with_suffix(".tmp")
            tmp.write_text("{" + ", ".join(f"{json.dumps(k)}: {v}" for k, v in states.items()) + "}", encoding="utf-8")
            os.replace(tmp, target)
            written = True
        except OSError as exc:
            log.error("harness: could not write plugin state to %s: %s", target, exc)
        ctx.manager.call("on_checkpoint_save", ctx=ctx, step=state.global_step, checkpoint_dir=checkpoint_dir)
        if written:  # last: a checkpoint is complete for the harness only with every rank's marker
            try:
                checkpoints.write_marker(checkpoint_dir, ctx.rank, ctx.world_size, state.global_step)
            except OSError as exc:
                log.error("harness: could not mark %s complete: %s", checkpoint_dir, exc)

    def train_end(self) -> None:
        self.ctx.flush_findings()

    # -- isolation ----------------------------------------------------------------------------------

    def _plugin_failed(self, plugin: str, hook: str, exc: BaseException, tb: str) -> None:
        ctx, manager = self.ctx, self.ctx.manager
        count = manager.error_count(plugin)
        if count <= 3:
            pending = manager.wants_disabling(plugin)  # several processes: switched off on every rank at the next guard
            ctx.report(
                INTERNAL_PLUGIN_ERROR.code,
                f"plugin '{plugin}' raised {type(exc).__name__} in {hook}() at step {ctx.step}"
                f"{f' on rank {ctx.rank}' if ctx.world_size > 1 else ''}: {exc}. Training went on without this call."
                + (f" It reached max_plugin_errors ({manager.max_errors_per_plugin}) and is switched off on every rank at "
                   "the next step guard." if pending else ""),
                evidence={"hook": hook, "exception": repr(exc), "traceback": tb, "occurrence": count, "rank": ctx.rank},
                plugin=plugin,
            )
        if manager.is_disabled(plugin):  # one process: switched off at once (several: rank 0 reports the agreed switch-off)
            ctx.report(
                PLUGIN_DISABLED.code,
                f"plugin '{plugin}' raised {count} exceptions (last in {hook}()) and is switched off for the rest of the run.",
                evidence={"hook": hook, "errors": count},
                plugin=plugin,
            )


    def _plugin_stopped(self, plugin: str, hook: str, stop: BaseException, _tb: str) -> None:
        self.ctx.report(
            PLUGIN_STOP.code,
            f"plugin '{plugin}' asked to stop training in {hook}() at step {self.ctx.step}: {stop}",
            evidence={"hook": hook, "reason": str(stop)},
            plugin=plugin,
        )
        self.ctx.pending_action = strongest(self.ctx.pending_action, Action.STOP)

    def note_optimizer_skip(self, skipped: bool) -> None:
        """The optimizer (DeepSpeed's overflow check, an fp16 GradScaler) skipped an update the harness let through."""
        self._optimizer_skipped = skipped

    def skip_not_applied(self, detail: str) -> None:
        self.ctx.report(
            SKIP_NOT_APPLIED.code,
            f"the harness could not skip the optimizer update at step {self.ctx.step}: {detail}. "
            "The update was applied; parameters moved.",
            evidence={"optimizer": detail},
            plugin="harness",
        )


class _TimedIterator:
    """Wraps the Trainer's epoch iterator to add the time spent in ``next()`` (waiting for data) to the bridge."""

    def __init__(self, inner: Any, bridge: Bridge) -> None:
        self._inner = inner
        self._bridge = bridge

    def __iter__(self) -> Iterator[Any]:
        return self

    def __next__(self) -> Any:
        started = time.perf_counter()
        try:
            return next(self._inner)
        finally:
            self._bridge.add_data_time(time.perf_counter() - started)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)


class HarnessCallback(TrainerCallback):
    """The one callback the harness adds; forwards Trainer events to the bridge."""

    def __init__(self, bridge: Bridge) -> None:
        self.bridge = bridge

    def on_train_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> Any:
        self.bridge.train_begin()
        return control

    def on_step_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> Any:
        self.bridge.step_begin()
        return control

    def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> Any:
        return self.bridge.step_end(state, control)

    def on_log(self, args: Any, state: Any, control: Any, logs: dict[str, float] | None = None, **kwargs: Any) -> Any:
        self.bridge.log(state, logs or {})
        return control

    def on_evaluate(self, args: Any, state: Any, control: Any, metrics: dict[str, float] | None = None, **kwargs: Any) -> Any:
        self.bridge.evaluate(state, metrics or {})
        return control

    def on_save(self, args: Any, state: Any, control: Any, **kwargs: Any) -> Any:
        self.bridge.save(state)
        return control

    def on_train_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> Any:
        self.bridge.train_end()
        return control


# -- optimizer guards --------------------------------------------------------------------------------

def _guard_accelerated_optimizer(optimizer: Any, bridge: "Bridge", model: Any) -> None:
    """Plain runs: the Trainer calls ``AcceleratedOptimizer.step`` once per optimizer step.

    A skip leaves parameters and optimizer state untouched and marks the step
    as skipped (the same flag an fp16 overflow sets), so the Trainer also
    holds the LR scheduler back. With an fp16 GradScaler the scaler is reset
    at the same scale, as after an overflow, so the next step can unscale.
    """
    original = optimizer.step
    if getattr(original, "_harness_guard", False):
        return  # a second train() call on the same optimizer: one guard per step, not two

    @functools.wraps(original)
    def harness_step(*args: Any, **kwargs: Any) -> Any:
        scaler = getattr(optimizer, "scaler", None)
        if bridge.guard(model, optimizer) is Action.CONTINUE:
            if scaler is None:
                optimizer._is_overflow = False
            result = original(*args, **kwargs)
            bridge.note_optimizer_skip(bool(getattr(optimizer, "step_was_skipped", False)))
            return result
        optimizer._is_overflow = True
        if scaler is not None and scaler.is_enabled():
            scaler.update(scaler.get_scale())  # forget this step's unscale_; keep the scale as it was
        return None

    harness_step._harness_guard = True  # type: ignore[attr-defined]
    optimizer.step = harness_step


def _guard_deepspeed_optimizer(optimizer: Any, bridge: "Bridge", engine: Any) -> None:
    """DeepSpeed: ``engine.step()`` (inside backward) calls its optimizer's ``step``; guard that.

    A skip drives the optimizer down its own overflow path (the one an fp16
    overflow takes: gradients dropped, no update, ``overflow`` set so that the
    engine holds the LR scheduler and counts a skipped step) without touching
    the loss scale. If the optimizer still reports no overflow afterwards the
    update happened, and a critical ``SKIP_NOT_APPLIED`` finding says so.
    """
    original = optimizer.step
    if getattr(original, "_harness_guard", False):
        return
    owns_overflow = hasattr(optimizer, "overflow")

    @functools.wraps(original)
    def harness_step(*args: Any, **kwargs: Any) -> Any:
        if bridge.guard(engine, optimizer) is Action.CONTINUE:
            if not owns_overflow and hasattr(optimizer, "overflow"):
                optimizer.overflow = False
            result = original(*args, **kwargs)
            bridge.note_optimizer_skip(bool(getattr(optimizer, "overflow", False)))  # the engine's own overflow skip
            return result
        if not _has_overflow_path(optimizer):
            # ZeRO stage 0 with a plain torch optimizer: drop the gradients, flag the skip for the engine
            optimizer.zero_grad(set_to_none=True)
            optimizer.overflow = True
            return None
        result = _step_with_forced_overflow(optimizer, original, args, kwargs)
        if not getattr(optimizer, "overflow", False):
            bridge.skip_not_applied(type(optimizer).__name__)
        return result

    harness_step._harness_guard = True  # type: ignore[attr-defined]
    optimizer.step = harness_step


def _has_overflow_path(optimizer: Any) -> bool:
    return hasattr(optimizer, "_update_scale") and (
        hasattr(optimizer, "check_overflow") or hasattr(optimizer, "_overflow_check_and_loss_scale_update")
    )


def _step_with_forced_overflow(optimizer: Any, original: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    """Run the optimizer's own step with its overflow check answering "overflow" and the loss scale frozen."""

    def forced_overflow(*_: Any, **__: Any) -> bool:
        optimizer.overflow = True
        return True

    patches: dict[str, Any] = {"_update_scale": lambda *_, **__: None}
    if hasattr(optimizer, "check_overflow"):
        patches["check_overflow"] = forced_overflow  # ZeRO-1/2, fp16 optimizers
    if hasattr(optimizer, "_overflow_check_and_loss_scale_update"):  # ZeRO-3 checks only under fp16

        def stage3_overflow(update_scale: bool = True) -> bool:
            optimizer.overflow = True
            return optimizer._loss_scale_update_and_overflow_cleanup() if update_scale else True

        patches["_overflow_check_and_loss_scale_update"] = stage3_overflow
    saved_flag = vars(optimizer).get("check_grad_overflow")
    if saved_flag is not None:
        optimizer.check_grad_overflow = True  # ZeRO-1/2 may skip its check under bf16/fp32
    for name, patch in patches.items():
        setattr(optimizer, name, patch)
    try:
        return original(*args, **kwargs)
    finally:
        for name in patches:
            vars(optimizer).pop(name, None)
        if saved_flag is not None:
            optimizer.check_grad_overflow = saved_flag
        if hasattr(optimizer, "_global_grad_norm"):
            optimizer._global_grad_norm = None  # not inf: the harness skipped, the gradients were not infinite


def _class_path(plugin: Any) -> str:
    """``module:Class`` of a plugin, so that ``harness report`` can rebuild plugins that were given as objects."""
    return f"{type(plugin).__module__}:{type(plugin).__qualname__}"


def _current_lr(trainer: Any) -> float | None:
    scheduler = getattr(trainer, "lr_scheduler", None)
    try:
        if scheduler is not None:
            return float(scheduler.get_last_lr()[0])
        return float(trainer.optimizer.param_groups[0]["lr"])
    except Exception:  # noqa: BLE001 - a missing LR must not break a step
        return None


def _read_state(checkpoint_dir: Path, rank: int) -> dict[str, Any]:
    path = Path(checkpoint_dir) / STATE_DIR / f"rank-{rank}.json"
    if not path.exists():
        return {}
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (OSError, json.JSONDecodeError):
        log.warning("harness: unreadable plugin state %s; plugins resume without it", path)
        return {}
