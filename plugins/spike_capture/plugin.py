"""spike_capture's hooks: loss and grad-norm spikes against a robust running baseline, with the offending batch captured.

The baseline is the median and MAD of the last ``window`` normal steps,
robust from the first step: every step is tested against what the window
already holds, and an outlier never enters it (so one bad batch, in the
warm-up or later, cannot raise the bar for the next); findings start once
the window holds ``min_history`` steps. The loss level follows the steep fall
of a warm-up along the window's robust slope, so that a spike there is not
swallowed by a median lagging above the curve. A spike is judged before the
optimizer applies the step, so the capture's per-sample losses are
recomputed on the very weights that produced it, and a policy may still skip
that update. A loss that stays
elevated for ``divergence_patience`` steps is a divergence, not a spike.

The running baseline alone calls a run that is ruined from its first steps
healthy (it forms on the ruined level), so every loss is also held against
an anchor that does not move (:mod:`.anchor`): above the untrained level or
several times the run's first losses is ``LOSS_ABOVE_START`` within two
steps, such losses never enter the baseline, and a run that never comes back
to its start says so at its end (``LOSS_NOT_RECOVERED``). Evaluations are
watched for an eval loss that climbs (``EVAL_LOSS_RISING``, :mod:`.evals`), and
a spike names the run's own earlier findings as its first suspects
(:mod:`.causes`).

Per micro-batch it keeps the batch by reference and queues its loss with
``defer``; the step guard reads those with every plugin's tensors in one
transfer and hands over the step loss and grad norm as host floats.
"""
from __future__ import annotations

import logging
import math
import statistics
from collections import deque
from typing import Any

import torch
from pydantic import BaseModel, ConfigDict, Field

from harness.core.findings import FindingCode, Severity
from harness.core.hookspecs import hookimpl
from harness.core.plugin import Plugin
from harness.lib.capture import CaptureResult, write_capture
from harness.lib.layer_history import describe, surged_before
from harness.lib.robust import Baseline, Judgement
from harness.lib.model_state import weights_state
from harness.lib.trainer_kind import token_loss
from .notes import earlier_micro_batches, grad_rise, loss_context, loss_spike_notes, step_dataset_indices
from harness.lib.untrained_loss import UntrainedLoss, none, settled_by_labels, untrained_loss

from .anchor import Breach, LossAnchor, loss_terms
from .causes import EarlierFindings
from .evals import EvalRise, EvalTrend

LOSS_SPIKE = FindingCode(
    "LOSS_SPIKE", Severity.WARNING, "The step loss jumped far above its running baseline; the batch was captured.", "numeric-health#loss_spike"
)
GRAD_NORM_SPIKE = FindingCode(
    "GRAD_NORM_SPIKE",
    Severity.WARNING,
    "The gradient norm jumped far above its running baseline (information alone; a warning with a loss spike or when huge).",
    "numeric-health#grad_norm_spike",
)
LOSS_DIVERGENCE = FindingCode(
    "LOSS_DIVERGENCE", Severity.ERROR, "The loss stayed far above its baseline for a whole patience window.", "numeric-health#loss_divergence"
)
LOSS_ABOVE_START = FindingCode(
    "LOSS_ABOVE_START",
    Severity.WARNING,
    "The loss rose above where the run started: over what an untrained model scores (ln(vocab), ln(labels)) or several "
    "times the run's first losses. The run has lost what it learned.",
    "numeric-health#loss_above_start",
)
LOSS_NOT_RECOVERED = FindingCode(
    "LOSS_NOT_RECOVERED",
    Severity.WARNING,
    "At the end of the run the loss had not come back to where the run started (after rising above it, or in a fine-tune).",
    "numeric-health#loss_not_recovered",
)
EVAL_LOSS_RISING = FindingCode(
    "EVAL_LOSS_RISING",
    Severity.WARNING,
    "The eval loss rose at consecutive evaluations and stands above its best (overfitting, or a run losing what it learned).",
    "numeric-health#eval_loss_rising",
)
log = logging.getLogger("harness.spike_capture")


