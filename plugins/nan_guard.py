"""nan_guard: no non-finite loss or gradient ever reaches the weights, and none goes unreported.

Per micro-batch it only queues a device-side ``isfinite`` flag (no host
sync); once per optimizer step, inside the step guard, it reads all flags
with one transfer. On a hit it reports which micro-batch, rank and samples,
writes the batch to ``captures/step-<N>/``, and decides the action ladder:
skip the step, and after ``max_consecutive`` non-finite steps in a row,
``escalate_to`` (``save_and_stop`` by default).
"""
from __future__ import annotations

import json
import logging
from typing import Any

import torch
from pydantic import BaseModel, ConfigDict, Field

from harness.findings import Finding, FindingCode, Severity
from harness.hookspecs import hookimpl

log = logging.getLogger("harness.nan_guard")

NONFINITE_LOSS = FindingCode(
    "NONFINITE_LOSS", Severity.ERROR, "A micro-batch's loss was NaN or Inf; the step was skipped.", "numeric-health#nonfinite_loss"
)
NONFINITE_GRAD = FindingCode(
    "NONFINITE_GRAD", Severity.ERROR, "The gradient norm was NaN or Inf with a finite loss; the step was skipped.", "numeric-health#nonfinite_grad"
)
SAMPLE_ID_KEYS = ("sample_id", "sample_ids", "idx", "id", "index")


class NanGuardOptions(BaseModel):
    """Options of the ``nan_guard`` plugin."""

    model_config = ConfigDict(extra="forbid")

    action: str = Field("skip_step", description="Action for a non-finite step (skip_step, rollback, save_and_stop, stop).")
    max_consecutive: int = Field(3, ge=1, description="After this many non-finite steps in a row, escalate instead of skipping.")
    escalate_to: str = Field("save_and_stop", description="The action once max_consecutive is reached (save_and_stop, rollback, stop).")
    check_grads: bool = Field(True, description="Also check the gradient norm (or, without one, every gradient) before each update.")
    capture: bool = Field(True, description="Write the offending micro-batch's token ids to captures/step-<N>/.")


def _sample_ids(batch: dict[str, Any]) -> list[Any] | None:
    for key in SAMPLE_ID_KEYS:
        value = batch.get(key) if isinstance(batch, dict) else None
        if value is not None:
            return value.tolist() if hasattr(value, "tolist") else list(value)
    return None


class NanGuard:
    """Skips optimizer steps whose loss or gradients are not finite, and reports them with the batch."""

    name = "nan_guard"

    def __init__(self) -> None:
        self.options = NanGuardOptions()
        self._flags: list[torch.Tensor] = []
        self._batches: list[dict[str, Any]] = []
        self._losses: list[torch.Tensor] = []
        self._consecutive = 0
        self._log_filter = False
        self.skipped_steps: list[int] = []

    @hookimpl
    def add_config(self) -> type[BaseModel]:
        return NanGuardOptions

    @hookimpl
    def declare_codes(self) -> list[FindingCode]:
        return [NONFINITE_LOSS, NONFINITE_GRAD]

    @hookimpl
    def configure(self, ctx: Any, options: NanGuardOptions) -> None:
        self.options = options

    @hookimpl
    def on_run_start(self, ctx: Any, trainer: Any) -> None:
        self._log_filter = bool(getattr(trainer.args, "logging_nan_inf_filter", False))
        self._flags, self._batches, self._losses = [], [], []

    @hookimpl
    def on_loss(self, loss: torch.Tensor, batch: dict[str, Any]) -> None:
        self._flags.append(torch.isfinite(loss).all())  # stays on the device: no sync per micro-batch
        self._losses.append(loss)
        self._batches.append(batch)

    def _grads_finite(self, model: Any, grad_norm: Any) -> bool | None:
        if grad_norm is not None:
            value = grad_norm if torch.is_tensor(grad_norm) else torch.tensor(float(grad_norm))
            return bool(torch.isfinite(value).all())
        grads = [p.grad for p in getattr(model, "parameters", lambda: [])() if p.grad is not None]
        if not grads:
            return None  # e.g. DeepSpeed ZeRO keeps reduced gradients in its own partitions
        return bool(torch.isfinite(torch.stack(torch._foreach_norm(grads))).all())

    @hookimpl
    def on_before_optimizer_step(self, ctx: Any, step: int, model: Any, grad_norm: Any) -> None:
        flags, batches, losses = self._flags, self._batches, self._losses
        self._flags, self._batches, self._losses = [], [], []
        norm_flag = self.options.check_grads and torch.is_tensor(grad_norm) and grad_norm.device == (flags[0].device if flags else grad_norm.device)
        if norm_flag:
            flags = flags + [torch.isfinite(grad_norm).all()]
        finite = torch.stack(flags).tolist() if flags else []  # the one host sync of this step
        grad_ok = finite.pop() if norm_flag else None
        bad = [i for i, ok in enumerate(finite) if not ok]
        if bad:
            self._consecutive += 1
            self._report_loss(ctx, step, bad, batches, losses)
            return
        if grad_ok is None and self.options.check_grads:
            grad_ok = self._grads_finite(model, grad_norm)
        if grad_ok is False:
            self._consecutive += 1
            norm = float(grad_norm) if grad_norm is not None else None
            ctx.report(
                NONFINITE_GRAD.code,
                f"gradient norm is {norm} at step {step} on rank {ctx.rank} although every micro-batch loss was finite "
                f"({self._consecutive} non-finite step(s) in a row); the update is not applied.",
                step=step,
                evidence={"grad_norm": norm, "consecutive": self._consecutive, "micro_batches": len(finite)},
            )
            return
        self._consecutive = 0

    def _report_loss(self, ctx: Any, step: int, bad: list[int], batches: list[dict[str, Any]], losses: list[torch.Tensor]) -> None:
        first = bad[0]
        values = [float(losses[i]) for i in bad]
        samples = _sample_ids(batches[first])
        capture = self._capture(ctx, step, first, batches[first], values[0]) if self.options.capture else None
        hidden = " The Trainer's logging_nan_inf_filter=True hides this value from its own logs." if self._log_filter else ""
        ctx.report(
            NONFINITE_LOSS.code,
            f"loss is {values[0]} at step {step}, micro-batch {first} on rank {ctx.rank} "
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
            },
        )

    def _capture(self, ctx: Any, step: int, micro: int, batch: dict[str, Any], loss: float) -> str | None:
        try:
            record = {"step": step, "micro_batch": micro, "rank": ctx.rank, "loss": loss, "sample_ids": _sample_ids(batch)}
            for key in ("input_ids", "labels", "attention_mask", "position_ids"):
                value = batch.get(key)
                if value is not None and hasattr(value, "tolist"):
                    record[key] = value.tolist()
            path = ctx.path("captures", f"step-{step}", f"nonfinite.rank-{ctx.rank}.json")
            path.write_text(json.dumps(record), encoding="utf-8")
            return str(path)
        except OSError as exc:
            log.warning("nan_guard: could not write capture: %s", exc)
            return None

    @hookimpl
    def decide_action(self, ctx: Any, finding: Finding) -> str | None:
        if finding.code not in (NONFINITE_LOSS.code, NONFINITE_GRAD.code):
            return None
        if finding.evidence.get("consecutive", 1) >= self.options.max_consecutive:
            return self.options.escalate_to
        return self.options.action

    @hookimpl
    def on_step_end(self, step: int, metrics: dict[str, Any]) -> None:
        if metrics.get("skipped"):
            self.skipped_steps.append(step)
