"""lr_schedule: the learning rate each update really used, against the schedule the config describes.

Many "the loss went strange" runs are a schedule that is not what the
config says: warmup lost at a resume (the scheduler's state is restored but
its shape comes from the new config), a DeepSpeed or custom scheduler that
overrides the Trainer's, an LR changed by hand, a scheduler that keeps
stepping while updates are skipped. The plugin rebuilds the configured
schedule with ``transformers.get_scheduler`` on a one-parameter optimizer and
compares, every step, the LR in the optimizer just before the update with the
reference at the scheduler's position. The schedule is stored with every
checkpoint: a resume under a different schedule is compared with the one the
run started with.
"""
from __future__ import annotations

import math
from typing import Any

from pydantic import BaseModel, ConfigDict, Field

from harness.core.findings import FindingCode, Severity
from harness.core.hookspecs import hookimpl
from harness.core.plugin import Plugin

LR_SCHEDULE_MISMATCH = FindingCode(
    "LR_SCHEDULE_MISMATCH", Severity.WARNING, "the LR an update used is not the configured schedule's", "lr-schedule#lr_schedule_mismatch"
)
LR_ADVANCED_ON_SKIPPED_STEP = FindingCode(
    "LR_ADVANCED_ON_SKIPPED_STEP", Severity.WARNING, "the LR scheduler stepped although the optimizer step was skipped",
    "lr-schedule#lr_advanced_on_skipped_step",
)
SCHEDULE_KEYS = ("type", "warmup", "total", "kwargs")  # the shape; the peak is the scheduler's own base LR (a rollback may scale it)


class LrScheduleOptions(BaseModel):
    """Options of the ``lr_schedule`` plugin."""

    model_config = ConfigDict(extra="forbid")

    rtol: float = Field(1e-4, gt=0, description="Relative difference between the applied and the scheduled LR that counts as a mismatch.")
    max_reports: int = Field(5, ge=1, description="LR_ADVANCED_ON_SKIPPED_STEP findings per run at most (LR_SCHEDULE_MISMATCH is reported once).")


class _Reference:
    """The configured schedule, replayed lazily on a throwaway one-parameter optimizer."""

    def __init__(self, schedule: dict[str, Any]) -> None:
        import torch
        from transformers import get_scheduler

        self.schedule = schedule
        param = torch.nn.Parameter(torch.zeros(1))
        self._optimizer = torch.optim.SGD([param], lr=schedule["peak"])
        self._scheduler = get_scheduler(schedule["type"], self._optimizer, num_warmup_steps=schedule["warmup"],
                                        num_training_steps=schedule["total"], scheduler_specific_kwargs=schedule["kwargs"] or {})
        self._values = [self._optimizer.param_groups[0]["lr"]]
        lambdas = getattr(self._scheduler, "lr_lambdas", None)  # LambdaLR (nearly every HF schedule): the factor at any position, O(1)
        self._factor = lambdas[0] if isinstance(lambdas, list) and len(lambdas) == 1 else None

    def at(self, position: int) -> float:
        """The LR after ``position`` scheduler steps."""
        if self._factor is not None:
            return self.schedule["peak"] * self._factor(position)
        while len(self._values) <= position:
            self._optimizer.step()
            self._scheduler.step()
            self._values.append(self._optimizer.param_groups[0]["lr"])
        return self._values[position]