class SpikeCaptureOptions(BaseModel):
    """Options of the ``spike_capture`` plugin."""

    model_config = ConfigDict(extra="forbid")

    window: int = Field(50, ge=5, description="Normal steps in the running baseline (spread: MAD of their step-to-step differences).")
    min_history: int = Field(
        10, ge=3, description="Normal steps the baseline must hold before a finding is made (earlier outliers are still kept out of it)."
    )
    warmup_steps: int = Field(
        0, ge=0, description="Optional grace: no finding in the first warmup_steps steps (their outliers are still kept out of the baseline)."
    )
    grad_warmup_steps: int = Field(
        20, ge=0, description="No GRAD_NORM_SPIKE in the first grad_warmup_steps steps: early grad norms swing widely (outliers still stay out)."
    )
    loss_z: float = Field(6.0, gt=0, description="A loss spike is this many robust standard deviations above the baseline level ...")
    loss_min_rise: float = Field(0.1, ge=0, description="... and at least this fraction above the median (guards a flat baseline with a tiny spread).")
    grad_z: float = Field(6.0, gt=0, description="A grad-norm spike is this many robust standard deviations above the median ...")
    grad_min_ratio: float = Field(2.0, ge=1, description="... and at least this multiple of the median grad norm.")
    grad_warn_ratio: float = Field(
        10.0, ge=1, description="A grad-norm spike alone is information (healthy runs have them); a warning, with a capture, "
        "when the loss spikes with it or it reaches this multiple of the median."
    )
    divergence_z: float = Field(3.0, gt=0, description="A step is 'elevated' when its loss is this many robust SDs and loss_min_rise above the median.")
    divergence_patience: int = Field(20, ge=2, description="LOSS_DIVERGENCE when this many steps in a row are elevated or spikes.")
    level_steps: int = Field(10, ge=1, description="The baseline level is the median of the last level_steps normal steps of the window.")
    ring_size: int = Field(8, ge=1, description="Micro-batches kept (by reference) for the capture's context.")
    copy_batches: bool = Field(False, description="Copy batches instead of keeping references (for collators that reuse their tensors).")
    history: int = Field(20, ge=1, description="Steps of loss and grad-norm history written into a capture.")
    max_captures: int = Field(20, ge=0, description="Captures written per run at most (findings go on after that, without a capture).")
    resume_window: int = Field(200, ge=0, description="A spike within this many steps after a resume is flagged as following it.")
    recompute_loss: bool = Field(True, description="Recompute per-sample losses with one extra forward pass on the captured batch.")
    anchor: bool = Field(
        True, description="Hold every loss against an anchor that does not move with the run (LOSS_ABOVE_START, LOSS_NOT_RECOVERED): "
        "the untrained level (ln(vocab) for a token loss, ln(num_labels) for a classifier) and the run's first losses.",
    )
    anchor_margin: float = Field(
        0.1, ge=0, description="The ceiling is (1 + anchor_margin) times the higher of the untrained level and the run's first loss.")
    anchor_start_ratio: float = Field(
        3.0, gt=1, description="... and at most this many times the run's start (the median of its healthy first three losses): a "
        "fine-tune that starts far under the untrained level.")
    anchor_confirm_steps: int = Field(
        2, ge=1, description="LOSS_ABOVE_START when this many steps in a row are over the ceiling, or one step is 1.5 times over it.")
    recover_margin: float = Field(
        0.1, ge=0, description="LOSS_NOT_RECOVERED when, at the end of a run that rose over its ceiling (or of a fine-tune of at "
        "least 2 * level_steps steps), the median of the last level_steps losses is more than this fraction above the run's start.")
    anchor_terms: int = Field(
        64, ge=1, description="The anchor judges the mean of the last steps that together hold this many loss terms (labelled "
        "tokens, or rows for a classifier, contrastive or regression loss): one step of a language model, 16 steps of a "
        "classifier with batch 4, whose single steps are noisy; for such a loss the margin is at least 3/sqrt(terms of the mean).")
    spike_min_terms: int = Field(
        32, ge=1, description="A step loss over fewer loss terms than this (a classifier's rows with a small batch) is too noisy "
        "for one step to be a spike: no LOSS_SPIKE; the anchor and "
        "LOSS_DIVERGENCE still judge it.")
    eval_rises: int = Field(2, ge=1, description="EVAL_LOSS_RISING when an eval loss rose at this many evaluations in a row ...")
    eval_min_rise: float = Field(0.05, ge=0, description="... and stands at least this fraction above its best evaluation.")


def eval_examples(trainer: Any) -> dict[str, int]:
    """Per eval-loss metric key, its eval set's number of examples (``eval_loss``, or ``eval_<name>_loss`` for a dict of
    sets); sets without a length are left out."""
    sets = getattr(trainer, "eval_dataset", None)
    named = sets.items() if isinstance(sets, dict) else [(None, sets)]
    found: dict[str, int] = {}
    for name, dataset in named:
        try:
            n = len(dataset) if dataset is not None else 0
        except TypeError:
            continue  # an IterableDataset
        if n > 0:
            found["eval_loss" if name is None else f"eval_{name}_loss"] = n
    return found


def _detach(batch: dict[str, Any], copy: bool) -> dict[str, Any]:
    if not copy:
        return batch
    return {k: v.detach().clone() if torch.is_tensor(v) else v for k, v in batch.items()}


