"""loss_baseline: the first losses against ln(vocab size), the gradient-accumulation loss trap, and micro-batches with nothing to learn from.

A language model initialised from scratch predicts a near-uniform
distribution, so its first loss sits near ln(V). Far above means a broken
initialisation or label/vocabulary mismatch; far below, for a model that
should know nothing yet, means the labels leak into the inputs or the data
is trivially repetitive. A model with trained weights (loaded, or trained
before) legitimately starts low: it is not judged against ln(V) from below,
only by a leak test that needs no ln(V) (targets equal to the input token at
the same position). Before any of that, a step loss GA times its own
micro-batch mean (a ``compute_loss`` that ignores ``num_items_in_batch``) is
``GA_LOSS_SCALING``, and the first loss is judged with the factor taken out.
Cost of that check: one forward pass without gradients over the first
micro-batch of the first step of each ``train()`` call, only with
gradient_accumulation_steps > 1, and nothing afterwards. A micro-batch whose
labels are all masked (-100) trains on nothing and shows up as loss 0 in
TRL, or NaN with a per-token mean.
"""
from __future__ import annotations

import math
from typing import Any, Literal

import torch
from pydantic import BaseModel, ConfigDict, Field

from harness.core.findings import FindingCode, Severity
from harness.core.hookspecs import hookimpl
from harness.core.plugin import Plugin
from harness.lib.capture import IGNORE_INDEX, can_recompute
from harness.lib.ga_scaling import GaScaling, judge_ga_scaling, micro_batch_mean_loss
from harness.lib.model_state import loaded_from, weights_state
from harness.lib.trainer_kind import token_loss

INITIAL_LOSS_ANOMALY = FindingCode(
    "INITIAL_LOSS_ANOMALY",
    Severity.WARNING,
    "The first loss is far from ln(vocab size), what an untrained model should show.",
    "numeric-health#initial_loss_anomaly",
)
GA_LOSS_SCALING = FindingCode(
    "GA_LOSS_SCALING",
    Severity.WARNING,
    "The step loss is gradient_accumulation_steps times its micro-batches' own mean (or 1/GA): loss and gradients are scaled.",
    "numeric-health#ga_loss_scaling",
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
        "suspicious, and 'far below' with targets that copy the input), 'auto' (from the weights: 'pretrained' when a norm "
        "weight was trained, 'scratch' when all are at their initial constant, otherwise a low first loss is info only).",
    )
    low_ratio: float = Field(0.5, gt=0, description="First loss below low_ratio * ln(V) is 'far below'.")
    high_ratio: float = Field(1.5, gt=1, description="First loss above high_ratio * ln(V) is 'far above'.")
    check_masked_labels: bool = Field(True, description="Report micro-batches whose labels are all -100 (ALL_LABELS_MASKED).")
    check_ga_scaling: bool = Field(
        True, description="With gradient accumulation, recompute the first micro-batch's mean loss once (one forward pass without "
        "gradients) and report a step loss scaled by the accumulation factor (GA_LOSS_SCALING).",
    )
    copy_fraction: float = Field(
        0.5, gt=0, le=1, description="A model with trained weights whose first loss is far below ln(V) is reported only when at least "
        "this fraction of the first micro-batch's targets equal the input token at the same position (labels leaking).",
    )


