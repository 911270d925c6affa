"""nan_guard: no non-finite loss or gradient ever reaches the weights, and none goes unreported.

Per micro-batch it only queues a device-side ``isfinite`` flag and the loss
with ``defer`` (no host sync); the step guard reads them in its one transfer
for every plugin, and the gradient norm arrives as a host float. On a hit it
reports which micro-batch, rank and samples, names the first bad tensor
(:mod:`harness.lib.first_bad`: the non-finite gradients in module order, or the
first module with a non-finite output in one traced rerun of the micro-batch;
one extra device read, on that step only), writes the batch to
``captures/step-<N>/``, and decides the action ladder:
skip the step, and after ``max_consecutive`` non-finite steps in a row,
``escalate_to`` (``save_and_stop`` by default).

It also watches what slips past that: an update the optimizer skipped on
its own (DeepSpeed's overflow check, an fp16 GradScaler), parameters that
already hold NaN/Inf (every ``check_params_every`` steps), and, at run end,
how many steps were skipped and whether the LR scheduler held still then.

Under FSDP (FSDP2 DTensor shards, FSDP1 flat slices) every check reads the
rank's own shard only (no hidden collective); a hit on any rank's shard
becomes the step's agreed skip, so every rank leaves its shard and its
optimizer state untouched.

With several ranks the gradient all-reduce (reduce-scatter under FSDP/ZeRO)
hands one rank's NaN to every rank, so a rank whose own losses were all finite
cannot tell from its gradients alone whose fault it is. Each flagged rank
puts one integer in the step's exchange (its loss non-finite; its gradients
non-finite, and whether a rerun of its own backward reproduces them), and a
rank whose losses were finite writes its ``NONFINITE_GRAD`` after the ranks
agreed, from that shared view: when another rank's loss (or that rank's own
backward) was non-finite it names that rank, as information (the skip is that
rank's finding's); otherwise it is the error it always was. Its skip (or
escalation) is asked for before the agreement all the same, so that a step no
rank's loss explains is never applied.
"""
from __future__ import annotations

import logging
import math
from typing import Any, Literal

import torch
from pydantic import BaseModel, ConfigDict, Field

from harness.core.actions import Action
from harness.lib.capture import sample_ids, write_capture
from harness.lib.first_bad import nonfinite_names
from harness.lib.first_bad_grads import RERUN, GradScan
from harness.lib.first_bad_trainer import trainer_grad_scan, trainer_locate
from harness.core.findings import Finding, FindingCode, Severity
from harness.lib.sharding import local_tensor
from harness.core.hookspecs import hookimpl
from harness.core.plugin import Plugin

log = logging.getLogger("harness.nan_guard")


NONFINITE_LOSS = FindingCode(
    "NONFINITE_LOSS", Severity.ERROR, "A micro-batch's loss was NaN or Inf; the step was skipped.", "numeric-health#nonfinite_loss"
)
NONFINITE_GRAD = FindingCode(
    "NONFINITE_GRAD", Severity.ERROR, "The gradient norm was NaN or Inf with a finite loss; the step was skipped.", "numeric-health#nonfinite_grad"
)
OPTIMIZER_SKIPPED_STEP = FindingCode(
    "OPTIMIZER_SKIPPED_STEP",
    Severity.WARNING,
    "The optimizer skipped an update on its own (DeepSpeed or fp16 loss-scale overflow) and nothing in the logs says so.",
    "numeric-health#optimizer_skipped_step",
)
NONFINITE_PARAMS = FindingCode(
    "NONFINITE_PARAMS",
    Severity.CRITICAL,
    "Parameters already hold NaN or Inf: every later step trains a broken model; training stops.",
    "numeric-health#nonfinite_params",
)
SKIPPED_STEPS = FindingCode(
    "SKIPPED_STEPS",
    Severity.INFO,
    "How many optimizer steps were skipped in the run, and whether the LR scheduler held still during them.",
    "numeric-health#skipped_steps",
)

