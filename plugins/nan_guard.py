"""nan_guard: no non-finite loss or gradient ever reaches the weights, and none goes unreported.

Per micro-batch it only queues a device-side ``isfinite`` flag and the loss
with ``defer`` (no host sync); the step guard reads them in its one transfer
for every plugin, and the gradient norm arrives as a host float. On a hit it
reports which micro-batch, rank and samples, names the first bad tensor
(:mod:`harness.lib.first_bad`: the non-finite gradients in module order, or the
first module with a non-finite output in one traced rerun of the micro-batch,
and, when that module's input was finite, which of its own parameters hold
NaN/Inf; one or two extra device reads, on that step only), writes the batch to
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
"""
from __future__ import annotations

import logging
import math
from typing import Any, Literal

import torch
from pydantic import BaseModel, ConfigDict, Field

from harness.lib.capture import IGNORE_INDEX, sample_ids, write_capture
from harness.lib.first_bad import nonfinite_names
from harness.lib.first_bad_trainer import trainer_grad_scan, trainer_locate
from harness.lib.nonfinite_origin import listed, nonfinite_steps
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

    @hookimpl
    def on_run_start(self, ctx: Any, trainer: Any) -> None:
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
        self._schedule_position = _scheduler_position(ctx.trainer)
        losses = micro_losses
        bad = [i for i, value in enumerate(losses) if not math.isfinite(value)]
        if bad:
            self._consecutive += 1
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
            spread = ""
            if ctx.world_size > 1:  # written before the ranks meet: whose NaN it was, the report's "Non-finite steps" says
                evidence["world_size"] = ctx.world_size
                spread = (f"; with {ctx.world_size} ranks the gradient all-reduce hands one rank's NaN to every rank: the rank it "
                          f"started on has a NONFINITE_LOSS at step {step}, or a NONFINITE_GRAD its own backward reproduces, and the "
                          "report's 'Non-finite steps' names it")
            head = f"gradient norm is {norm} at step {step} on rank {ctx.rank}"
            if ctx.world_size > 1 and scan.reproduced is False:  # the verdict first: the console line shows only the start
                head += (", not made by this rank's own data or backward (another rank's NaN through the gradient all-reduce, "
                         "or a transient fault): every micro-batch loss on this rank was finite; ")
            else:
                head += " although every micro-batch loss on this rank was finite; "
            self.report(
                NONFINITE_GRAD.code,
                f"{head}{scan.describe(ctx.world_size)}{spread} ({self._consecutive} non-finite step(s) in a row); "
                "the update is not applied.",
                step=step,
                evidence=evidence,
            )
            return
        self._consecutive = 0

    def _report_loss(self, ctx: Any, step: int, bad: list[int], batches: list[dict[str, Any]], losses: list[float]) -> None:
        first = bad[0]
        values = [losses[i] for i in bad]
        samples = sample_ids(batches[first])
        masked = [i for i in bad if i < len(batches) and _labels_all_masked(batches[i])]  # one read per bad micro-batch, this step only
        if first in masked:  # 0/0: a per-token mean over no labelled token. The model is fine: no module to locate
            located, where = {"locate": "skipped: every label of the micro-batch is masked"}, (
                "every label of that micro-batch is masked (-100), so its per-token mean loss is 0/0 = NaN: the masked batch is "
                "the cause, not the model or the machine (see ALL_LABELS_MASKED)")
        else:
            located, where = trainer_locate(ctx.trainer, batches[first], ctx.rank) if self.options.locate else ({"locate": "off"}, "")
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
                "all_labels_masked": masked,
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
        # a skip is agreed on every rank (each rank holds the same list): the run's summary is made once, by rank 0
        if not self.skipped_steps or not ctx.is_main:
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

    @hookimpl
    def report_sections(self, run: Any) -> Any:
        """With several ranks: per non-finite step, whose loss or gradients were non-finite, and the rank it started on."""
        from harness.report.model import ReportSection, md_table

        steps = [s for s in nonfinite_steps(run.findings) if s.several_ranks]
        if not steps:
            return None  # one process: each finding tells the whole story
        rows = [[str(s.step), listed(s.loss_ranks), listed(s.grad_ranks), s.origin()] for s in steps[:MAX_SECTION_ROWS]]
        more = f"\n({len(steps) - MAX_SECTION_ROWS} more steps in findings.jsonl)\n" if len(steps) > MAX_SECTION_ROWS else ""
        text = ("The gradient all-reduce hands one rank's NaN to every rank: a rank whose losses were finite reports the NaN it "
                "received. The rank it started on:\n\n")
        return ReportSection("Non-finite steps", text + md_table(
            ["step", "loss non-finite on", "gradients non-finite (losses finite) on", "started on"], rows) + more + "\n")


MAX_SECTION_ROWS = 50  # nan_guard reports ten steps, then every hundredth


def _scheduler_position(trainer: Any) -> int | None:
    """The scheduler's step counter: it must not move on a skipped step."""
    scheduler = getattr(trainer, "lr_scheduler", None)  # every step: the counter alone (scheduler_state's test, without its LR)
    position = getattr(scheduler, "last_epoch", None)
    return position if isinstance(position, int) and callable(getattr(scheduler, "get_last_lr", None)) else None


def _labels_all_masked(batch: Any) -> bool:
    """Whether the micro-batch has labels and every one is -100 (a flagged step only: one small device read)."""
    labels = batch.get("labels") if hasattr(batch, "get") else None
    if not torch.is_tensor(labels) or labels.is_floating_point() or labels.numel() == 0:
        return False
    return not bool((labels != IGNORE_INDEX).any())


def _as_float(value: Any) -> float | None:
    try:
        return float(value) if value is not None else None
    except (TypeError, ValueError):
        return None