class LrSchedule(Plugin):
    """Compares the applied learning rate with the configured warmup/decay; flags a scheduler that moves on skipped steps."""

    name = "lr_schedule"
    Options = LrScheduleOptions
    CODES = (LR_SCHEDULE_MISMATCH, LR_ADVANCED_ON_SKIPPED_STEP)
    options: LrScheduleOptions

    def __init__(self) -> None:
        self.options = LrScheduleOptions()
        self._trainer: Any = None
        self._schedule: dict[str, Any] | None = None
        self._reference: _Reference | None = None
        self._changed_at_resume: dict[str, tuple[Any, Any]] = {}
        self._resumed_from: str | None = None
        self._mismatch_reported = False
        self._position_before: int | None = None
        self._unchecked_reason: str | None = None

    @hookimpl
    def on_run_start(self, trainer: Any) -> None:
        self._trainer = trainer
        self._mismatch_reported = False
        self._changed_at_resume = {}
        self._unchecked_reason = _why_unchecked(trainer)
        self._schedule = None if self._unchecked_reason else configured_schedule(trainer)
        self._reference = None

    @hookimpl
    def on_resume(self, checkpoint_dir: Any, state: dict[str, Any] | None) -> None:
        saved = (state or {}).get("schedule")
        if not saved or self._schedule is None:
            return
        self._resumed_from = str(checkpoint_dir)
        self._changed_at_resume = {k: (saved.get(k), self._schedule.get(k)) for k in SCHEDULE_KEYS if saved.get(k) != self._schedule.get(k)}
        if self._changed_at_resume:  # the run's own shape is the reference, not the one edited in between
            self._schedule = {**saved, "peak": self._schedule["peak"]}

    @hookimpl
    def checkpoint_state(self) -> dict[str, Any] | None:
        return {"schedule": self._schedule} if self._schedule is not None else None

    @hookimpl(trylast=True)  # after plugins that change the LR on purpose (fault injection): see what the update gets
    def on_before_optimizer_step(self, ctx: Any, step: int, optimizer: Any) -> None:
        self._position_before = _position(self._trainer)
        if self._schedule is None or self._mismatch_reported or self._position_before is None:
            return
        try:
            applied = float(optimizer.param_groups[0]["lr"])
        except (AttributeError, IndexError, KeyError, TypeError):
            return
        if self._reference is None:
            self._reference = _Reference(self._schedule)
        expected = self._reference.at(self._position_before)
        if math.isclose(applied, expected, rel_tol=self.options.rtol, abs_tol=1e-12):
            return
        self._mismatch_reported = True
        schedule = self._schedule
        described = f"{schedule['type']}, peak {schedule['peak']:g}, warmup {schedule['warmup']} steps, {schedule['total']} steps"
        why = ""
        if self._changed_at_resume:
            changes = ", ".join(f"{k} {a!r} -> {b!r}" for k, (a, b) in self._changed_at_resume.items())
            warmup = self._changed_at_resume.get("warmup")
            shorter = " (warmup removed)" if warmup and not warmup[1] else " (warmup shorter)" if warmup and warmup[1] < warmup[0] else ""
            why = f"; the schedule changed at the resume from {self._resumed_from}: {changes}{shorter}"
        self.report(
            LR_SCHEDULE_MISMATCH.code,
            f"the update of step {step} used LR {applied:.6g}, but the run's schedule ({described}) gives {expected:.6g} at scheduler "
            f"position {self._position_before}{f' ({applied / expected:.3g}x)' if expected else ''}{why}.",
            step=step,
            evidence={"applied_lr": applied, "expected_lr": expected, "position": self._position_before, "schedule": schedule,
                      "changed_at_resume": {k: list(v) for k, v in self._changed_at_resume.items()}, "resumed_from": self._resumed_from},
        )

    @hookimpl(trylast=True)  # after anything that steps the scheduler late in the step
    def on_step_end(self, ctx: Any, step: int, metrics: dict[str, Any]) -> None:
        before, self._position_before = self._position_before, None
        if not (metrics.get("skipped") or metrics.get("optimizer_skipped")) or before is None:
            return
        after = _position(self._trainer)
        if after is None or after <= before:
            return
        who = "the harness skipped" if metrics.get("skipped") else "the optimizer skipped on its own"
        self.report(
            LR_ADVANCED_ON_SKIPPED_STEP.code,
            f"step {step} changed no weight ({who} it) but the LR scheduler moved from position {before} to {after}: the schedule "
            "now runs ahead of the updates (a warmup ends early, the decay comes sooner).",
            step=step,
            evidence={"position_before": before, "position_after": after, "skipped_by_harness": bool(metrics.get("skipped")),
                      "lr": metrics.get("lr")},
            limit=self.options.max_reports,
        )


def configured_schedule(trainer: Any) -> dict[str, Any]:
    """The schedule the Trainer's arguments describe (what ``Trainer.create_scheduler`` builds)."""
    args = trainer.args
    total = int(trainer.state.max_steps or args.max_steps)
    kind = getattr(args.lr_scheduler_type, "value", args.lr_scheduler_type)
    base = getattr(getattr(trainer, "lr_scheduler", None), "base_lrs", None)
    peak = float(base[0]) if base else float(args.learning_rate)  # restored from scheduler.pt at a resume, scaled by a rollback
    return {"type": str(kind), "peak": peak, "warmup": int(args.get_warmup_steps(total)), "total": total,
            "kwargs": dict(args.lr_scheduler_kwargs or {})}


def _why_unchecked(trainer: Any) -> str | None:
    """A schedule the Trainer's arguments do not describe: the user's own, or DeepSpeed's."""
    if not getattr(trainer, "_created_lr_scheduler", True):
        return "the Trainer was given its own scheduler"
    plugin = getattr(trainer.args, "hf_deepspeed_config", None)
    config = getattr(plugin, "config", None)
    if isinstance(config, dict) and config.get("scheduler"):
        return "DeepSpeed's config defines the scheduler"
    return None


def _position(trainer: Any) -> int | None:
    """How many times the LR scheduler has stepped."""
    scheduler = getattr(trainer, "lr_scheduler", None)
    for attr in ("last_epoch", "last_batch_iteration"):  # torch schedulers, DeepSpeed's
        value = getattr(scheduler, attr, None)
        if isinstance(value, int):
            return value
    return None


__all__ = ["LrSchedule", "LrScheduleOptions", "configured_schedule"]