# this rank's part of the step exchange (one int64, shared on flagged steps only; a rank that shares nothing was clean)
SLOT = "nonfinite"
LOSS, GRAD_REPRODUCED, GRAD_NOT_REPRODUCED, GRAD = 1, 2, 3, 4  # GRAD: no rerun of this rank's own backward to tell
GRAD_STATES = (GRAD_REPRODUCED, GRAD_NOT_REPRODUCED, GRAD)


class NanGuardOptions(BaseModel):
    """Options of the ``nan_guard`` plugin."""

    model_config = ConfigDict(extra="forbid")

    action: Literal["skip_step", "rollback", "save_and_stop", "stop"] = Field(
        "skip_step", description="Action for a non-finite step (skip_step, rollback, save_and_stop, stop; never continue: "
        "the update would write NaN into the weights).")
    max_consecutive: int = Field(3, ge=1, description="After this many non-finite steps in a row, escalate instead of skipping.")
    escalate_to: Literal["save_and_stop", "rollback", "stop"] = Field(
        "save_and_stop", description="The action once max_consecutive is reached (save_and_stop, rollback, stop).")
    check_grads: bool = Field(True, description="Also check the gradient norm (or, without one, every gradient) before each update.")
    capture: bool = Field(True, description="Write the step's micro-batches to captures/step-<N>/ (token ids, text, per-sample loss).")
    locate: bool = Field(
        True, description="On a non-finite loss, rerun the first bad micro-batch once (no gradients, forward hooks on every module) "
        "to name the first module whose output is non-finite; flagged steps only.")
    check_params_every: int = Field(
        100, ge=0, description="Every this many optimizer steps, check every parameter for NaN/Inf (one device sync); 0 turns it off."
    )
    params_action: Literal["stop", "rollback"] = Field(
        "stop", description="Action when parameters are non-finite (stop, rollback; save_and_stop would save broken weights).")
    fp16_skips_in_a_row: int = Field(
        5, ge=1, description="Under fp16 loss scaling the scaler skips a step now and then by design (probing a larger scale); "
        "OPTIMIZER_SKIPPED_STEP only when this many come in a row. Without fp16 every such skip is reported.",
    )


