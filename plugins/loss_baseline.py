"""loss_baseline: the first losses against ln(vocab size), and micro-batches with nothing to learn from.

A language model initialised from scratch predicts a near-uniform
distribution, so its first loss sits near ln(V). Far above means a broken
initialisation or label/vocabulary mismatch; far below, for a model that
should know nothing yet, means the labels leak into the inputs or the data
is trivially repetitive. A micro-batch whose labels are all masked (-100)
trains on nothing and shows up as loss 0 in TRL, or NaN with a per-token mean.
"""
from __future__ import annotations

import math
from typing import Any, Literal

import torch
from pydantic import BaseModel, ConfigDict, Field

from harness.core.findings import FindingCode, Severity
from harness.core.hookspecs import hookimpl
from harness.core.plugin import Plugin

INITIAL_LOSS_ANOMALY = FindingCode(
    "INITIAL_LOSS_ANOMALY",
    Severity.WARNING,
    "The first loss is far from ln(vocab size), what an untrained model should show.",
    "numeric-health#initial_loss_anomaly",
)
ALL_LABELS_MASKED = FindingCode(
    "ALL_LABELS_MASKED",
    Severity.WARNING,
    "A micro-batch had every label masked (-100): it trained on nothing.",
    "numeric-health#all_labels_masked",
)


class LossBaselineOptions(BaseModel):
    """Options of the ``loss_baseline`` plugin."""

    model_config = ConfigDict(extra="forbid")

    expect: Literal["auto", "scratch", "pretrained"] = Field(
        "auto",
        description="What the first loss should look like: 'scratch' (near ln(V)), 'pretrained' (only 'far above' is "
        "suspicious), 'auto' (scratch unless resuming or the first loss is plausibly a trained model's: "
        "a low first loss is then reported at info severity only).",
    )
    low_ratio: float = Field(0.5, gt=0, description="First loss below low_ratio * ln(V) is 'far below'.")
    high_ratio: float = Field(1.5, gt=1, description="First loss above high_ratio * ln(V) is 'far above'.")
    check_masked_labels: bool = Field(True, description="Report micro-batches whose labels are all -100 (ALL_LABELS_MASKED).")


class LossBaseline(Plugin):
    """Checks the first loss against ln(vocab) and flags micro-batches whose labels are all masked."""

    name = "loss_baseline"
    Options = LossBaselineOptions
    CODES = (INITIAL_LOSS_ANOMALY, ALL_LABELS_MASKED)
    options: LossBaselineOptions

    def __init__(self) -> None:
        self.options = LossBaselineOptions()
        self._vocab: int | None = None
        self._first_done = False

    @hookimpl
    def on_run_start(self, ctx: Any, trainer: Any) -> None:
        config = getattr(getattr(trainer, "model", None), "config", None)
        vocab = getattr(config, "vocab_size", None) or getattr(getattr(config, "text_config", None), "vocab_size", None)
        self._vocab = int(vocab) if vocab else None
        # a resumed run is past its first steps; a preference loss (DPO: ln 2 at the start) is not a token loss
        self._first_done = ctx.resumed_from is not None or "DPO" in type(trainer).__name__

    @hookimpl
    def inspect_batch(self, batch: dict[str, Any]) -> None:
        if not self.options.check_masked_labels:
            return
        labels = batch.get("labels") if isinstance(batch, dict) else None
        if torch.is_tensor(labels):
            self.defer("has_labels", (labels != -100).any())  # device-side, read in the guard's one transfer

    @hookimpl
    def on_before_optimizer_step(self, ctx: Any, step: int) -> None:
        has_labels = self.deferred("has_labels")
        empty = [i for i, ok in enumerate(has_labels) if not ok]
        if empty:
            self.report(
                ALL_LABELS_MASKED.code,
                f"{len(empty)} of {len(has_labels)} micro-batches at step {step} on rank {ctx.rank} have every label masked "
                "(-100): they contribute no gradient (TRL logs loss 0 for them).",
                step=step,
                evidence={"micro_batches": empty},
                limit=20,
            )

    @hookimpl
    def on_step_end(self, ctx: Any, step: int, metrics: dict[str, Any]) -> None:
        if self._first_done or metrics.get("loss") is None:
            return
        self._first_done = True
        # the step loss as the Trainer logs it (micro-batch losses combined as it combines them)
        self._check_first_loss(ctx, step, float(metrics["loss"]))

    def _check_first_loss(self, ctx: Any, step: int, loss: float) -> None:
        if not self._vocab or self._vocab < 2 or not math.isfinite(loss):
            return  # nan_guard reports non-finite losses
        expected = math.log(self._vocab)
        ratio = loss / expected
        evidence = {"first_loss": loss, "ln_vocab": expected, "ratio": ratio, "vocab_size": self._vocab}
        o = self.options
        if ratio > o.high_ratio:
            self.report(
                INITIAL_LOSS_ANOMALY.code,
                f"first loss {loss:.3f} is {ratio:.2f}x ln(vocab={self._vocab})={expected:.3f}: far above an untrained model's; "
                "suspect the initialisation scale, a vocabulary/label mismatch or mis-shifted labels.",
                step=step,
                evidence=evidence,
            )
        elif ratio < o.low_ratio and o.expect != "pretrained":
            self.report(
                INITIAL_LOSS_ANOMALY.code,
                f"first loss {loss:.3f} is only {ratio:.2f}x ln(vocab={self._vocab})={expected:.3f}: far below an untrained model's; "
                "if the model starts from scratch, suspect labels leaking into the inputs or trivially repetitive data.",
                step=step,
                evidence=evidence,
                severity=Severity.WARNING if o.expect == "scratch" else Severity.INFO,
            )
