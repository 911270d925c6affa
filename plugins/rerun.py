"""rerun: on a flagged step, recompute it and say whether the fault is in the data, in the moment, or in one rank.

When nan_guard or spike_capture flags a step on this rank (``NONFINITE_LOSS``,
``NONFINITE_GRAD``, ``LOSS_SPIKE``, a warning-level ``GRAD_NORM_SPIKE``),
the step's micro-batches are recomputed, forward and backward, on the same
rank, from the RNG state the step started with, before the optimizer
moves (:mod:`harness.lib.recompute`; ``param.grad`` is left alone). The
losses (and, in one process, the grad norm) are compared with the
original within a tolerance calibrated at ``calibrate_at_step``: a clean
step recomputed once measures the run's own nondeterminism, and the
tolerance is ``max(tolerance_floor, tolerance_factor x measured)``.

Verdicts: ``FAULT_REPRODUCED`` (the same numbers again: the data or the
model state), ``FAULT_TRANSIENT`` (not reproduced: hardware, silent data
corruption). With several ranks a rank that reproduced its fault sends its
micro-batches and RNG state to ``(rank + 1) % world`` over the control
group (tensors, no pickle); when the neighbour gets the clean result the
verdict is ``FAULT_RANK_SUSPECT`` naming the rank. The check runs only
when some flagged rank did not reproduce: a fault every rank reproduces
(a learning rate too high, bad data everywhere) blames no device and is
reported once, by the lowest rank.

Cost: nothing on an ordinary step but a host copy of the CPU RNG state
(and CUDA's generator states) at each step's first micro-batch, and one
slot of two integers in the step exchange with several ranks. Once per
run, at ``calibrate_at_step``, one recomputation of that step (one
forward and backward per micro-batch; its numbers ride the next step's one read). On a flagged step:
that recomputation again, one gradient-sized buffer while it runs, and
with several ranks the neighbour check (the step's micro-batches through
the host and over gloo, a second recomputation on the neighbour, a few
small broadcasts). At most ``max_reruns`` flagged steps per run.
"""
from __future__ import annotations

import logging
from typing import Any

from pydantic import BaseModel, ConfigDict, Field

from harness.core.findings import FindingCode, Severity
from harness.core.hookspecs import hookimpl
from harness.core.options import NAMES_CODES
from harness.core.plugin import Plugin
from harness.lib.capture import strict_json as _strict
from harness.lib.recompute import PendingRecompute, Recomputed, capture_rng, recompute_on_device, recompute_step, why_not
from harness.lib.rerun_verdict import OUTCOME_CODES, OUTCOME_OF_CODE, Comparison, Outcome, Tolerance, compare, measured_nondeterminism, neighbour_agrees

log = logging.getLogger("harness.rerun")

FAULT_REPRODUCED = FindingCode(
    "FAULT_REPRODUCED", Severity.WARNING, "Recomputing the flagged step gave the same numbers: the data or the model state.", "rerun#fault_reproduced"
)
FAULT_TRANSIENT = FindingCode(
    "FAULT_TRANSIENT", Severity.WARNING, "Recomputing the flagged step did not reproduce it: suspect the hardware or silent data corruption.",
    "rerun#fault_transient",
)
FAULT_RANK_SUSPECT = FindingCode(
    "FAULT_RANK_SUSPECT", Severity.ERROR, "A rank reproduces its fault but a neighbour rank computes the same micro-batches clean: that rank's device.",
    "rerun#fault_rank_suspect",
)
TRIGGERS = ("NONFINITE_LOSS", "NONFINITE_GRAD", "LOSS_SPIKE", "GRAD_NORM_SPIKE")
SLOT = "verdict"