class NanGuard(Plugin):
    """Skips optimizer steps whose loss or gradients are not finite, and reports them with the batch."""

    name = "nan_guard"
    Options = NanGuardOptions
    CODES = (NONFINITE_LOSS, NONFINITE_GRAD, NONFINITE_PARAMS, OPTIMIZER_SKIPPED_STEP, SKIPPED_STEPS)
    options: NanGuardOptions

    def __init__(self) -> None:
        self.options = NanGuardOptions()
        self._consecutive = 0
        self._log_filter = False
        self._fp16 = False
        self._schedule_position: int | None = None
        self._params_reported = False
        self._optimizer_skips_in_a_row = 0
        self.skipped_steps: list[int] = []
        self.optimizer_skips: list[int] = []
        self.scheduler_moved: list[int] = []
        self._held: dict[str, Any] | None = None  # a NONFINITE_GRAD written once the ranks agreed (several ranks only)

    @hookimpl
    def on_run_start(self, ctx: Any, trainer: Any) -> None:
        if ctx.world_size > 1:
            ctx.reserve(SLOT, 1, owner=self.name)  # first, on every rank alike
        self._held = None
        self.idle_hooks("on_step_agreed")  # called only on a step whose NONFINITE_GRAD waits for the other ranks' view
        self._log_filter = bool(getattr(trainer.args, "logging_nan_inf_filter", False))
        engine_fp16 = getattr(getattr(trainer, "model_wrapped", None), "fp16_enabled", None)
        self._fp16 = bool(getattr(trainer.args, "fp16", False)) or bool(callable(engine_fp16) and engine_fp16())
        self._optimizer_skips_in_a_row = 0
        self.skipped_steps, self.optimizer_skips, self.scheduler_moved = [], [], []
        self._params_reported = False

    @hookimpl
    def checkpoint_state(self, ctx: Any, step: int) -> dict[str, Any]:
        return {
            "consecutive": self._consecutive,
            "skipped_steps": self.skipped_steps[-10000:],
            "optimizer_skips": self.optimizer_skips[-10000:],
            "scheduler_moved": self.scheduler_moved[-10000:],
        }

    @hookimpl
    def on_resume(self, ctx: Any, state: dict[str, Any] | None) -> None:
        if not state:
            return  # the run-end summary then covers this process only
        self._consecutive = int(state.get("consecutive", 0))
        self.skipped_steps = [int(s) for s in state.get("skipped_steps", [])]
        self.optimizer_skips = [int(s) for s in state.get("optimizer_skips", [])]
        self.scheduler_moved = [int(s) for s in state.get("scheduler_moved", [])]

    def _grads_finite(self, model: Any, grad_norm: float | None) -> bool | None:
        if grad_norm is not None:
            return math.isfinite(grad_norm)
        grads = [local_tensor(p.grad) for p in getattr(model, "parameters", lambda: [])() if p.grad is not None]
        grads = [g for g in grads if g.numel()]  # an FSDP2 shard can be empty on some ranks
        if not grads:
            return None  # e.g. DeepSpeed ZeRO keeps reduced gradients in its own partitions
        # no grad norm (DeepSpeed computes it inside its step, or clipping is off): one sync of its own, only then
        return bool(torch.isfinite(torch.stack(torch._foreach_norm(grads))).all())

    @hookimpl
    def on_before_optimizer_step(self, ctx: Any, step: int, model: Any, grad_norm: float | None, micro_losses: list[float]) -> None:
        if self._held is not None:  # the last step's guard never reached its agreement: written with this rank's view alone
            self._write_held(ctx, None)
        self._schedule_position = _scheduler_position(ctx.trainer)
        losses = micro_losses
        bad = [i for i, value in enumerate(losses) if not math.isfinite(value)]
        if bad:
            self._consecutive += 1
            if ctx.world_size > 1:
                ctx.share(SLOT, [LOSS], owner=self.name)  # the other ranks' NONFINITE_GRAD then names this rank
            self._report_loss(ctx, step, bad, [batch for _, batch in ctx.step_batches], losses)  # batches kept by the loop
            return
        grad_ok: bool | None = None  # under fp16 a loss scaler owns gradient overflows: it skips and lowers its scale
        if self.options.check_grads and not self._fp16:
            grad_ok = self._grads_finite(model, grad_norm)
        if grad_ok is False:
            self._consecutive += 1
            norm = _as_float(grad_norm)
            batches = [batch for _, batch in ctx.step_batches]  # the step's micro-batches, kept by the loop
            scan = trainer_grad_scan(ctx.trainer, ctx.rank, norm, batches)  # this step only: one read, or a rerun of backward
            evidence = {"grad_norm": norm, "consecutive": self._consecutive, "micro_batches": len(losses), **scan.evidence()}
            if ctx.world_size > 1:
                self._hold_grad(ctx, step, norm, scan, evidence)
                return
            self.report(
                NONFINITE_GRAD.code,
                f"gradient norm is {norm} at step {step} on rank {ctx.rank} although every micro-batch loss was finite; "
                f"{scan.describe()} ({self._consecutive} non-finite step(s) in a row); the update is not applied.",
                step=step,
                evidence=evidence,
            )
            return
        self._consecutive = 0

    # -- several ranks: whose NaN reached this rank's gradients ------------------------------------------

    def _hold_grad(self, ctx: Any, step: int, norm: float | None, scan: GradScan, evidence: dict[str, Any]) -> None:
        """Ask for the skip now, share this rank's state, and write the finding once the ranks agreed (``on_step_agreed``).

        The finding cannot be written yet: whether another rank's loss was
        non-finite arrives with the agreement. Its action cannot wait: when no
        rank's loss explains the NaN, this rank's own ask is what skips the step.
        """
        if scan.source == RERUN and not scan.unavailable:
            state = GRAD_REPRODUCED if scan.reproduced else GRAD_NOT_REPRODUCED
        else:
            state = GRAD
        provisional = Finding(code=NONFINITE_GRAD.code, severity=NONFINITE_GRAD.severity, plugin=self.name, message="",
                              step=step, rank=ctx.rank, evidence=evidence)
        asked = ctx.decide(provisional)  # the config's policy, then this plugin's ladder: as if written now
        ctx.ask(asked)
        ctx.share(SLOT, [state], owner=self.name)
        self._held = {"step": step, "norm": norm, "scan": scan, "evidence": evidence, "state": state, "asked": asked}
        self.idle_hooks("on_step_agreed", idle=False)

    @hookimpl
    def on_step_agreed(self, ctx: Any, step: int, action: Any) -> None:
        self._write_held(ctx, ctx.shared(SLOT, owner=self.name), action)

    def _write_held(self, ctx: Any, rows: list[list[int] | None] | None, agreed: Any = None) -> None:
        """The held NONFINITE_GRAD, with every rank's state (``rows``; None: this rank's view alone)."""
        held, self._held = self._held, None
        self.idle_hooks("on_step_agreed")
        if held is None:
            return
        step, norm, scan, state = held["step"], held["norm"], held["scan"], held["state"]
        states = {rank: row[0] for rank, row in enumerate(rows or []) if row}
        states[ctx.rank] = state
        loss_ranks = sorted(r for r, s in states.items() if s == LOSS)
        grad_ranks = sorted(r for r, s in states.items() if s in GRAD_STATES)
        reproduced = sorted(r for r, s in states.items() if s == GRAD_REPRODUCED)
        clean = sorted(r for r, s in states.items() if s == GRAD_NOT_REPRODUCED)
        # the ranks whose own computation made the NaN that reached this one (none when this rank's own backward makes it)
        sources = [] if state == GRAD_REPRODUCED else (loss_ranks or reproduced)
        evidence = {**held["evidence"], "nonfinite_loss_on_ranks": loss_ranks, "nonfinite_grad_on_ranks": grad_ranks,
                    "backward_reproduced_on_ranks": reproduced, "from_ranks": sources,
                    "agreed_action": getattr(agreed, "value", agreed), "ranks_seen": rows is not None}
        in_a_row = f"{held['evidence']['consecutive']} non-finite step(s) in a row"
        what = f"gradient norm is {norm} at step {step} on rank {ctx.rank} although every micro-batch loss on this rank was finite"
        severity: Severity | None = None
        if sources:
            whose, its = _ranks(sources), "its" if len(sources) == 1 else "their"
            cause = (f"the loss of {whose} was non-finite at this step ({its} NONFINITE_LOSS)" if loss_ranks
                     else f"a rerun of {whose}'s own backward gives non-finite gradients ({its} NONFINITE_GRAD)")
            here = (f"nothing on this rank made them ({_local(scan)})" if state == GRAD_NOT_REPRODUCED
                    else f"this rank's gradients after the all-reduce: {scan.describe()}")
            message = (f"{what}: {cause}, and {its} non-finite gradients reached this rank through the gradient all-reduce; "
                       f"{here}. The cause is {whose}'s, see {its} finding of step {step}; the update is not applied on any rank "
                       f"({in_a_row}).")
            severity = Severity.INFO  # a consequence: the finding that explains the step (and asks for its skip) is the other rank's
        elif rows is None:
            message = f"{what}; {scan.describe()}; the other ranks' view of this step never arrived ({in_a_row}); the update is not applied."
        elif state == GRAD_REPRODUCED:
            also = f"; the loss of {_ranks(loss_ranks)} was non-finite at this step too" if loss_ranks else ""
            message = f"{what}; {scan.describe()}: this rank's own backward makes them{also} ({in_a_row}); the update is not applied."
        elif state == GRAD_NOT_REPRODUCED and clean == grad_ranks:
            message = (f"{what}; {_local(scan)}, as on every flagged rank ({_ranks(clean)}), and no rank's loss was non-finite: "
                       "not reproduced anywhere, a transient fault (a device, or the all-reduce itself) or one outside the model "
                       f"({in_a_row}); the update is not applied.")
        elif state == GRAD_NOT_REPRODUCED:
            unknown = [r for r in grad_ranks if r not in clean]
            message = (f"{what}; {_local(scan)}; no rank's loss was non-finite, and {_ranks(unknown)} could not rerun "
                       f"{'its' if len(unknown) == 1 else 'their'} own backward: the NaN may have reached this rank from there "
                       f"through the gradient all-reduce, or it was a transient fault ({in_a_row}); the update is not applied.")
        else:
            message = (f"{what}; {scan.describe()}; no rank's loss was non-finite at this step (non-finite gradients on "
                       f"{_ranks(grad_ranks)}) ({in_a_row}); the update is not applied.")
        # its action was asked for before the agreement (_hold_grad); another rank's NaN: that rank's finding asks for the step
        decided = Action.CONTINUE if sources else held["asked"]
        self.report(NONFINITE_GRAD.code, message, step=step, evidence=evidence, severity=severity, decided=decided)

    def _report_loss(self, ctx: Any, step: int, bad: list[int], batches: list[dict[str, Any]], losses: list[float]) -> None:
        first = bad[0]
        values = [losses[i] for i in bad]
        samples = sample_ids(batches[first])
        located, where = trainer_locate(ctx.trainer, batches[first]) if self.options.locate else ({"locate": "off"}, "")
        capture = self._capture(ctx, step, batches, losses, f"loss {values[0]} in micro-batch {first}") if self.options.capture else None
        hidden = " The Trainer's logging_nan_inf_filter=True hides this value from its own logs." if self._log_filter else ""
        self.report(
            NONFINITE_LOSS.code,
            f"loss is {values[0]} at step {step}, micro-batch {first} on rank {ctx.rank}{'; ' + where if where else ''} "
            f"({len(bad)} of {len(losses)} micro-batches non-finite; {self._consecutive} non-finite step(s) in a row); "
            f"the update is not applied.{hidden}",
            step=step,
            evidence={
                "micro_batches": bad,
                "losses": values,
                "sample_ids": samples,
                "consecutive": self._consecutive,
                "capture": capture,
                "logging_nan_inf_filter": self._log_filter,
                **located,
            },
        )

    def _capture(self, ctx: Any, step: int, batches: list[dict[str, Any]], losses: list[float], why: str) -> str | None:
        """The step's micro-batches to captures/step-<N>/; a capture that fails must not stop the skip."""
        try:
            micro = [(i, b, loss) for i, (b, loss) in enumerate(zip(batches, losses))]
            result = write_capture(ctx, step=step, code=NONFINITE_LOSS.code, reason=f"NONFINITE_LOSS at step {step}: {why}.", micro_batches=micro)
            return str(result.json_path)
        except Exception as exc:  # noqa: BLE001 - disk full, odd batch: the finding and the skip matter more
            log.warning("nan_guard: could not write the capture of step %s: %s", step, exc)
            return None

    @hookimpl
    def decide_action(self, ctx: Any, finding: Finding) -> str | None:
        if finding.code == NONFINITE_PARAMS.code:
            return self.options.params_action
        if finding.code not in (NONFINITE_LOSS.code, NONFINITE_GRAD.code):
            return None
        if finding.evidence.get("consecutive", 1) >= self.options.max_consecutive:
            return self.options.escalate_to
        return self.options.action

    @hookimpl
    def on_step_end(self, ctx: Any, step: int, metrics: dict[str, Any]) -> None:
        every = self.options.check_params_every
        if every and step % every == 0 and not self._params_reported:
            self._check_params(ctx, step)
        skipped_by_us, skipped_alone = bool(metrics.get("skipped")), bool(metrics.get("optimizer_skipped"))
        self._optimizer_skips_in_a_row = self._optimizer_skips_in_a_row + 1 if skipped_alone else 0
        if not (skipped_by_us or skipped_alone):
            return
        self.skipped_steps.append(step)
        position = _scheduler_position(ctx.trainer)
        if position is not None and self._schedule_position is not None and position != self._schedule_position:
            self.scheduler_moved.append(step)
        if skipped_alone:
            self._report_optimizer_skip(ctx, step, metrics)

    def _check_params(self, ctx: Any, step: int) -> None:
        """One finiteness flag per floating-point parameter tensor, read with one transfer."""
        model = getattr(ctx.trainer, "model", None)
        named = [(n, local_tensor(getattr(p, "ds_tensor", p))) for n, p in model.named_parameters()] if model is not None else []
        bad, checked = nonfinite_names(named)  # floating-point tensors only (quantized weights are integers); one read
        if not bad:
            return
        self._params_reported = True
        self.report(
            NONFINITE_PARAMS.code,
            f"{len(bad)} of {checked} parameter tensors hold NaN or Inf after step {step} on rank {ctx.rank} "
            f"(first: {', '.join(bad[:3])}); the model is broken from here on.",
            step=step,
            evidence={"parameters": bad[:50], "count": len(bad), "checked_tensors": checked},
        )

    def _report_optimizer_skip(self, ctx: Any, step: int, metrics: dict[str, Any]) -> None:
        self.optimizer_skips.append(step)
        count, in_a_row = len(self.optimizer_skips), self._optimizer_skips_in_a_row
        if self._fp16 and in_a_row != self.options.fp16_skips_in_a_row:
            return  # the scaler's routine probing; a run of skips is reported once, when it reaches the limit
        engine = "DeepSpeed engine" if getattr(ctx.trainer, "is_deepspeed_enabled", False) else "optimizer (fp16 loss scaler)"
        self.report(
            OPTIMIZER_SKIPPED_STEP.code,
            f"the {engine} skipped the update of step {step} on its own (an overflow: non-finite gradients or loss scale); "
            f"{count} such step(s) so far, {in_a_row} in a row. The Trainer counts it as a normal step and its logs do not say so.",
            step=step,
            evidence={"optimizer_skips": count, "in_a_row": in_a_row, "fp16": self._fp16, "grad_norm": _as_float(metrics.get("grad_norm")), "lr": metrics.get("lr")},
            limit=None if count % 100 == 0 else 10, say_limit=False,  # ten reports, then only every hundredth skip
        )

    @hookimpl
    def on_run_end(self, ctx: Any) -> None:
        self._write_held(ctx, None)  # a step that never reached its agreement: written with this rank's view alone
        if not self.skipped_steps:
            return
        moved = self.scheduler_moved
        held = "the LR scheduler held still during every one" if not moved else f"the LR scheduler kept advancing during {len(moved)} of them (steps {moved[:10]})"
        self.report(
            SKIPPED_STEPS.code,
            f"{len(self.skipped_steps)} optimizer step(s) were skipped in this run ({len(self.optimizer_skips)} by the optimizer "
            f"on its own); {held}.",
            step=ctx.step,
            evidence={"skipped_steps": self.skipped_steps[:200], "optimizer_skips": self.optimizer_skips[:200], "scheduler_advanced": moved[:200]},
            severity=Severity.WARNING if moved else None,
        )


def _scheduler_position(trainer: Any) -> int | None:
    """The scheduler's step counter: it must not move on a skipped step."""
    scheduler = getattr(trainer, "lr_scheduler", None)  # every step: the counter alone (scheduler_state's test, without its LR)
    position = getattr(scheduler, "last_epoch", None)
    return position if isinstance(position, int) and callable(getattr(scheduler, "get_last_lr", None)) else None


def _ranks(ranks: list[int]) -> str:
    return f"rank {ranks[0]}" if len(ranks) == 1 else "ranks " + ", ".join(str(r) for r in ranks)


def _local(scan: GradScan) -> str:
    """What this rank's own gradients say, without calling a NaN that came through the all-reduce a transient fault."""
    if scan.source == RERUN and not scan.unavailable and not scan.names:
        return "a rerun of this rank's own backward on the same weights, which does not all-reduce, gave finite gradients"
    return scan.describe()


def _as_float(value: Any) -> float | None:
    try:
        return float(value) if value is not None else None
    except (TypeError, ValueError):
        return None
