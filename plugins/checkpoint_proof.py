"""checkpoint_proof: every checkpoint is read back and checked off the training step; the last proven one is kept.

At each save (rank 0, which writes the weights) the training thread takes the
value of one small fixed reference batch with the model in memory (eval mode,
no gradients: one forward pass of ``reference_rows`` rows, at saves only; a
few more when that batch gives a non-finite value, as a NaN step's batch
does with any weights: an older recent batch replaces it) and
queues the checkpoint for a background thread, which checks that the folder
is complete, that the weights load on the CPU with finite values and fit the
model's names and shapes (in memory, or transformers' saved format: a MoE's
experts per expert), and that a copy of the model rebuilt from its config
through transformers' own key conversion gives the reference batch the same value.
The batch is any micro-batch the model's ``forward`` accepts (token labels,
a classifier's labels, seq2seq targets; the value is the loss, or the output's
mean square without labels). A SentenceTransformer is proven through the
transformers model inside it; a PEFT model's adapter by its tensors, equal to
the adapter's at the save (:mod:`harness.lib.checkpoint_target`). A checkpoint
that passes gets a ``harness_proven`` marker; ``CHECKPOINT_CORRUPT`` names the
file and what is wrong; ``CHECKPOINT_UNVERIFIED`` says what could not be
checked, and a checkpoint that is complete with finite weights then gets
``harness_checked``, which ``harness resume-point`` names when none is proven.
With ``save_total_limit`` the last proven checkpoint (and any still being
checked) is kept out of rotation until a newer one is proven
(:mod:`harness.lib.rotation`). ``harness resume-point <output_dir>`` prints the
newest proven checkpoint. Per step: one attribute check.
"""
from __future__ import annotations

import math
import time
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict, Field

from harness.core.findings import FindingCode, Severity
from harness.core.hookspecs import hookimpl
from harness.core.plugin import Plugin
from harness.lib.checkpoint_verify import Layout
from harness.lib.raw_resume import resumes_by_saved_names

CRASH_WAIT_S = 10.0  # after a crash or a preemption the run end waits at most this long for checks still running
MAX_REFERENCE_TRIES = 4  # forward passes at one save, looking for a reference batch with a finite loss

CHECKPOINT_CORRUPT = FindingCode(
    "CHECKPOINT_CORRUPT", Severity.ERROR,
    "A checkpoint read back after its save is incomplete, does not load, or does not hold the weights that were training.",
    "checkpoints#checkpoint_corrupt",
)
# info by default: a format or size the checks cannot handle holds for every save of a healthy run (FSDP sharded state,
# ZeRO-3 without gathered weights), and a warning there would mark every such run "needs attention"; the missing
# harness_proven marker and `harness resume-point` exiting 1 already tell scripts. Reasons that belong to one save
# (a rank's files never appeared, the check failed or did not finish by the run end) are reported as warnings.
CHECKPOINT_UNVERIFIED = FindingCode(
    "CHECKPOINT_UNVERIFIED", Severity.INFO,
    "A checkpoint could not be fully checked (a format the checks cannot load, a model without a config, a check cut short).",
    "checkpoints#checkpoint_unverified",
)