class RerunOptions(BaseModel):
    """Options of the ``rerun`` plugin."""

    model_config = ConfigDict(extra="forbid")

    trigger_codes: list[str] = Field(list(TRIGGERS), description="Finding codes (made on this rank, at warning or above) whose step is recomputed.",
                                     json_schema_extra=NAMES_CODES)  # a typo would switch the rerun off in silence
    calibrate_at_step: int = Field(2, ge=0, description="Recompute this clean step once to measure the run's own nondeterminism; 0: no calibration.")
    tolerance_floor: float = Field(1e-3, ge=0, description="Smallest relative tolerance between an original value and its recomputation.")
    tolerance_factor: float = Field(10.0, ge=1, description="Tolerance = max(tolerance_floor, tolerance_factor x the calibration's relative difference).")
    neighbour_check: bool = Field(True, description="With several ranks, recompute a reproduced fault on rank (r+1) % world too (FAULT_RANK_SUSPECT).")
    max_reruns: int = Field(20, ge=0, description="Flagged steps recomputed per run at most (the cost cap).")


class Rerun(Plugin):
    """Recomputes flagged steps: FAULT_REPRODUCED (data/model), FAULT_TRANSIENT (hardware), FAULT_RANK_SUSPECT (one rank)."""

    name = "rerun"
    Options = RerunOptions
    CODES = (FAULT_REPRODUCED, FAULT_TRANSIENT, FAULT_RANK_SUSPECT)
    options: RerunOptions

    def __init__(self) -> None:
        self.options = RerunOptions()
        self._reset()

    def _reset(self) -> None:
        self.tolerance = Tolerance(self.options.tolerance_floor, self.options.tolerance_factor)
        self.calibration: dict[str, Any] | None = None
        self.reruns = 0
        self._calibration_tried = False
        self._in_exchange = False  # inside the neighbour check's collectives (a failure there cannot be joined again)
        self._calibrating: tuple[int, PendingRecompute, list[float], float | None] | None = None  # read with the next step
        self._off: str | None = None
        self._rng: dict[str, Any] | None = None
        self._findings_seen = 0
        self._pending: dict[str, Any] | None = None  # this step's local rerun, judged at on_step_agreed

    def setup(self, ctx: Any) -> None:
        self._reset()

    @hookimpl
    def on_run_start(self, ctx: Any, trainer: Any) -> None:
        if ctx.world_size > 1:
            ctx.reserve(SLOT, 2)  # every rank, first: [flagged, outcome]
        self._off = why_not(trainer, ctx.world_size)
        self._findings_seen = len(ctx.findings)
        # one process: the verdict has nothing to wait for but a rerun of this rank's own, so it is called only after one
        self.idle_hooks("on_step_agreed", idle=ctx.world_size == 1)
        if self._off:
            log.info("harness rerun: flagged steps will not be recomputed on rank %s: %s", ctx.rank, self._off)

    @hookimpl
    def checkpoint_state(self, ctx: Any, step: int) -> dict[str, Any]:
        return {"calibration": self.calibration, "reruns": self.reruns}

    @hookimpl
    def on_resume(self, ctx: Any, state: dict[str, Any] | None) -> None:
        if state and state.get("calibration"):
            self.calibration = dict(state["calibration"])
            self.tolerance = self.tolerance.calibrated(float(self.calibration["measured"]))
        if state:
            self.reruns = int(state.get("reruns", 0))

    # -- per micro-batch: the RNG at the step's start, the batches by reference ---------------------------

    @hookimpl
    def inspect_batch(self, ctx: Any, step: int, micro_step: int) -> None:
        if micro_step == 0 and not self._off:
            self._rng = capture_rng()  # host copies of the generator states: no device sync
            if self._calibrating is not None:  # the calibration's numbers ride this step's one read
                self.defer("calibration", self._calibrating[1].values)

    # -- the step: local rerun after the detectors, verdict after the agreement --------------------------

    def _flags(self, ctx: Any, step: int) -> list[str]:
        if len(ctx.findings) == self._findings_seen:
            return []  # the common step: no finding at all since the last look
        new, self._findings_seen = ctx.findings[self._findings_seen:], len(ctx.findings)
        wanted = set(self.options.trigger_codes)
        return sorted({f.code for f in new if f.step == step and f.rank == ctx.rank and f.code in wanted and f.severity >= Severity.WARNING})

    @hookimpl(trylast=True)  # after nan_guard and spike_capture have reported this step
    def on_before_optimizer_step(self, ctx: Any, step: int, grad_norm: float | None, micro_losses: list[float]) -> None:
        # the step's micro-batches by reference, kept by the loop (their losses come read with this hook)
        batches, rng = [batch for _, batch in ctx.step_batches], self._rng
        self._pending = None
        flags = self._flags(ctx, step)
        outcome: Outcome | None = None
        try:  # share on every path: a rerun that raises still leaves this rank's slot filled ("not flagged")
            self._finish_calibration(ctx)
            if self._off or not batches:
                return
            losses = list(micro_losses)
            if flags and self.reruns < self.options.max_reruns:
                self.reruns += 1
                rerun = recompute_step(ctx.trainer, batches, rng)
                comparison = compare(losses, rerun.losses, self.tolerance.value, original_norm=grad_norm, rerun_norm=rerun.grad_norm,
                                     rerun_grads_finite=rerun.grads_finite, norms_comparable=ctx.world_size == 1)
                if ctx.world_size == 1:
                    self.idle_hooks("on_step_agreed", idle=False)  # this step's verdict (idle again once given)
                self._pending = {"step": step, "flags": flags, "batches": batches, "rng": rng, "losses": losses, "grad_norm": grad_norm,
                                 "rerun": rerun, "comparison": comparison}
                outcome = comparison.outcome
            elif not flags and self._calibration_due(step):
                self._calibrate(ctx, step, batches, rng, losses, grad_norm)
        finally:
            self._share(ctx, outcome)

    def _calibration_due(self, step: int) -> bool:
        """Once per run, at the first clean step from calibrate_at_step on (a resumed run without the state calibrates anew)."""
        at = self.options.calibrate_at_step
        due = at > 0 and step >= at and self.calibration is None and not self._calibration_tried
        self._calibration_tried = self._calibration_tried or due
        return due

    def _share(self, ctx: Any, outcome: Outcome | None) -> None:
        if ctx.world_size > 1:
            ctx.share(SLOT, [int(outcome is not None), OUTCOME_CODES[outcome] if outcome is not None else 0])

    def _calibrate(self, ctx: Any, step: int, batches: list[dict[str, Any]], rng: Any, losses: list[float], grad_norm: float | None) -> None:
        """Recompute a clean step; its numbers stay on the device until the next step's one read (no host sync of its own)."""
        norm = grad_norm if ctx.world_size == 1 else None
        self._calibrating = (step, recompute_on_device(ctx.trainer, batches, rng), losses, norm)

    def _finish_calibration(self, ctx: Any) -> None:
        read = self.deferred("calibration") if self._calibrating is not None else []
        if not read or self._calibrating is None:
            return
        step, pending, losses, norm = self._calibrating
        self._calibrating = None
        value = read[-1]
        rerun = pending.read([float(v) for v in (value.tolist() if hasattr(value, "tolist") else value)])
        measured = measured_nondeterminism(losses, rerun.losses, norm, rerun.grad_norm if norm is not None else None)
        if measured is None:
            return
        self.tolerance = self.tolerance.calibrated(measured)
        self.calibration = {"step": step, "measured": measured, "tolerance": self.tolerance.value, "seconds": round(rerun.seconds, 4),
                            "grad_norm_compared": norm is not None}
        log.info("harness rerun: calibrated at step %s on rank %s: a clean rerun differs by %.3g (relative), tolerance %.3g (%.2f s)",
                 step, ctx.rank, measured, self.tolerance.value, rerun.seconds)

    @hookimpl
    def on_step_agreed(self, ctx: Any, step: int) -> None:
        pending, self._pending = self._pending, None
        if ctx.world_size == 1:
            self.idle_hooks("on_step_agreed")
            if pending is not None:
                self._report_local(ctx, pending)
            return
        rows = ctx.shared(SLOT)
        if not rows:
            return
        outcomes = {r: OUTCOME_OF_CODE[row[1]] for r, row in enumerate(rows) if row and row[0] and row[1] in OUTCOME_OF_CODE}
        if not outcomes:
            return
        reproduced = [r for r, o in outcomes.items() if o is Outcome.REPRODUCED]
        everywhere = len(reproduced) == ctx.world_size  # every rank reproduced: no one device to blame, no check needed
        check = self.options.neighbour_check and reproduced and not everywhere
        neighbour = {src: self._neighbour_check_or_join(ctx, src, pending) for src in reproduced} if check else {}
        if pending is None:
            return
        outcome = outcomes.get(ctx.rank)
        if outcome is Outcome.CLEAN_HERE:
            if not reproduced and all(o is Outcome.CLEAN_HERE for o in outcomes.values()) and ctx.rank == min(outcomes):
                self._report_local(ctx, pending, note="every flagged rank recomputed its own part clean")
            return
        if everywhere and ctx.rank != min(reproduced):
            return  # one event: reported once, by the lowest rank
        self._report_local(ctx, pending, neighbour="everywhere" if everywhere else neighbour.get(ctx.rank, "off"))

    def _neighbour_check_or_join(self, ctx: Any, src: int, pending: dict[str, Any] | None) -> Any:
        """``_neighbour_check``, or, where it fails on this rank before its first collective, this rank's part in the
        others' collectives with nothing to give (a source sends "nothing", a neighbour "failed"): every rank calls it
        together, so a rank that left it would keep the others waiting for the process group's timeout."""
        self._in_exchange = False
        try:
            return self._neighbour_check(ctx, src, pending)
        except Exception as exc:
            if self._in_exchange:
                raise  # failed between two collectives: joining again would not match them; the manager reports it
            log.warning("harness rerun: the neighbour check of rank %s's step failed on rank %s before its exchange (%s); "
                        "taking part with nothing", src, ctx.rank, exc)
            from harness.lib.rerun_exchange import broadcast_result, broadcast_step

            sent = broadcast_step(src, ctx.rank, [], None, [])  # the source sends "nothing"; any other rank receives
            if sent is not None:
                broadcast_result((src + 1) % ctx.world_size, ctx.rank, len(sent[2]), None)  # as the neighbour: "failed"
            # an INTERNAL_PLUGIN_ERROR on this rank, after the others were met; the next source's check still runs here
            ctx.manager.record_error(self.name, "on_step_agreed", exc)
            return None

    def _neighbour_check(self, ctx: Any, src: int, pending: dict[str, Any] | None) -> Any:
        """Every rank together: ``src`` broadcasts its micro-batches, its neighbour recomputes them, the result comes back."""
        from harness.lib.rerun_exchange import broadcast_result, broadcast_step

        mine = pending if ctx.rank == src and pending is not None else {}
        self._in_exchange = True
        sent = broadcast_step(src, ctx.rank, mine.get("batches", []), mine.get("rng"), mine.get("losses", []))
        if sent is None:
            return None
        batches, rng, losses = sent
        target = (src + 1) % ctx.world_size
        result = None
        if ctx.rank == target:
            try:
                device = next(ctx.trainer.model.parameters()).device
                moved = [{k: v.to(device) for k, v in b.items()} for b in batches]
                done = recompute_step(ctx.trainer, moved, rng)
                result = (done.losses, done.grad_norm, done.grads_finite)
            except Exception as exc:  # noqa: BLE001 - the other ranks wait for the result: send "failed"
                log.warning("harness rerun: rank %s could not recompute rank %s's micro-batches: %s", ctx.rank, src, exc)
        back = broadcast_result(target, ctx.rank, len(losses), result)
        return None if back is None else {"rank": target, "losses": back[0], "grad_norm": back[1], "grads_finite": back[2]}

    # -- findings ------------------------------------------------------------------------------------------

    def _evidence(self, ctx: Any, p: dict[str, Any]) -> dict[str, Any]:
        rerun: Recomputed = p["rerun"]
        c: Comparison = p["comparison"]
        return {"flagged_by": p["flags"], "rank": ctx.rank, "micro_batches": len(p["losses"]), "original_losses": _strict(p["losses"]),
                "rerun_losses": _strict(rerun.losses), "original_grad_norm": _strict(p["grad_norm"]), "rerun_grad_norm": _strict(rerun.grad_norm),
                "rerun_grads_finite": rerun.grads_finite, "loss_differences": _strict(c.loss_differences), "grad_difference": _strict(c.grad_difference),
                "grad_norm_compared": ctx.world_size == 1 and p["grad_norm"] is not None, "tolerance": self.tolerance.value,
                "calibration": self.calibration, "rerun_seconds": round(rerun.seconds, 4), "reason": c.reason}

    def _report_local(self, ctx: Any, p: dict[str, Any], *, neighbour: Any = "off", note: str = "") -> None:
        step, flags, c = p["step"], ", ".join(p["flags"]), p["comparison"]
        evidence = self._evidence(ctx, p)
        what = f"step {step} on rank {ctx.rank} (flagged by {flags}), recomputed from its start RNG state on the same weights"
        if c.outcome is not Outcome.REPRODUCED:
            why = note or c.reason
            self.report(FAULT_TRANSIENT.code, f"{what}, did not reproduce ({why}; tolerance {self.tolerance.value:.3g}): the inputs do not give "
                        "that result. Suspect the hardware or silent data corruption: rerun on another device, check the node.",
                        step=step, evidence=evidence, limit=20)
            return
        if isinstance(neighbour, dict):
            evidence["neighbour"] = _strict(neighbour)
            source_finite = p["rerun"].grads_finite
            broken = _nonfinite_own_weights(ctx, step)
            if broken and not neighbour_agrees(p["losses"], neighbour["losses"], self.tolerance.value, source_finite, neighbour["grads_finite"]):
                # the neighbour computes with its own, finite weights: the difference is this rank's model state, not its device
                self.report(FAULT_REPRODUCED.code, f"{what}, reproduced it ({c.reason}); rank {neighbour['rank']} computes the same "
                            f"micro-batches clean because rank {ctx.rank}'s weights already hold NaN/Inf ({', '.join(broken[:3])}): the "
                            "model state, not the machine. Go back to a checkpoint with finite weights.",
                            step=step, evidence={**evidence, "nonfinite_weights": broken[:20]}, limit=20)
                return
            if not neighbour_agrees(p["losses"], neighbour["losses"], self.tolerance.value, source_finite, neighbour["grads_finite"]):
                self.report(FAULT_RANK_SUSPECT.code, f"{what}, reproduced on rank {ctx.rank} ({c.reason}), but rank {neighbour['rank']} computes "
                            f"the same micro-batches clean (losses {_short(neighbour['losses'])} against {_short(p['losses'])}): rank {ctx.rank}'s "
                            "device is suspect. Drain its node, run its GPU diagnostics.", step=step, evidence={**evidence, "suspect_rank": ctx.rank},
                            limit=20)
                return
        elif ctx.world_size > 1:
            evidence["neighbour"] = {"off": "not run", "everywhere": f"not needed: all {ctx.world_size} ranks reproduced their own part"}.get(
                neighbour, "failed")
        self.report(FAULT_REPRODUCED.code, f"{what}, reproduced it ({c.reason}; tolerance {self.tolerance.value:.3g})"
                    f"{', and so did rank ' + str(neighbour['rank']) if isinstance(neighbour, dict) else ''}: the data or the model state, "
                    f"not the machine. Look at the step's capture (captures/step-{step}/) and the data and LR playbooks.",
                    step=step, evidence=evidence, limit=20)


def _nonfinite_own_weights(ctx: Any, step: int) -> list[str]:
    """The parameters this rank's own finding at ``step`` found non-finite in its first bad module (nan_guard's locate
    pass: ``evidence.nonfinite_params_of_module``); [] when none was found or nothing was checked."""
    names: list[str] = []
    for finding in reversed(getattr(ctx, "findings", [])):
        if finding.step != step or finding.rank != ctx.rank:
            continue
        for entry in finding.evidence.get("nonfinite_params_of_module") or []:
            if isinstance(entry, dict) and entry.get("param") and entry["param"] not in names:
                names.append(str(entry["param"]))
    return names


def _short(values: list[float]) -> str:
    return "[" + ", ".join(f"{v:.4g}" for v in values[:4]) + (", ..." if len(values) > 4 else "") + "]"
