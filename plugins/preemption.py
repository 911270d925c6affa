"""preemption: SIGTERM/SIGUSR1 on any rank becomes a complete checkpoint on every rank and a clean stop.

A scheduler that preempts a job (SLURM ``--signal=USR1@90``, Kubernetes'
SIGTERM before its grace period ends, a spot instance's notice) sends a
signal to some processes, often one rank only, at any moment: in a forward
pass, an evaluation, a save. The handler (:mod:`harness.lib.signals`) only
sets a flag. At the next optimizer-step guard the rank that got it reports
``PREEMPTED`` (info) and sets its slot of the step's one exchange; after the
agreement every rank sees the same slots, and each asks the core to stop
after this step's update (``ctx.stop_after_update``): the update is applied
(nothing trained is lost), then every rank saves the Trainer's normal
checkpoint of the step (model, optimizer, scheduler, RNG, trainer_state, the
harness's state) and stops, all at the same step, with no collective of its
own. The handlers are
installed on the main thread at run start and the previous ones (a user's
own, HF's JIT checkpoint) are chained to and put back at run end.

Cost on an ordinary step: one attribute read in ``on_before_optimizer_step``,
one slot read in ``on_step_agreed``, and one int64 in the step's exchange.
"""
from __future__ import annotations

import logging
import time
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, field_validator

from harness.core.findings import FindingCode, Severity
from harness.core.hookspecs import hookimpl
from harness.core.plugin import Plugin
from harness.lib.signals import SignalFlag, signal_name, signal_number

log = logging.getLogger("harness.preemption")
SLOT = "signal"  # one int64 per rank in the step's exchange: the signal number it got (0: none)

PREEMPTED = FindingCode(
    "PREEMPTED", Severity.INFO, "A preemption signal arrived: every rank finished the step, saved a checkpoint and stopped.",
    "preemption#preempted",
)


class PreemptionOptions(BaseModel):
    """Options of the ``preemption`` plugin."""

    model_config = ConfigDict(extra="forbid")

    signals: list[str] = Field(
        ["SIGTERM", "SIGUSR1"], description="Signals that mean 'save and stop' on any rank (names such as SIGTERM, USR1; "
        "SIGKILL and SIGSTOP cannot be caught). An empty list installs no handler.",
    )

    @field_validator("signals")
    @classmethod
    def _known(cls, names: list[str]) -> list[str]:
        return [signal_name(signal_number(name)) for name in names]  # ValueError names the valid signals


class Preemption(Plugin):
    """Turns SIGTERM/SIGUSR1 on any rank into a checkpoint on every rank at the same step and a stop: PREEMPTED."""

    name = "preemption"
    Options = PreemptionOptions
    CODES = (PREEMPTED,)
    options: PreemptionOptions

    def __init__(self) -> None:
        self.options = PreemptionOptions()
        self.flag: SignalFlag | None = None
        self._acted = False

    def setup(self, ctx: Any) -> None:
        self._acted = False

    @hookimpl
    def on_run_start(self, ctx: Any, trainer: Any) -> None:
        self._restore()  # a second train() call: fresh handlers, fresh flag
        self._acted = False
        ctx.reserve(SLOT, 1, owner=self.name)  # first, on every rank alike
        # no per-step call until a signal arrives: the handler wakes the hooks that act on it; with several ranks every
        # rank reads the agreement each step, as a signal that reached another rank alone stops this one too
        self.idle_hooks("on_before_optimizer_step")
        self.idle_hooks("on_step_agreed", idle=ctx.world_size == 1)
        self.flag = SignalFlag(step=lambda: ctx.step, active=lambda: not ctx.manager.is_disabled(self.name),
                               on_receive=lambda: self.idle_hooks("on_before_optimizer_step", "on_step_agreed", idle=False))
        why_not = self.flag.install(signal_number(name) for name in self.options.signals)
        if why_not:
            log.warning("harness preemption: signals %s are not watched on rank %s: %s", self.options.signals, ctx.rank, why_not)

    @hookimpl(tryfirst=True)
    def on_before_optimizer_step(self, ctx: Any, step: int) -> None:
        flag = self.flag
        if flag is None or flag.received is None or self._acted:
            return
        self._acted = True
        self._report(ctx, step)
        ctx.share(SLOT, [flag.received.signum], owner=self.name)

    @hookimpl
    def on_step_agreed(self, ctx: Any, step: int) -> None:
        rows = ctx.shared(SLOT, owner=self.name)
        if not rows or not any(row and row[0] for row in rows):
            return
        cause = next((f for f in reversed(ctx.findings) if f.code == PREEMPTED.code and f.step == step), None)
        ctx.stop_after_update(save=True, cause=cause)  # every rank, from the same shared view: one checkpoint of this step

    def _report(self, ctx: Any, step: int) -> None:
        got = self.flag.received if self.flag is not None else None
        if got is None:
            return
        trainer = ctx.trainer
        output_dir = getattr(getattr(trainer, "args", None), "output_dir", None) or str(ctx.run_dir.parent)
        checkpoint = str(Path(output_dir) / f"checkpoint-{step}")
        only_model = bool(getattr(getattr(trainer, "args", None), "save_only_model", False))
        name = signal_name(got.signum)
        caveat = (" save_only_model is set, so the checkpoint lacks the optimizer, scheduler and RNG states: "
                  "a resume from it is not exact.") if only_model else ""
        self.report(
            PREEMPTED.code,
            f"{name} reached rank {ctx.rank} at step {got.step} ({time.monotonic() - got.monotonic:.1f} s ago); every rank "
            f"finishes step {step}, saves a checkpoint to {checkpoint} and stops (nothing trained is lost). Resume with "
            f"train(resume_from_checkpoint={checkpoint!r}).{caveat}",
            step=step,
            evidence={"signal": name, "rank": ctx.rank, "received_at_step": got.step, "stopped_at_step": step,
                      "checkpoint": checkpoint, "signals_received": got.count, "received_at": got.wall_time,
                      "seconds_to_guard": round(time.monotonic() - got.monotonic, 3), "save_only_model": only_model},
        )

    @hookimpl
    def on_run_end(self, ctx: Any, status: str) -> None:
        self._restore()  # first: a SIGTERM after train() must end the process again
        got = self.flag.received if self.flag is not None else None
        if got is not None and not self._acted:
            log.warning("harness preemption: %s reached rank %s at step %s after the last optimizer step; training ended %s "
                        "without a preemption checkpoint", signal_name(got.signum), ctx.rank, got.step, status)

    def _restore(self) -> None:
        if self.flag is not None:
            self.flag.restore()