class CheckpointProofOptions(BaseModel):
    """Options of the ``checkpoint_proof`` plugin."""

    model_config = ConfigDict(extra="forbid")

    check_loss: bool = Field(True, description="Compare the reference-batch loss (the output's mean square without labels; a PEFT "
                             "adapter: its tensors) of the weights on disk with the model's at the save "
                             "(false: completeness and weights only, and a checkpoint is proven without it).")
    reference_rows: int = Field(2, ge=1, description="Rows of a training micro-batch kept as the reference batch (taken at the first save; a later one when it gives a non-finite loss, as the batch of a NaN step does).")
    reference_tokens: int = Field(64, ge=8, description="Tokens per reference row (the rest is cut).")
    loss_rtol: float | None = Field(None, gt=0, description="Relative loss difference allowed (default: 1e-4 in fp32, 2e-2 under bf16/fp16).")
    max_model_mb: float = Field(4096.0, gt=0, description="Largest model (fp32 MiB) rebuilt on the CPU for the loss check (a PEFT "
                                "adapter: the adapter, copied at each save); above it the loss is not checked (CHECKPOINT_UNVERIFIED "
                                "once per run) and the checkpoint is not proven (harness_checked when complete with finite weights).")
    keep_proven: bool = Field(
        True, description="Keep the last proven checkpoint (and the one just written, and those being checked) out of save_total_limit "
        "rotation. Not covered: the Trainer's own clean-up at the end of training with load_best_model_at_end and save_total_limit 1, "
        "which keeps the best checkpoint only.",
    )
    rank_wait_s: float = Field(120.0, gt=0, description="Seconds the check waits for every rank's part of a save before it gives up (unverified).")
    wait_at_end_s: float = Field(120.0, ge=0, description="Seconds the run end waits for checks still running, so their findings reach the report (10 s at most after a crash or a preemption).")
    max_reports: int = Field(10, ge=1, description="Findings per code per run.")


def _layout(trainer: Any, world_size: int) -> Layout:
    args = trainer.args
    deepspeed = bool(getattr(trainer, "is_deepspeed_enabled", False))
    scheduler = not deepspeed or type(getattr(trainer, "lr_scheduler", None)).__name__ != "DeepSpeedSchedulerWrapper"
    return Layout(world_size=world_size, save_only_model=bool(getattr(args, "save_only_model", False)), deepspeed=deepspeed,
                  fsdp=bool(getattr(trainer, "is_fsdp_enabled", False)), scheduler=scheduler)