class LossBaseline(Plugin):
    """Checks the first loss against ln(vocab) and flags micro-batches whose labels are all masked."""

    name = "loss_baseline"
    Options = LossBaselineOptions
    CODES = (INITIAL_LOSS_ANOMALY, GA_LOSS_SCALING, ALL_LABELS_MASKED)
    options: LossBaselineOptions

    def __init__(self) -> None:
        self.options = LossBaselineOptions()
        self._vocab: int | None = None
        self._first_done = False
        self._trainer: Any = None
        self._weights = "unknown"
        self._loaded_from: str | None = None
        self._ga_step: int | None = None  # the step whose first micro-batch was recomputed (once per train() call)
        self._ga: GaScaling | None = None
        self._copy: float | None = None

    @hookimpl
    def on_run_start(self, ctx: Any, trainer: Any) -> None:
        config = getattr(getattr(trainer, "model", None), "config", None)
        vocab = getattr(config, "vocab_size", None) or getattr(getattr(config, "text_config", None), "vocab_size", None)
        self._vocab = int(vocab) if vocab else None
        self._trainer, self._ga_step, self._ga, self._copy = trainer, None, None, None
        # the accumulation check looks at one micro-batch per train() call: no per-micro-batch call before or after it
        self.idle_hooks("on_loss", idle=not self.options.check_ga_scaling or _accumulation(trainer) < 2)
        model = getattr(trainer, "model", None)
        self._weights, self._loaded_from = weights_state(model), loaded_from(model)
        # a resumed run is past its first steps; a preference or policy-gradient loss (DPO: ln 2 at the start, GRPO's
        # near 0) is not a token loss to hold against ln(vocab)
        self._first_done = ctx.resumed_from is not None or not token_loss(trainer)
        self.idle_hooks("on_step_end", idle=self._first_done)  # the first step's check is its only work

    @hookimpl
    def inspect_batch(self, batch: dict[str, Any], micro_step: int) -> None:
        labels = batch.get("labels") if hasattr(batch, "get") else None  # a dict or a BatchEncoding
        if not torch.is_tensor(labels):
            return
        if self.options.check_masked_labels:
            # device-side, read in the guard's one transfer: the count of labelled positions (0: every label masked); a
            # count, not any(), which measured twice as costly on the training thread (a kernel the model never warms)
            self.defer("has_labels", (labels != IGNORE_INDEX).sum())
        ids = batch.get("input_ids")
        if not self._first_done and micro_step == 0 and self._copy is None and torch.is_tensor(ids) and ids.shape == labels.shape:
            self._copy = -1.0  # queued: the first micro-batch only
            target, kept = labels[:, 1:], labels[:, 1:] != IGNORE_INDEX
            self.defer("copy", ((target == ids[:, :-1]) & kept).sum() / kept.sum().clamp_min(1))

    @hookimpl
    def on_loss(self, ctx: Any, loss: Any, batch: dict[str, Any], step: int, micro_step: int) -> None:
        if self._ga_step is not None or micro_step != 0 or not self.options.check_ga_scaling or _accumulation(self._trainer) < 2:
            return
        self._ga_step = step  # once per train() call, whatever happens below
        self.idle_hooks("on_loss")
        if not ctx.is_main:
            return  # the job's loss code is the same on every rank: one forward pass and one finding, on rank 0
        if can_recompute(self._trainer) is not None:
            return  # sharded parameters: a forward pass on one rank alone would hang
        mean = micro_batch_mean_loss(self._trainer.model, batch)
        if mean is not None:
            self.defer("ga/micro", loss)
            self.defer("ga/recomputed", mean)

    @hookimpl
    def on_before_optimizer_step(self, ctx: Any, step: int, loss: Any) -> None:
        if self._copy == -1.0:
            got = self.deferred("copy")
            self._copy = float(got[0]) if got else None
        if step == self._ga_step and loss is not None:
            micro, recomputed = self.deferred("ga/micro"), self.deferred("ga/recomputed")
            if micro and recomputed:
                self._check_ga(ctx, step, float(loss), float(micro[0]), float(recomputed[0]))
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
        self.idle_hooks("on_step_end")  # done for this train() call
        if not ctx.is_main:
            return  # judged once for the job (rank 0), not once per rank
        # the step loss as the Trainer logs it (micro-batch losses combined as it combines them)
        self._check_first_loss(ctx, step, float(metrics["loss"]))

    def _check_ga(self, ctx: Any, step: int, step_loss: float, micro: float, recomputed: float) -> None:
        found = judge_ga_scaling(step_loss, micro, recomputed, _accumulation(self._trainer))
        if found is None:
            return
        self._ga = found
        ga = found.accumulation
        if found.factor > 1:
            cause = (f"compute_loss returned micro-batch 0's own mean ({micro:.4f}; recomputed {recomputed:.4f}) and the Trainer, which "
                     "passes num_items_in_batch and so takes the loss as already normalised over the step, did not divide it by "
                     f"gradient_accumulation_steps={ga}" if micro > 0 and abs(math.log(micro / recomputed)) < math.log(ga) / 2 else
                     f"compute_loss returned {micro:.4f} for micro-batch 0 (its own mean is {recomputed:.4f})")
            effect = f"the logged loss and every gradient are {ga}x too large (measured {found.factor:.2f}x; expected 1x)"
            fix = ("use num_items_in_batch in compute_loss (summed token loss / num_items_in_batch), or set loss_is_scaled_for_ga = False "
                   "on the Trainer subclass so that the Trainer divides by gradient_accumulation_steps")
        else:
            cause = f"compute_loss returned {micro:.4f} for micro-batch 0 (its own mean is {recomputed:.4f}) and the loss was divided again"
            effect = f"the logged loss and every gradient are 1/{ga} of what they should be (measured {found.factor:.2f}x; expected 1x)"
            fix = "do not divide a loss normalised by num_items_in_batch again (drop loss_is_scaled_for_ga = False or the extra division)"
        self.report(
            GA_LOSS_SCALING.code,
            f"the loss of step {step}, {step_loss:.4f}, is {found.factor:.2f}x its first micro-batch's own per-token mean "
            f"{recomputed:.4f} with gradient_accumulation_steps={ga}: {cause}; {effect}. Fix: {fix}.",
            step=step,
            evidence={**found.evidence(), "trainer": type(self._trainer).__name__,
                      "model_accepts_loss_kwargs": getattr(self._trainer, "model_accepts_loss_kwargs", None),
                      "loss_is_scaled_for_ga": getattr(self._trainer, "loss_is_scaled_for_ga", None)},
        )

    def _check_first_loss(self, ctx: Any, step: int, loss: float) -> None:
        if not self._vocab or self._vocab < 2 or not math.isfinite(loss):
            return  # nan_guard reports non-finite losses
        logged = loss
        if self._ga is not None:
            loss = loss / self._ga.scale  # judged as it should have been: GA_LOSS_SCALING names the factor
        expected = math.log(self._vocab)
        ratio = loss / expected
        evidence: dict[str, Any] = {"first_loss": loss, "ln_vocab": expected, "ratio": ratio, "vocab_size": self._vocab,
                                    "weights": self._weights, "loaded_from": self._loaded_from, "copy_fraction": self._copy}
        if self._ga is not None:
            evidence.update(logged_first_loss=logged, ga_scale_removed=self._ga.scale)
        o = self.options
        if ratio > o.high_ratio:
            removed = f" (logged {logged:.3f}; the GA_LOSS_SCALING factor taken out)" if self._ga is not None else ""
            suspects = ("the weights are trained: suspect a tokenizer from another model, weights that did not load (missing keys) or "
                        "mis-shifted labels" if self._weights == "trained" else
                        "suspect the initialisation scale, a vocabulary/label mismatch or mis-shifted labels")
            self.report(
                INITIAL_LOSS_ANOMALY.code,
                f"first loss {loss:.3f}{removed} is {ratio:.2f}x ln(vocab={self._vocab})={expected:.3f}: far above an untrained "
                f"model's; {suspects}.",
                step=step,
                evidence=evidence,
            )
        elif ratio < o.low_ratio:
            self._check_low(step, loss, ratio, expected, evidence)

    def _check_low(self, step: int, loss: float, ratio: float, expected: float, evidence: dict[str, Any]) -> None:
        """Far below ln(V): a leak for fresh weights; for trained weights only with targets that copy the input."""
        o, copy = self.options, self._copy
        expect = o.expect if o.expect != "auto" else {"trained": "pretrained", "fresh": "scratch"}.get(self._weights, "auto")
        if expect == "pretrained":
            if copy is not None and copy >= o.copy_fraction:
                self.report(
                    INITIAL_LOSS_ANOMALY.code,
                    f"first loss {loss:.3f} is only {ratio:.2f}x ln(vocab={self._vocab}), and {copy:.0%} of the first micro-batch's "
                    "targets are the input token at the same position: the labels leak into the inputs (not shifted, or shifted "
                    "the wrong way), or padding is trained on.",
                    step=step, evidence=evidence,
                )
            return  # trained weights start low: that is what loading them is for
        fresh = " (the weights are fresh: every norm weight is still at its initial constant)" if self._weights == "fresh" else ""
        self.report(
            INITIAL_LOSS_ANOMALY.code,
            f"first loss {loss:.3f} is only {ratio:.2f}x ln(vocab={self._vocab})={expected:.3f}: far below an untrained model's{fresh}; "
            "if the model starts from scratch, suspect labels leaking into the inputs or trivially repetitive data.",
            step=step,
            evidence=evidence,
            severity=Severity.WARNING if expect == "scratch" else Severity.INFO,
        )


def _accumulation(trainer: Any) -> int:
    args = getattr(trainer, "args", None)
    return int(getattr(args, "gradient_accumulation_steps", 1) or 1)