def _surged(ctx: Any, step: int) -> list[Any]:
    """layer_stats' rows, when it is on: the blocks that left their baseline before ``step``, earliest first."""
    run_dir = getattr(ctx, "run_dir", None)
    return surged_before(run_dir, step) if run_dir is not None else []


def _micros(kept: list[tuple[int, Any]], losses: list[float]) -> list[Micro]:
    """The step's micro-batches with their losses (NaN where none was read)."""
    return [(m, b, losses[i] if i < len(losses) else math.nan) for i, (m, b) in enumerate(kept)]


_ADMITTED: Any = object()  # in ``_loss_seen``: the loss was admitted unjudged (clearly normal); judge it on demand
Micro = tuple[int, dict[str, Any], float]  # (micro_step, batch, its loss as a host float)


class SpikeCapture(Plugin):
    """Finds loss and grad-norm spikes and divergence; writes the offending batch to captures/step-<N>/."""

    name = "spike_capture"
    Options = SpikeCaptureOptions
    CODES = (LOSS_SPIKE, GRAD_NORM_SPIKE, LOSS_DIVERGENCE, LOSS_ABOVE_START, LOSS_NOT_RECOVERED, EVAL_LOSS_RISING)
    options: SpikeCaptureOptions

    def __init__(self) -> None:
        self.options = SpikeCaptureOptions()
        self._reset()

    def _reset(self) -> None:
        o = self.options
        self.loss_base = Baseline(o.window, o.min_history, o.level_steps, trend=True)
        self.grad_base = Baseline(o.window, o.min_history, o.level_steps)
        self.history: deque[tuple[int, float | None, float | None]] = deque(maxlen=o.history)
        self.steps_seen = 0
        self.elevated_run = 0
        self.divergence_reported = False
        self.grad_in_spike = False
        self.grad_outlier_run = 0  # grad norms in a row outside their baseline (a new level after divergence_patience)
        self.captures = 0
        self.resumed_at: int | None = None
        self._copies: list[tuple[int, dict[str, Any]]] = []  # with copy_batches: this step's micro-batches, copied
        self._ring: deque[tuple[int, int, dict[str, Any]]] = deque(maxlen=o.ring_size)
        self._grad_pending: tuple[int, list[Micro], CaptureResult | None] | None = None
        self._judge_loss = True  # a token loss (on_run_start asks the trainer)
        self.anchor = LossAnchor(margin=o.anchor_margin, start_ratio=o.anchor_start_ratio, confirm_steps=o.anchor_confirm_steps,
                                 anchor_terms=o.anchor_terms)
        self._level: UntrainedLoss = none("not started")
        self._finetune = False  # the weights were trained before this run (its loss must fall below its start)
        self.evals = EvalTrend(rises=o.eval_rises, min_rise=o.eval_min_rise)
        self.causes = EarlierFindings()
        self._loss_seen: tuple[int, Judgement | None, bool, bool] | None = None  # (step, judgement, spike, elevated) of the last loss

    def setup(self, ctx: Any) -> None:
        self._reset()

    @hookimpl
    def on_run_start(self, ctx: Any) -> None:
        self._reset()  # a rollback trains again with the same plugin: start from the checkpoint's state, not this run's
        # a preference or policy loss (DPO, GRPO ...) moves with its batch's margins and the policy's own samples: a jump
        # is no bad batch and a climb no divergence. Its grad norm is still judged; the loss curve has its own checks
        self._judge_loss = token_loss(getattr(ctx, "trainer", None))
        if not self._judge_loss:
            log.info("spike_capture: %s optimises no token loss: its loss is not judged for spikes or divergence, its "
                     "grad norm is", type(getattr(ctx, "trainer", None)).__name__)
        trainer = getattr(ctx, "trainer", None)
        self._level = untrained_loss(trainer) if self._judge_loss else none("not a token loss")
        self._set_untrained(self._level)
        self._finetune = self._judge_loss and self.options.anchor and weights_state(getattr(trainer, "model", None)) == "trained"
        self.idle_hooks("on_loss", idle=not self.options.copy_batches)  # by reference, the loop's ctx.step_batches serve

    # -- state across checkpoints ------------------------------------------------------------------

    @hookimpl
    def checkpoint_state(self, ctx: Any, step: int) -> dict[str, Any]:
        return {
            "loss_window": list(self.loss_base.values),
            "grad_window": list(self.grad_base.values),
            "history": [list(h) for h in self.history],
            "steps_seen": self.steps_seen,
            "elevated_run": self.elevated_run,
            "divergence_reported": self.divergence_reported,
            "captures": self.captures,
            "anchor": self.anchor.state(),
            "finetune": self._finetune,
            "evals": self.evals.state(),
        }

    @hookimpl
    def on_resume(self, ctx: Any, state: dict[str, Any] | None) -> None:
        self.resumed_at = ctx.step
        if not state:
            return
        self.loss_base.values.extend(float(v) for v in state.get("loss_window", []))
        self.grad_base.values.extend(float(v) for v in state.get("grad_window", []))
        self.history.extend((int(s), l, g) for s, l, g in state.get("history", []))
        self.steps_seen = int(state.get("steps_seen", 0))
        self.elevated_run = int(state.get("elevated_run", 0))
        self.divergence_reported = bool(state.get("divergence_reported", False))
        self.captures = int(state.get("captures", 0))
        self.anchor.restore(state.get("anchor"))
        self._finetune = bool(state.get("finetune", self._finetune))
        self.evals.restore(state.get("evals"))

    # -- per micro-batch: references, and the loss queued for the guard's one read ---------------------

    @hookimpl
    def on_loss(self, batch: dict[str, Any], step: int, micro_step: int) -> None:
        """Only with ``copy_batches`` (idle otherwise): a copy per micro-batch, before the collator reuses its tensors."""
        self._copies.append((micro_step, _detach(batch, True)))

    # -- per optimizer step ---------------------------------------------------------------------------

    @hookimpl
    def on_before_optimizer_step(self, ctx: Any, step: int, grad_norm: float | None, loss: float | None, micro_losses: list[float]) -> None:
        # the step's micro-batches, kept by the loop by reference (or this plugin's copies), with their losses
        kept, self._copies = (self._copies if self.options.copy_batches else ctx.step_batches), []
        for m, b in kept:
            self._ring.append((step, m, b))
        if loss is None:
            return
        self._judge(ctx, step, float(loss), grad_norm, kept, micro_losses)

    @hookimpl
    def on_step_end(self, ctx: Any, step: int, metrics: dict[str, Any]) -> None:
        self._copies = []  # a step without a guard: its deferred losses are gone, so are its batches
        pending, self._grad_pending = self._grad_pending, None
        if pending is None or pending[0] != step or metrics.get("grad_norm") is None:
            return
        _, current, capture = pending
        # DeepSpeed computes the grad norm inside its own step: judge it now (the weights have moved on)
        grad = self._grad_judgement(float(metrics["grad_norm"]))
        if grad is not None:
            self._report_grad_spike(ctx, step, grad, current, capture, weights_moved=True)

    def _judge(self, ctx: Any, step: int, loss: float, norm: float | None, kept: list[tuple[int, Any]], losses: list[float]) -> None:
        """``loss`` and ``norm`` against their baselines; ``kept``: the step's (micro-batch, batch) pairs, with ``losses`` made
        into the capture's micro-batches only where a capture, a report or a later grad judgement needs them."""
        o = self.options
        if not math.isfinite(loss):
            self.history.append((step, loss, norm))
            return  # nan_guard's finding; a non-finite value must not poison the baseline
        self.steps_seen += 1
        ready = self.loss_base.ready and self.steps_seen > o.warmup_steps
        if self._level.kind == "pending" and kept:  # a classifier whose loss transformers picks from the labels' dtype
            self._set_untrained(settled_by_labels(self._level, kept[0][1].get("labels") if hasattr(kept[0][1], "get") else None))
        if self.anchor.terms is None and kept:  # once: how many terms a step's loss averages (tensor shapes, no device read)
            self._set_terms(ctx, loss_terms([b for _, b in kept], token=self._level.kind == "token"))
        # the anchor first: a loss over the run's ceiling never enters the baseline (it would form on a ruined level)
        breach = self.anchor.observe(step, loss) if self._judge_loss and o.anchor else None
        ruined = self._judge_loss and o.anchor and self.anchor.above_run > 0
        # against what is there, from the first steps: outliers never enter. A loss under (1 + loss_min_rise) times the
        # lowest level the window can give is no outlier whatever its spread: judged later only if a report needs it
        normal = not self._judge_loss or (not ruined and self.loss_base.under_level(loss, 1.0 + o.loss_min_rise))
        j = None if normal else self._sampling_floor(self.loss_base.judge(loss))
        rise = j is not None and j.value - j.median > o.loss_min_rise * abs(j.median)
        outlier = ruined or (rise and j is not None and j.z > min(o.divergence_z, o.loss_z))
        spike = ready and rise and j is not None and j.z > o.loss_z and not self._few_terms()
        self._loss_seen = (step, _ADMITTED if normal else j, spike, outlier)
        episode_started = self.elevated_run == 0
        self.elevated_run = self.elevated_run + 1 if outlier else 0
        if not outlier:
            self.loss_base.admit(loss)
            self.divergence_reported = False
        grad = self._grad_judgement(norm) if norm is not None else None
        capture: CaptureResult | None = None
        if spike and episode_started and j is not None:
            current = _micros(kept, losses)
            capture = self._capture(ctx, step, LOSS_SPIKE.code, f"loss {loss:.4f} vs running level {j.median:.4f}", current)
            self._report_loss_spike(ctx, step, j, grad, capture, current)
        if breach is not None and not self.anchor.in_breach:
            self.anchor.in_breach = True  # once per run of steps over the ceiling
            if capture is None:
                capture = self._capture(ctx, step, LOSS_ABOVE_START.code, f"loss {loss:.4f} over the run's ceiling {breach.ceiling:.4f}",
                                        _micros(kept, losses))
            self._report_above_start(ctx, breach, grad, capture)
        if self.elevated_run >= o.divergence_patience and not self.divergence_reported and (j is not None or ruined):
            self.divergence_reported = True
            if ready or ruined:
                self._report_divergence(ctx, step, j)
            else:  # the level moved before the baseline was complete: start again from the new level, without a finding
                log.info("spike_capture: the loss moved to a new level before its baseline filled; rebuilding it from step %s", step)
            if not ruined:  # a ruined level never becomes the baseline: the healthy one stays until the loss comes back
                self.loss_base.clear()  # reported once; from here the new level is the baseline (min_history steps to rebuild)
        if norm is None:
            self._grad_pending = (step, _micros(kept, losses), capture)
        elif grad is not None:
            self._report_grad_spike(ctx, step, grad, _micros(kept, losses), capture, weights_moved=False)
        self.history.append((step, loss, norm))

    def _grad_judgement(self, norm: float) -> Judgement | None:
        """Judge the grad norm (the window only takes normal values); returns the judgement of a spike only."""
        o = self.options
        if not math.isfinite(norm):
            return None
        # under grad_min_ratio times the lowest level the window can give: no outlier, whatever the judgement's spread
        j = None if self.grad_base.under_level(norm, o.grad_min_ratio) else self.grad_base.judge(norm)
        outlier = j is not None and norm > j.median * o.grad_min_ratio and j.z > o.grad_z
        if not outlier:
            self.grad_base.admit(norm)
            self.grad_in_spike, self.grad_outlier_run = False, 0
            return None
        self.grad_outlier_run += 1
        if self.grad_outlier_run >= o.divergence_patience:  # a new level, not a spike: it becomes the baseline
            log.info("spike_capture: the grad norm stayed at a new level for %d steps; rebuilding its baseline from there", self.grad_outlier_run)
            self.grad_base.clear()
            self.grad_base.admit(norm)
            self.grad_in_spike, self.grad_outlier_run = False, 0
            return None
        return j if self.grad_base.ready and self.steps_seen > max(o.warmup_steps, o.grad_warmup_steps) else None

    def _loss_context(self, step: int) -> tuple[str, bool, bool, dict[str, Any]]:
        """What the loss of ``step`` did against its own baseline: (words, spiked, moved, evidence); never "unmoved" when it moved."""
        seen = self._loss_seen if self._loss_seen is not None and self._loss_seen[0] == step else None
        _, j, spiked, elevated = seen if seen is not None else (step, None, False, False)
        if j is _ADMITTED:  # a clearly normal loss, not judged at its step: its judgement against the window it met
            j = self.loss_base.judgement_of_admitted()
        words, moved, evidence = loss_context(j, spiked, elevated, self.options.loss_min_rise, self.options.divergence_z)
        return words, spiked, moved, evidence

    def _report_grad_spike(
        self, ctx: Any, step: int, j: Judgement, current: list[Any], capture: CaptureResult | None, weights_moved: bool
    ) -> None:
        o = self.options
        if self.grad_in_spike:
            return  # the same episode: reported at its first step
        self.grad_in_spike = True
        ratio = j.value / j.median if j.median > 0 else math.inf
        context, with_loss_spike, loss_moved, loss_evidence = self._loss_context(step)
        # a step of few rows: one row the model misfits moves its gradient 20-40x on a healthy run (the loss checks remain)
        # a loss of one term per row (a classifier's): most rows fit, one misfit row moves the gradient 10-40x on a healthy run;
        # such a run's loss checks remain
        serious = not self._row_loss() and (with_loss_spike or ratio >= o.grad_warn_ratio or bool(loss_evidence.get("loss_elevated")))
        if capture is None and serious:
            why = f"grad norm {j.value:.4f} vs running median {j.median:.4f}"
            capture = self._capture(ctx, step, GRAD_NORM_SPIKE.code, why, current, weights_moved=weights_moved)
        losses = [h[1] for h in self.history if h[1] is not None and math.isfinite(h[1])]
        self.report(
            GRAD_NORM_SPIKE.code,
            f"grad norm {j.value:.4f} at step {step} on rank {ctx.rank} is "
            + (f"{j.z:.1f} robust SDs above its running median {j.median:.4f} ({ratio:.1f}x; baseline of {j.size} steps)"
               if math.isfinite(ratio) else f"above a running median of 0 (the {j.size} steps before it had no gradient)")
            + f", {context}."
            + (f" Top suspects: {capture.describe()}." if capture else ""),
            step=step,
            evidence={
                **j.evidence("grad_norm"),
                "ratio": ratio,
                "with_loss_spike": with_loss_spike,
                "loss_moved": loss_moved,
                **loss_evidence,
                "dataset_indices": step_dataset_indices([b for _, b, _ in current]),
                "loss_history": losses[-o.history:],
                **self._resume_evidence(step),
                "capture": str(capture.json_path) if capture else None,
                "suspects": capture.suspects if capture else [],
            },
            severity=Severity.WARNING if serious else Severity.INFO,
        )

    # -- reports ------------------------------------------------------------------------------------

    def _grad_rise(self, grad: Judgement | None = None) -> dict[str, Any]:
        """``grad``: this step's grad-norm judgement; its median is the one the message quotes, so the evidence's is too."""
        return grad_rise((h[2] for h in self.history), grad.median if grad is not None else self.grad_base.median())

    def _resume_evidence(self, step: int) -> dict[str, Any]:
        since = step - self.resumed_at if self.resumed_at is not None else None
        return {"after_resume": since is not None and since <= self.options.resume_window, "steps_since_resume": since}

    def _report_loss_spike(
        self, ctx: Any, step: int, j: Judgement, grad: Judgement | None, capture: CaptureResult | None, current: list[Micro]
    ) -> None:
        rise, resume = self._grad_rise(grad), self._resume_evidence(step)
        causes = self.causes.before(step)
        notes = loss_spike_notes(rise, grad, resume, [c.words(step) for c in causes])
        surged = _surged(ctx, step)
        if surged:
            notes.append(f"layers surged first: {describe(surged)}")
        self.report(
            LOSS_SPIKE.code,
            f"loss {j.value:.4f} at step {step} on rank {ctx.rank} is {j.z:.1f} robust SDs above its running level {j.median:.4f} "
            f"(+{(j.value - j.median) / abs(j.median) * 100 if j.median else math.inf:.0f}%; baseline of {j.size} steps)"
            + (f"; {'; '.join(notes)}" if notes else "")
            + (f". Top suspects: {capture.describe()}." if capture else "."),
            step=step,
            evidence={
                **j.evidence("loss"),
                **rise,
                "grad_norm_jumped_with_it": grad is not None,
                "layers_surged_first": [s.as_dict() for s in surged],
                "earlier_findings": [c.as_dict() for c in causes],
                **resume,
                "dataset_indices": step_dataset_indices([b for _, b, _ in current]),
                "capture": str(capture.json_path) if capture else None,
                "suspects": capture.suspects if capture else [],
            },
        )

    def _report_divergence(self, ctx: Any, step: int, j: Judgement | None) -> None:
        o = self.options
        recent = [h[1] for h in self.history if h[1] is not None and math.isfinite(h[1])][-o.divergence_patience:]
        ceiling = self.anchor.ceiling() if o.anchor and self._judge_loss else None
        ruined = self.anchor.above_run >= self.elevated_run and ceiling is not None
        value = recent[-1] if recent else math.nan
        if ruined and self.anchor.last is not None:  # judged against the anchor: quote what was judged
            judged, steps = self.anchor.last
            what = f"{judged:.4f}" + (f", the mean of its last {steps} steps" if steps > 1 else "")
            message = (f"the loss has stayed over the run's ceiling {ceiling:.4f} for {self.elevated_run} steps in a row (step {step}: "
                       f"{what}); the run started at {self.anchor.start_words()}{self._untrained_words()}: training is diverging "
                       "rather than spiking once.")
        else:
            against = f"baseline median {j.median:.4f}, {j.z:.1f} robust SDs" if j is not None else "no baseline formed before it"
            message = (f"the loss has stayed above its baseline for {self.elevated_run} steps in a row (step {step}: {value:.4f}, "
                       f"{against}); training is diverging rather than spiking once.")
        self.report(
            LOSS_DIVERGENCE.code,
            message,
            step=step,
            evidence={
                **(j.evidence("loss") if j is not None else {"loss": value}),
                "ceiling": ceiling,
                "over_ceiling": ruined,
                "start": self.anchor.start(),
                "elevated_steps": self.elevated_run,
                "since_step": step - self.elevated_run + 1,
                "recent_losses": recent,
                **self._grad_rise(),
                **self._resume_evidence(step),
            },
        )

    def _set_untrained(self, level: UntrainedLoss) -> None:
        """The anchor's untrained level (None for a loss without one, or a classifier whose labels are not seen yet)."""
        self._level = level
        known = level.kind in ("token", "classification")
        self.anchor.untrained, self.anchor.basis = (level.level, level.basis) if known else (None, None)

    def _set_terms(self, ctx: Any, terms: int | None) -> None:
        self.anchor.terms = terms  # a resumed run has it from the checkpoint's state
        if self._few_terms() and getattr(ctx, "is_main", True):
            log.info("spike_capture: each step's loss averages %d terms (fewer than spike_min_terms=%d): single-step loss spikes "
                     "are not reported; the anchor judges the mean of the last %d steps", terms, self.options.spike_min_terms,
                     self.anchor.window)

    def _few_terms(self) -> bool:
        """Each step's loss averages fewer than spike_min_terms terms: no single step is a spike."""
        terms = self.anchor.terms
        return self._judge_loss and terms is not None and terms < self.options.spike_min_terms

    def _row_loss(self) -> bool:
        """A judged loss of one term per row (a classifier's, a contrastive or regression loss), not per token."""
        return self._judge_loss and self._level.kind != "token" and self.anchor.terms is not None

    def _sampling_floor(self, j: Judgement | None) -> Judgement | None:
        """A loss of one term per row is a mean over the step's rows: its step-to-step spread is never under level/sqrt(rows)
        (a cross-entropy's per-row spread is about its mean), however smooth the last steps happened to be."""
        terms = self.anchor.terms
        if j is None or not self._row_loss() or not terms:
            return j
        floor = abs(j.median) / math.sqrt(terms)
        return j if j.sd >= floor else Judgement(j.value, j.median, floor, (j.value - j.median) / floor, j.size)

    def _untrained_words(self) -> str:
        a = self.anchor
        return f"; an untrained model scores {a.basis}={a.untrained:.3f}" if a.untrained is not None and a.basis else ""

    def _report_above_start(self, ctx: Any, breach: Breach, grad: Judgement | None, capture: CaptureResult | None) -> None:
        causes = self.causes.before(breach.step)
        first = f"steps {breach.first_above}-{breach.step}" if breach.steps_above > 1 else f"step {breach.step}"
        suspects = (f"the run found {', '.join(c.words(breach.step) for c in causes)} just before: suspect that first" if causes else
                    "suspect the learning rate (too high for this model and batch, or no warm-up), then the optimizer state "
                    "(a restore that lost its moments), then the data")
        self.report(
            LOSS_ABOVE_START.code,
            f"{breach.what()} on rank {ctx.rank}, {breach.loss:.4f}, is {breach.describe()}: over the run's ceiling "
            f"{breach.ceiling:.4f} at {first}. The run has lost what it learned; no running baseline forms on this level. "
            f"{suspects[0].upper()}{suspects[1:]}."
            + (f" Top suspects in the batch: {capture.describe()}." if capture else ""),
            step=breach.step,
            evidence={
                **breach.evidence(),
                "grad_norm_jumped_with_it": grad is not None,
                "earlier_findings": [c.as_dict() for c in causes],
                **self._resume_evidence(breach.step),
                "capture": str(capture.json_path) if capture else None,
            },
            limit=5,
        )

    @hookimpl
    def on_finding(self, finding: Any) -> None:
        self.causes.note(finding)  # a few host operations, only when a finding is made

    @hookimpl
    def on_evaluate(self, ctx: Any, step: int, metrics: dict[str, Any]) -> None:
        if not ctx.is_main:
            return  # every rank evaluates the same set: judged once, on rank 0
        recent = list(self.anchor.recent) or [h[1] for h in self.history if h[1] is not None and math.isfinite(h[1])]
        train = self.anchor.level(recent, self.options.level_steps)
        examples = None if self._level.kind == "token" else eval_examples(getattr(ctx, "trainer", None))
        for rise in self.evals.observe(step, metrics, train, examples):
            self._report_eval_rise(ctx, rise)

    def _report_eval_rise(self, ctx: Any, rise: EvalRise) -> None:
        exploded = self._judge_loss and self.options.anchor and rise.train_now is not None and self.anchor.above(rise.train_now)
        path = ", ".join(f"{v:.4f}" + (f" (step {s})" if i in (0, len(rise.rises) - 1) else "") for i, (s, v) in enumerate(rise.rises))
        # overfitting (the training loss fell) is what many epochs over a small set do: information; an eval loss that
        # climbs while the training loss holds, rises or explodes is a run going wrong: a warning
        overfitting = rise.overfitting and not exploded
        self.report(
            EVAL_LOSS_RISING.code,
            f"{rise.key} rose at {self.options.eval_rises} evaluations in a row, {path}: {rise.rise * 100:+.0f}% above its best, "
            f"{rise.training_words(exploded)}. The weights of step {rise.best_step} evaluated best: load_best_model_at_end=True "
            "with metric_for_best_model (and a save at every evaluation) keeps them; look at the learning rate and the number "
            "of epochs.",
            step=rise.step,
            evidence={**rise.evidence(), "training_loss_exploded": exploded, "overfitting": overfitting},
            severity=Severity.INFO if overfitting else None,
            limit=5,
        )

    @hookimpl
    def on_run_end(self, ctx: Any, status: str) -> None:
        o = self.options
        if not ctx.is_main or not self._judge_loss or not o.anchor or status not in ("completed", "stopped"):
            return
        losses = list(self.anchor.recent)
        long_enough = self.steps_seen >= 2 * max(o.level_steps, self.anchor.window) and len(losses) >= 3
        level = self.anchor.level(losses, o.level_steps)
        if level is None or not (self.anchor.breached or (self._finetune and long_enough)):
            return
        if not self.anchor.not_recovered(level, o.recover_margin):
            return
        start = self.anchor.start() or math.nan
        head = (f"the run ended with its training loss at {level:.4f} ({self._level_words(len(losses))}), {level / start:.2f}x "
                f"where it started ({self.anchor.start_words()}){self._untrained_words()}")
        if self.anchor.breached:  # it rose over its ceiling and never came back under its start: a warning
            message = (f"{head}: it never came back after it rose over its ceiling, so the weights at the end fit the training data "
                       "worse than those it started from. Keep the starting weights (or the last checkpoint before the rise), "
                       "and lower the learning rate or add warm-up before training again.")
        else:  # a fine-tune that ended above its start without a blow-up: information (a plateau on data it knew can do it)
            message = (f"{head}, in a fine-tune (the weights were trained before this run), whose loss on its own data should end "
                       "below where it started. Compare the starting and final weights on held-out data; a learning rate too "
                       "high for fine-tuning is the usual cause.")
        self.report(
            LOSS_NOT_RECOVERED.code,
            message,
            severity=None if self.anchor.breached else Severity.INFO,
            step=ctx.step,
            evidence={"level": level, "start": self.anchor.start(), "first_losses": list(self.anchor.first), "breached": self.anchor.breached,
                      "finetune": self._finetune, "last_losses": losses[-max(o.level_steps, self.anchor.window):], "untrained_level": self.anchor.untrained,
                      "untrained_basis": self.anchor.basis},
        )

    def _level_words(self, available: int) -> str:
        o = self.options
        if self.anchor.window == 1:
            return f"the median of its last {min(available, o.level_steps)} steps"
        return f"the mean of its last {min(available, max(o.level_steps, self.anchor.window))} steps"

    def _capture(
        self, ctx: Any, step: int, code: str, why: str, current: list[Micro], weights_moved: bool = False
    ) -> CaptureResult | None:
        o = self.options
        if self.captures >= o.max_captures or not current:
            return None
        self.captures += 1
        try:
            return self._write(ctx, step, code, why, current, weights_moved)
        except Exception as exc:  # noqa: BLE001 - a full disk or an odd batch must not cost the finding
            log.warning("spike_capture: could not write the capture of step %s: %s", step, exc)
            return None

    def _write(self, ctx: Any, step: int, code: str, why: str, current: list[Micro], weights_moved: bool) -> CaptureResult:
        context = {
            "loss_history": [{"step": s, "loss": l, "grad_norm": g} for s, l, g in self.history],
            **self._grad_rise(),
            **self._resume_evidence(step),
            "earlier_micro_batches": earlier_micro_batches(self._ring, step, ctx.masked_lm),
            "layers_surged_first": [s.as_dict() for s in _surged(ctx, step)],
        }
        no_recompute = "the weights had already moved on (DeepSpeed reports the grad norm after its update)" if weights_moved else None
        if not self.options.recompute_loss:
            no_recompute = "recompute_loss is off in the config"
        reason = f"{code} at step {step}: {why}."
        return write_capture(ctx, step=step, code=code, reason=reason, micro_batches=list(current), context=context, no_recompute=no_recompute)