class CheckpointProof(Plugin):
    """Reads every checkpoint back in a background thread: complete, loadable, the same loss; keeps the last proven one."""

    name = "checkpoint_proof"
    Options = CheckpointProofOptions
    CODES = (CHECKPOINT_CORRUPT, CHECKPOINT_UNVERIFIED)

    def __init__(self) -> None:
        self.options = CheckpointProofOptions()
        self._worker: Any = None
        self._rotation: Any = None
        self._batch: dict[str, Any] | None = None
        self._expected: dict[str, Any] | None = None
        self._target: Any = None  # checkpoint_target.Target of the trained model (once per run)
        self._module: Any = None  # the part of the model in memory that the target describes
        self._no_target: str | None = None  # why the weights file is not a transformers model's or a PEFT adapter's
        self._unverified_said: set[str] = set()
        self.timings: list[dict[str, float]] = []  # per checkpoint: save_cost_s (training thread), verify_s (background)

    @hookimpl
    def on_run_start(self, ctx: Any, trainer: Any) -> None:
        self._batch, self._expected, self._unverified_said = None, None, set()
        self._target, self._module, self._no_target = None, None, None
        self.idle_hooks("on_step_end")  # polled only while a checkpoint's proof is pending
        if not ctx.is_main:
            return  # rank 0 writes the weights and rotates; it checks for every rank
        from harness.lib.proof_worker import ProofWorker

        from harness.lib.proven import newest_proven

        self._worker = ProofWorker()
        output_dir = getattr(getattr(trainer, "args", None), "output_dir", None)
        if output_dir:  # a resumed run keeps the checkpoint an earlier attempt proved until it proves a newer one
            self._worker.last_proven = newest_proven(Path(output_dir))
        if self.options.keep_proven and callable(getattr(trainer, "_save_checkpoint", None)):  # a Trainer (not a custom loop)
            from harness.lib.rotation import install

            self._rotation = install(trainer, self._worker.keep)

    @hookimpl
    def on_checkpoint_save(self, ctx: Any, step: int, checkpoint_dir: Path) -> None:
        if self._worker is None:
            return
        from harness.lib.proof_worker import Job

        started = time.perf_counter()
        trainer = ctx.trainer
        job = Job(Path(trainer.args.output_dir), Path(checkpoint_dir), step, _layout(trainer, ctx.world_size),
                  rtol=self.options.loss_rtol, rank_wait_s=self.options.rank_wait_s, raw_resume=resumes_by_saved_names(trainer),
                  not_saved=ctx.unsaved_states.get(step))
        self._take_reference(ctx, trainer, job)
        job.save_cost_s = time.perf_counter() - started
        self._worker.submit(job)
        self.idle_hooks("on_step_end", idle=False)

    def _take_reference(self, ctx: Any, trainer: Any, job: Any) -> None:
        """On the training thread: what the weights file holds and its shapes (once), and the reference value with the
        model in memory (a PEFT adapter: its tensors)."""
        from harness.lib.capture import can_recompute
        from harness.lib.checkpoint_target import find_target
        from harness.lib.checkpoint_verify import expected_shapes

        why_not = can_recompute(trainer)
        if why_not is not None:
            job.no_loss_reason = why_not if self.options.check_loss else None
            return
        if self._expected is None:
            self._target, self._module, self._no_target = find_target(trainer.model)
            self._expected = expected_shapes(trainer.model if self._module is None else self._module)
            if self._target is not None and self._target.kind == "adapter":
                from harness.lib.checkpoint_target import adapter_state

                state = adapter_state(self._module, self._target.adapter_name)
                self._expected = {name: (tuple(t.shape), index) for index, (name, t) in enumerate(state.items())}
        job.expected, job.target = self._expected, self._target
        if not self.options.check_loss:
            return
        if self._target is None:
            job.no_loss_reason = self._no_target
            return
        module = self._module
        adapter = None
        if self._target.kind == "adapter":  # its tensors are copied, not the model rebuilt: the adapter's size is what counts
            from harness.lib.checkpoint_target import adapter_state

            adapter = adapter_state(module, self._target.adapter_name)
        size_mb = sum(t.numel() for t in (adapter.values() if adapter is not None else module.parameters())) * 4 / 2**20
        if size_mb > self.options.max_model_mb:
            what = "adapter" if adapter is not None else "model"
            job.no_loss_reason = (f"the {what} is {size_mb:.0f} MiB in fp32, above max_model_mb ({self.options.max_model_mb:g}); raise it "
                                  "or set check_loss: false")
            return
        if adapter is not None:
            job.adapter = {name: t.detach().to("cpu", copy=True) for name, t in adapter.items()}
            return
        self._reference_value(ctx, trainer, module, job)

    def _reference_value(self, ctx: Any, trainer: Any, module: Any, job: Any) -> None:
        """The kept reference batch first, then the recent micro-batches, newest first: the first the model accepts that
        gives a finite value with the model in memory (the batch of a step that went NaN, often the one a stop saves
        after, compares nothing)."""
        from harness.lib.checkpoint_loss import accepted_inputs, reference_batch, take_reference

        accepted = accepted_inputs(module)
        candidates = [self._batch] if self._batch is not None else []
        candidates += [batch for _, _, batch in reversed(ctx.recent_batches)]
        tried, failed = 0, None
        for candidate in candidates:
            cut = candidate if candidate is self._batch else reference_batch(candidate, self.options.reference_rows,
                                                                              self.options.reference_tokens, accepted)
            if cut is None:
                continue
            tried += 1
            try:
                job.reference = take_reference(module, trainer, cut)
            except Exception as exc:  # noqa: BLE001 - a batch this model does not take as cut: try the next one
                failed = f"{type(exc).__name__}: {str(exc)[:160]}"
                job.reference = None
            else:
                if job.reference is None:
                    job.no_loss_reason = f"{type(module).__name__} has no config to rebuild it from, or returned neither a loss nor an output"
                    return
                if math.isfinite(job.reference.loss):
                    self._batch = cut
                    return
            if tried >= MAX_REFERENCE_TRIES:
                break
        job.reference = None
        if failed is not None:
            job.no_loss_reason = f"the model in memory did not take the reference batch ({failed})"
        elif tried:
            job.no_loss_reason = "every reference batch tried gives a non-finite value with the model in memory: the check cannot tell"
        else:
            takes = ", ".join(sorted(accepted)[:8]) if accepted else "any tensor"
            job.no_loss_reason = (f"no micro-batch {type(module).__name__} accepts was seen to take a reference batch from "
                                  f"(its forward takes {takes}; none of the recent batches had those tensors with one row count)")

    @hookimpl
    def on_step_end(self, ctx: Any, step: int) -> None:
        if self._worker is None:
            return
        done = not self._worker.pending()  # the worker queues an outcome before it clears the pending entry
        if self._worker.has_outcomes():
            self._take_outcomes(ctx)
        if done:
            self.idle_hooks("on_step_end")  # nothing left to poll until the next save

    @hookimpl
    def on_run_end(self, ctx: Any, status: str) -> None:
        worker, self._worker = self._worker, None
        if worker is None:
            return
        # after a crash or a preemption (a scheduler's grace period is short) the wait is short too: the checkpoint itself is
        # on disk either way, only its proof is left unfinished
        preempted = any(f.code == "PREEMPTED" for f in ctx.findings)
        short = status == "crashed" or preempted
        waited = min(self.options.wait_at_end_s, CRASH_WAIT_S) if short else self.options.wait_at_end_s
        finished = worker.wait(waited)  # bounded: the findings reach the report, a crash's traceback is not held up long
        self._take_outcomes(ctx, worker)
        for checkpoint in [] if finished else worker.pending():
            self._unverified(ctx, checkpoint, f"its check did not finish within {waited:g} s of the run end (wait_at_end_s)", loud=True)
        worker.close()

    def _take_outcomes(self, ctx: Any, worker: Any = None) -> None:
        worker = worker or self._worker
        for outcome in worker.take():
            job = outcome.job
            self.timings.append({"step": job.step, "save_cost_s": job.save_cost_s, "verify_s": outcome.seconds})
            if outcome.problems:
                files = sorted({p.file for p in outcome.problems})
                self.report(
                    CHECKPOINT_CORRUPT.code,
                    f"{job.checkpoint.name} is not a checkpoint a resume can trust: " + "; ".join(str(p) for p in outcome.problems[:5])
                    + (f" (and {len(outcome.problems) - 5} more)" if len(outcome.problems) > 5 else "")
                    + (f". The last proven checkpoint, {worker.last_proven.name}, is kept." if worker.last_proven else "."),
                    step=job.step, limit=self.options.max_reports,
                    evidence={"checkpoint": str(job.checkpoint), "files": files, "problems": [str(p) for p in outcome.problems],
                              "checks_passed": outcome.checks, "last_proven": str(worker.last_proven) if worker.last_proven else None,
                              "loss_at_save": job.reference.loss if job.reference else None, "loss_from_disk": outcome.loss_from_disk},
                )
            elif outcome.unverified:
                self._unverified(ctx, job.checkpoint, "; ".join(outcome.unverified), outcome.checks, job.step, loud=outcome.loud)
        if self._rotation is not None:
            self._rotation.rotate()  # a newer proven checkpoint frees the one kept before it

    def _unverified(self, ctx: Any, checkpoint: Path, why: str, checks: list[str] | None = None, step: int | None = None,
                    loud: bool = False) -> None:
        key = why.split(" (")[0]  # one finding per reason per run: the same reason holds for every save of the run
        if key in self._unverified_said:
            return
        self._unverified_said.add(key)
        self.report(
            CHECKPOINT_UNVERIFIED.code,
            f"{checkpoint.name} could not be proven: {why}. It gets no harness_proven marker; checks passed: {', '.join(checks or []) or 'none'}"
            + (" (complete with finite weights: harness_checked, which `harness resume-point` names when no checkpoint is proven)."
               if {"complete", "weights_finite"} <= set(checks or []) and not loud else "."),
            step=step, limit=self.options.max_reports, severity=Severity.WARNING if loud else None,
            evidence={"checkpoint": str(checkpoint), "reason": why, "checks_passed": checks or []},
        )
