"""loss_baseline: the first losses against an untrained model's, the gradient-accumulation loss trap, and micro-batches with nothing to learn from.

A model initialised from scratch predicts a near-uniform distribution, so
its first loss sits near the log of its number of outputs: ln(V) for a token
loss, ln(number of labels) for single-label classification
(:mod:`harness.lib.untrained_loss`). A loss with no such level (regression,
multi-label, contrastive or custom) is not judged: one info finding,
``LOSS_UNANCHORED``, says so. Far above means a broken
initialisation or label/vocabulary mismatch; far below, for a model that
should know nothing yet, means the labels leak into the inputs or the data
is trivially repetitive. A model with trained weights (loaded, or trained
before) legitimately starts low: it is not judged against ln(V) from below,
only by a leak test that needs no ln(V) (targets equal to the input token at
the same position). Before any of that, a step loss GA times its own
micro-batch mean (a loss that ignores ``num_items_in_batch``: a
``compute_loss`` override, or a head such as BERT's classifiers) is
``GA_LOSS_SCALING``, and the first loss is judged with the factor taken out.
Cost of that check: one forward pass without gradients over the first
micro-batch of the first step of each ``train()`` call, only with
gradient_accumulation_steps > 1, and nothing afterwards. With several ranks
averaging tokens the Trainer multiplies the loss by the world size, right
only for a loss normalised by ``num_items_in_batch``: the bridge recomputes
the first micro-batch's own mean on every rank for its per-rank loss record
(:mod:`harness.hf.loss_probe`) and hands the judgement to ``on_step_end``,
where a loss that was its own mean times the world size is
``LOSS_SCALED_BY_WORLD_SIZE`` (the record, and so the first loss judged
here, hold the rank's own mean already). A micro-batch whose
labels are all masked (-100) trains on nothing and shows up as loss 0 in
TRL, or NaN with a per-token mean.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Literal

import torch
from pydantic import BaseModel, ConfigDict, Field

from harness.core.findings import FindingCode, Severity
from harness.core.hookspecs import hookimpl
from harness.core.plugin import Plugin
from harness.lib.capture import IGNORE_INDEX, can_recompute
from harness.lib.ga_scaling import GaScaling, judge_ga_scaling
from harness.lib.model_state import loaded_from, weights_state
from harness.lib.trainer_kind import token_loss
from harness.lib.untrained_loss import UntrainedLoss, none, settled_by_labels, untrained_loss
from harness.lib.world_scaling import WORLD_SCALING_KEY, WorldScaling, loss_source, own_mean_loss, world_loss_scale

INITIAL_LOSS_ANOMALY = FindingCode(
    "INITIAL_LOSS_ANOMALY",
    Severity.WARNING,
    "The first loss is far from what an untrained model scores (ln(vocab size) for a token loss, ln(num_labels) for a classifier).",
    "numeric-health#initial_loss_anomaly",
)
GA_LOSS_SCALING = FindingCode(
    "GA_LOSS_SCALING",
    Severity.WARNING,
    "The step loss is gradient_accumulation_steps times its micro-batches' own mean (or 1/GA): loss and gradients are scaled.",
    "numeric-health#ga_loss_scaling",
)
LOSS_SCALED_BY_WORLD_SIZE = FindingCode(
    "LOSS_SCALED_BY_WORLD_SIZE",
    Severity.WARNING,
    "The Trainer multiplied a loss that ignores num_items_in_batch by the world size (average_tokens_across_devices): "
    "the logged loss and every gradient are world-size times too large.",
    "numeric-health#loss_scaled_by_world_size",
)
LOSS_UNANCHORED = FindingCode(
    "LOSS_UNANCHORED",
    Severity.INFO,
    "The loss has no untrained level (regression, multi-label, contrastive or custom loss): its start is not judged, and the "
    "loss checks anchor on the run's own first losses only.",
    "numeric-health#loss_unanchored",
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
    check_world_scaling: bool = Field(
        True, description="With several ranks averaging tokens (average_tokens_across_devices), report a loss the Trainer "
        "multiplied by the world size though it ignores num_items_in_batch (LOSS_SCALED_BY_WORLD_SIZE), judged from the "
        "first micro-batch's own mean that the harness recomputes once per train() call on every rank for its per-rank loss "
        "record (one forward pass without gradients).",
    )
    copy_fraction: float = Field(
        0.5, gt=0, le=1, description="A model with trained weights whose first loss is far below ln(V) is reported only when at least "
        "this fraction of the first micro-batch's targets equal the input token at the same position (labels leaking).",
    )


class LossBaseline(Plugin):
    """Checks the first loss against ln(vocab) and flags micro-batches whose labels are all masked."""

    name = "loss_baseline"
    Options = LossBaselineOptions
    CODES = (INITIAL_LOSS_ANOMALY, GA_LOSS_SCALING, LOSS_SCALED_BY_WORLD_SIZE, ALL_LABELS_MASKED, LOSS_UNANCHORED)
    options: LossBaselineOptions

    def __init__(self) -> None:
        self.options = LossBaselineOptions()
        self._level: UntrainedLoss = none("not started")
        self._first_done = False
        self._trainer: Any = None
        self._weights = "unknown"
        self._loaded_from: str | None = None
        self._ga_step: int | None = None  # the step whose first micro-batch was recomputed (once per train() call)
        self._ga: GaScaling | None = None
        self._world = 1  # what the Trainer multiplies the loss by across ranks (1: it does not)
        self._world_pending = False  # the first step's world-scaling judgement is still to read
        self._world_scaling: WorldScaling | None = None  # the loss was the world size times its own mean
        self._world_told = False  # the recomputation told whether the loss ignores num_items_in_batch
        self._copy: float | None = None
        self._said_unanchored = False

    @hookimpl
    def on_run_start(self, ctx: Any, trainer: Any) -> None:
        self._level = untrained_loss(trainer)
        self._trainer, self._ga_step, self._ga, self._copy, self._world_scaling = trainer, None, None, None, None
        self._world_told = False
        self._world = world_loss_scale(trainer)
        # with several ranks averaging tokens the bridge recomputes the first micro-batch's own mean (every rank, for its
        # loss record) and hands it to on_step_end: both checks read it there, nothing is recomputed here
        self._world_pending = self._world > 1 and (self.options.check_world_scaling or self.options.check_ga_scaling)
        # the accumulation check looks at one micro-batch per train() call: no per-micro-batch call before or after it
        self.idle_hooks("on_loss", idle=not self.options.check_ga_scaling or _accumulation(trainer) < 2 or self._world > 1)
        model = getattr(trainer, "model", None)
        self._weights, self._loaded_from = weights_state(model), loaded_from(model)
        # a resumed run is past its first steps; a loss with no untrained level (a preference or policy loss, regression,
        # contrastive ...) has no start to judge
        self._first_done = ctx.resumed_from is not None or self._level.kind == "none"
        if self._level.kind == "none" and ctx.resumed_from is None:
            self._unanchored(ctx)
        self.idle_hooks("on_step_end", idle=self._first_done and not self._world_pending)  # the first step's checks are its only work

    @hookimpl
    def inspect_batch(self, ctx: Any, batch: dict[str, Any], micro_step: int) -> None:
        labels = batch.get("labels") if hasattr(batch, "get") else None  # a dict or a BatchEncoding
        if not torch.is_tensor(labels):
            return
        if self.options.check_masked_labels:
            # device-side, read in the guard's one transfer: the count of labelled positions (0: every label masked); a
            # count, not any(), which measured twice as costly on the training thread (a kernel the model never warms)
            self.defer("has_labels", (labels != IGNORE_INDEX).sum())
        if self._level.kind == "pending" and micro_step == 0:  # transformers picks the classifier's loss from the labels' dtype
            self._level = settled_by_labels(self._level, labels)
            if self._level.kind == "none":
                self._first_done = True
                self._unanchored(ctx)
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
        mean = own_mean_loss(self._trainer, batch)
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
            where = masked_labels_check(self._trainer)
            self.report(
                ALL_LABELS_MASKED.code,
                f"{len(empty)} of {len(has_labels)} micro-batches at step {step} on rank {ctx.rank} have every label masked "
                f"(-100): they contribute no gradient (TRL logs loss 0 for them, a per-token mean NaN). Check: {where.check}",
                step=step,
                evidence={"micro_batches": empty, **where.evidence()},
                limit=20,
            )

    @hookimpl
    def on_step_end(self, ctx: Any, step: int, metrics: dict[str, Any]) -> None:
        if self._world_pending:
            self._world_pending = False  # the bridge recomputes at the train() call's first step only
            scaling = metrics.get(WORLD_SCALING_KEY)
            if scaling is not None and ctx.is_main and metrics.get("loss") is not None:
                self._world_told = scaling.own_mean is not None
                self._check_world(ctx, step, scaling, float(metrics["loss"]))
        if self._first_done:
            self.idle_hooks("on_step_end")  # done for this train() call
            return
        if metrics.get("loss") is None:
            return
        self._first_done = True
        self.idle_hooks("on_step_end")  # done for this train() call
        if not ctx.is_main:
            return  # judged once for the job (rank 0), not once per rank
        # the step loss as the Trainer logs it (micro-batch losses combined as it combines them)
        self._check_first_loss(ctx, step, float(metrics["loss"]))

    def _unanchored(self, ctx: Any) -> None:
        """One info finding per run (rank 0): the start of this loss is not judged, and why."""
        if ctx is None or not ctx.is_main or self._said_unanchored or not token_loss(self._trainer):
            return  # a preference or policy trainer is silent: its loss is judged by its own plugin (dpo_health, grpo_health)
        self._said_unanchored = True
        self.report(
            LOSS_UNANCHORED.code,
            f"the first loss is not judged against an untrained level: {self._level.basis}. Loss checks anchor on the run's "
            "own first losses instead.",
            step=0,
            evidence={"reason": self._level.basis, "model": type(getattr(self._trainer, "model", None)).__name__,
                      "trainer": type(self._trainer).__name__},
        )

    def _check_world(self, ctx: Any, step: int, scaling: WorldScaling, step_loss: float) -> None:
        """The first micro-batch the bridge recomputed: a loss the Trainer scaled by the world size; the accumulation trap.

        ``step_loss`` is rank 0's own mean as the bridge records it (the
        world factor taken out when the head ignores num_items_in_batch), so
        the accumulation check compares it with the recomputed mean alike.
        """
        if self.options.check_ga_scaling and _accumulation(self._trainer) >= 2:
            self._check_ga(ctx, step, step_loss, scaling.micro_loss / scaling.scale, scaling.recomputed)
        if not scaling.own_mean:
            return
        self._world_scaling = scaling
        if not self.options.check_world_scaling:
            return
        args = getattr(self._trainer, "args", None)
        clip = getattr(args, "max_grad_norm", None)
        w = scaling.scale
        clipping = (f"gradient clipping at max_grad_norm={clip:g} acts as {clip / w:g} would on the true gradients"
                    if isinstance(clip, (int, float)) and clip > 0 else "no clipping (max_grad_norm is off)")
        self.report(
            LOSS_SCALED_BY_WORLD_SIZE.code,
            f"the loss of micro-batch 0 at step {step} on rank 0, {scaling.micro_loss:.4f}, is {scaling.factor:.2f}x its own mean "
            f"{scaling.recomputed:.4f} (recomputed without num_items_in_batch) with {ctx.world_size} processes: "
            f"{scaling.loss_source} ignores num_items_in_batch and returns its micro-batch's own mean, and the Trainer "
            f"(average_tokens_across_devices=True) multiplies every rank's loss by the number of processes ({w}) as if it were "
            f"the rank's label sum over all ranks' labels (num_items_in_batch={scaling.global_items:g}). The loss the Trainer "
            f"logs and every gradient are {w}x too large: {clipping}, and a plain SGD update is {w}x too large (an Adam "
            f"update changes through the clipping and its epsilon only). The harness's own records (steps.jsonl, the loss "
            f"checks) hold each rank's own mean ({step_loss:.4f} at step {step}). Fix: "
            "TrainingArguments(average_tokens_across_devices=False), or a compute_loss (compute_loss_func) that sums the loss "
            "and divides it by num_items_in_batch.",
            step=step,
            evidence={**scaling.evidence(), "world_size": ctx.world_size, "recorded_loss": step_loss, "max_grad_norm": clip,
                      "average_tokens_across_devices": getattr(args, "average_tokens_across_devices", None),
                      "model": type(getattr(self._trainer, "model", None)).__name__, "trainer": type(self._trainer).__name__,
                      "model_accepts_loss_kwargs": getattr(self._trainer, "model_accepts_loss_kwargs", None)},
        )

    def _check_ga(self, ctx: Any, step: int, step_loss: float, micro: float, recomputed: float) -> None:
        found = judge_ga_scaling(step_loss, micro, recomputed, _accumulation(self._trainer))
        if found is None:
            return
        self._ga = found
        ga = found.accumulation
        if found.factor > 1:
            source = loss_source(self._trainer)  # the model's head, a compute_loss_func or a Trainer subclass's compute_loss
            cause = (f"{source} returned micro-batch 0's own mean ({micro:.4f}; recomputed {recomputed:.4f}), ignoring "
                     "num_items_in_batch, and the Trainer, which passes num_items_in_batch and so takes the loss as already "
                     f"normalised over the step, did not divide it by gradient_accumulation_steps={ga}"
                     if micro > 0 and abs(math.log(micro / recomputed)) < math.log(ga) / 2 else
                     f"compute_loss returned {micro:.4f} for micro-batch 0 (its own mean is {recomputed:.4f})")
            effect = f"the logged loss and every gradient are {ga}x too large (measured {found.factor:.2f}x; expected 1x)"
            fix = ("use num_items_in_batch in compute_loss (summed loss / num_items_in_batch) or in a compute_loss_func, or set "
                   "loss_is_scaled_for_ga = False on the Trainer subclass so that the Trainer divides by gradient_accumulation_steps")
        else:
            cause = f"compute_loss returned {micro:.4f} for micro-batch 0 (its own mean is {recomputed:.4f}) and the loss was divided again"
            effect = f"the logged loss and every gradient are 1/{ga} of what they should be (measured {found.factor:.2f}x; expected 1x)"
            fix = "do not divide a loss normalised by num_items_in_batch again (drop loss_is_scaled_for_ga = False or the extra division)"
        self.report(
            GA_LOSS_SCALING.code,
            f"the loss of step {step}, {step_loss:.4f}, is {found.factor:.2f}x its first micro-batch's own mean "
            f"{recomputed:.4f} with gradient_accumulation_steps={ga}: {cause}; {effect}. Fix: {fix}.",
            step=step,
            evidence={**found.evidence(), "trainer": type(self._trainer).__name__, "loss_source": loss_source(self._trainer),
                      "model_accepts_loss_kwargs": getattr(self._trainer, "model_accepts_loss_kwargs", None),
                      "loss_is_scaled_for_ga": getattr(self._trainer, "loss_is_scaled_for_ga", None)},
        )

    def _check_first_loss(self, ctx: Any, step: int, loss: float) -> None:
        level = self._level
        if level.level is None or level.kind == "pending" or not math.isfinite(loss):
            return  # nan_guard reports non-finite losses; a loss with no untrained level is not judged
        logged = loss
        if self._ga is not None:
            loss = loss / self._ga.scale  # judged as it should have been: GA_LOSS_SCALING names the factor
        expected, basis = level.level, level.basis
        ratio = loss / expected
        evidence: dict[str, Any] = {"first_loss": loss, "untrained_level": expected, "basis": basis, "ratio": ratio,
                                    "loss_kind": level.kind, "outputs": level.outputs,
                                    **({"ln_vocab": expected, "vocab_size": level.outputs} if level.kind == "token" else {}),
                                    "weights": self._weights, "loaded_from": self._loaded_from, "copy_fraction": self._copy}
        if self._ga is not None:
            evidence.update(logged_first_loss=logged, ga_scale_removed=self._ga.scale)
        if self._world_scaling is not None:  # the bridge's record holds rank 0's own mean: the world factor is out already
            evidence.update(world_scale_removed=self._world_scaling.scale)
        o = self.options
        if ratio > o.high_ratio:
            removed = f" (logged {logged:.3f}; the GA_LOSS_SCALING factor taken out)" if self._ga is not None else ""
            suspects = ("the weights are trained: suspect a tokenizer from another model, weights that did not load (missing keys) or "
                        "mis-shifted labels" if self._weights == "trained" else
                        "suspect the initialisation scale, a vocabulary/label mismatch or mis-shifted labels")
            if self._world > 1 and not self._world_told:  # the recomputation could not tell (sharded weights, no labels)
                suspects += (f", or a loss that ignores num_items_in_batch, which the Trainer multiplies by the {self._world} "
                             "processes (average_tokens_across_devices=False shows the loss unscaled)")
            self.report(
                INITIAL_LOSS_ANOMALY.code,
                f"first loss {loss:.3f}{removed} is {ratio:.2f}x {basis}={expected:.3f}: far above an untrained "
                f"model's; {suspects}.",
                step=step,
                evidence=evidence,
            )
        elif ratio < o.low_ratio:
            self._check_low(step, loss, ratio, expected, basis, evidence)

    def _check_low(self, step: int, loss: float, ratio: float, expected: float, basis: str, evidence: dict[str, Any]) -> None:
        """Far below ln(V): a leak for fresh weights; for trained weights only with targets that copy the input."""
        o, copy = self.options, self._copy
        expect = o.expect if o.expect != "auto" else {"trained": "pretrained", "fresh": "scratch"}.get(self._weights, "auto")
        if expect == "pretrained":
            if copy is not None and copy >= o.copy_fraction:
                self.report(
                    INITIAL_LOSS_ANOMALY.code,
                    f"first loss {loss:.3f} is only {ratio:.2f}x {basis}, and {copy:.0%} of the first micro-batch's "
                    "targets are the input token at the same position: the labels leak into the inputs (not shifted, or shifted "
                    "the wrong way), or padding is trained on.",
                    step=step, evidence=evidence,
                )
            return  # trained weights start low: that is what loading them is for
        fresh = " (the weights are fresh: every norm weight is still at its initial constant)" if self._weights == "fresh" else ""
        self.report(
            INITIAL_LOSS_ANOMALY.code,
            f"first loss {loss:.3f} is only {ratio:.2f}x {basis}={expected:.3f}: far below an untrained model's{fresh}; "
            + ("if the model starts from scratch, suspect labels leaking into the inputs or trivially repetitive data." if self._level.kind == "token"
               else "if the classifier starts from scratch, suspect a label the inputs give away (a label column left among the "
                    "features, or rows sorted by label) or a head that was trained before."),
            step=step,
            evidence=evidence,
            severity=Severity.WARNING if expect == "scratch" else Severity.INFO,
        )


@dataclass(frozen=True)
class MaskedLabelsCheck:
    """Where a batch with every label masked comes from, for the trainer in use: the check to make first."""

    trainer: str
    collator: str
    max_length: int | None
    check: str

    def evidence(self) -> dict[str, Any]:
        return {"trainer": self.trainer, "collator": self.collator, "max_length": self.max_length}


def masked_labels_check(trainer: Any) -> MaskedLabelsCheck:
    """TRL's SFT masks prompts and truncates at max_length (a prompt at least that long leaves no completion token); a plain
    Trainer's labels come from the dataset and the collator (padding, a masking rule by the wrong token ids, empty rows)."""
    name = type(trainer).__name__
    collator = type(getattr(trainer, "data_collator", None)).__name__
    args = getattr(trainer, "args", None)
    max_length = getattr(args, "max_length", None)
    completion_only = any(getattr(args, flag, False) for flag in ("completion_only_loss", "assistant_only_loss"))
    if isinstance(max_length, int) and (completion_only or any(c.__name__ == "SFTTrainer" for c in type(trainer).__mro__)):
        check = (f"{name} masks prompts and truncates at max_length={max_length}: count the samples whose prompt alone has at "
                 f"least {max_length} tokens (no completion token is left), and see that the chat template marks assistant turns.")
    else:
        check = (f"{name}'s labels come from the dataset and its collator ({collator}): decode one of these micro-batches' rows "
                 "beside its labels; rows of padding only, empty targets, or a collator that masks by the wrong token ids "
                 "(pad = eos masks every eos) leave nothing to learn.")
    return MaskedLabelsCheck(name, collator, max_length if isinstance(max_length, int) else None, check)


def _accumulation(trainer: Any) -> int:
    args = getattr(trainer, "args", None)
    return int(getattr(args, "gradient_accumulation_steps", 1) or 1)


