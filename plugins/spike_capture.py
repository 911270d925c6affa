"""spike_capture: loss and grad-norm spikes against a robust running baseline, with the offending batch captured.

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

Per micro-batch it keeps the batch by reference and queues its loss with
``defer``; the step guard reads those with every plugin's tensors in one
transfer and hands over the step loss and grad norm as host floats.
"""
from __future__ import annotations

import logging
import math
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
from harness.lib.trainer_kind import token_loss
from harness.lib.spike_notes import earlier_micro_batches, grad_rise, loss_context, loss_spike_notes, step_dataset_indices

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
    CODES = (LOSS_SPIKE, GRAD_NORM_SPIKE, LOSS_DIVERGENCE)
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
        # against what is there, from the first steps: outliers never enter. A loss under (1 + loss_min_rise) times the
        # lowest level the window can give is no outlier whatever its spread: judged later only if a report needs it
        normal = not self._judge_loss or self.loss_base.under_level(loss, 1.0 + o.loss_min_rise)
        j = None if normal else self.loss_base.judge(loss)
        rise = j is not None and j.value - j.median > o.loss_min_rise * abs(j.median)
        outlier = rise and j is not None and j.z > min(o.divergence_z, o.loss_z)
        spike = ready and rise and j is not None and j.z > o.loss_z
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
        if self.elevated_run >= o.divergence_patience and not self.divergence_reported and j is not None:
            self.divergence_reported = True
            if ready:
                self._report_divergence(ctx, step, j)
            else:  # the level moved before the baseline was complete: start again from the new level, without a finding
                log.info("spike_capture: the loss moved to a new level before its baseline filled; rebuilding it from step %s", step)
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
        serious = with_loss_spike or ratio >= o.grad_warn_ratio or bool(loss_evidence.get("loss_elevated"))
        if capture is None and serious:
            why = f"grad norm {j.value:.4f} vs running median {j.median:.4f}"
            capture = self._capture(ctx, step, GRAD_NORM_SPIKE.code, why, current, weights_moved=weights_moved)
        losses = [h[1] for h in self.history if h[1] is not None and math.isfinite(h[1])]
        self.report(
            GRAD_NORM_SPIKE.code,
            f"grad norm {j.value:.4f} at step {step} on rank {ctx.rank} is {j.z:.1f} robust SDs above its running median "
            f"{j.median:.4f} ({ratio:.1f}x; baseline of {j.size} steps), {context}."
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
        notes = loss_spike_notes(rise, grad, resume)
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
                **resume,
                "dataset_indices": step_dataset_indices([b for _, b, _ in current]),
                "capture": str(capture.json_path) if capture else None,
                "suspects": capture.suspects if capture else [],
            },
        )

    def _report_divergence(self, ctx: Any, step: int, j: Judgement) -> None:
        o = self.options
        recent = [h[1] for h in self.history if h[1] is not None and math.isfinite(h[1])][-o.divergence_patience:]
        self.report(
            LOSS_DIVERGENCE.code,
            f"the loss has stayed above its baseline for {self.elevated_run} steps in a row (step {step}: {j.value:.4f}, "
            f"baseline median {j.median:.4f}, {j.z:.1f} robust SDs); training is diverging rather than spiking once.",
            step=step,
            evidence={
                **j.evidence("loss"),
                "elevated_steps": self.elevated_run,
                "since_step": step - self.elevated_run + 1,
                "recent_losses": recent,
                **self._grad_rise(),
                **self._resume_evidence(step),
            },
        )

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
            "earlier_micro_batches": earlier_micro_batches(self._ring, step),
            "layers_surged_first": [s.as_dict() for s in _surged(ctx, step)],
        }
        no_recompute = "the weights had already moved on (DeepSpeed reports the grad norm after its update)" if weights_moved else None
        if not self.options.recompute_loss:
            no_recompute = "recompute_loss is off in the config"
        reason = f"{code} at step {step}: {why}."
        return write_capture(ctx, step=step, code=code, reason=reason, micro_batches=list(current), context=context, no_recompute=no_recompute)
