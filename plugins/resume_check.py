"""resume_check: a resumed run continues exactly where the interrupted one stopped, or it does not train on.

At every save it stores beside the checkpoint (``harness_state/rank-<r>.json``)
a fingerprint of what a resume must bring back: the weights, the optimizer
state, the scheduler, the RNG streams, the world size and the training
arguments that shape the schedule, the recent losses and the loss of a small
fixed reference batch. After the Trainer has restored a checkpoint it
recomputes each and compares; the first steps after the resume are
compared with what the interrupted run trained next (from the data ledgers
of all its ranks): each rank's samples must be among the step's samples of
every rank of the interrupted run, checked as its micro-batches arrive
(before the first update), and the step's samples of all ranks together
must be that set, checked once they meet in the step's exchange (so a
resume on another number of processes that keeps the global batch trains
on, and one that trains part of the step twice or leaves part out does not).
Mismatches of weights, optimizer or data position stop training before its
first update by default; the rest warn. The data position is read from
``data_hash``'s ledger and the interrupted run's losses from
``metrics_log``'s file (``requires``): with data_hash off a resume reports
``RESUME_UNCHECKED`` for the data position once instead of passing silently.
"""
from __future__ import annotations

import math
from collections import Counter, deque
from pathlib import Path
from typing import Any

import torch
from pydantic import BaseModel, ConfigDict, Field

from harness.lib.capture import can_recompute, per_sample_loss, recompute_losses
from harness.lib.checkpoints import STATE_DIR, read_state_file
from harness.core.findings import Finding, FindingCode, Severity
from harness.core.jsonl import read_jsonl
from harness.core.strictjson import as_float
from harness.core.plugin import Plugin
from harness.lib.fingerprints import differing, optimizer_tensors, param_tensors, rng_fingerprints, scheduler_state, tensor_sums
from harness.lib.hashing import batch_row_hashes, hex64_all
from harness.core.hookspecs import hookimpl
from harness.lib.robust import judge
from harness.lib.sharding import model_is_sharded, optimizer_is_sharded
from harness.lib.ledger import continuation
from harness.lib.lr_resume import base_lr, describe, judge_lr_at_resume, schedule_factor


def _code(code: str, severity: Severity, summary: str) -> FindingCode:
    return FindingCode(code, severity, summary, f"resume#{code.lower()}")


RESUME_MODEL_MISMATCH = _code("RESUME_MODEL_MISMATCH", Severity.CRITICAL, "The restored weights differ from the ones saved in the checkpoint.")
RESUME_OPTIMIZER_NOT_RESTORED = _code(
    "RESUME_OPTIMIZER_NOT_RESTORED", Severity.ERROR, "The optimizer state was not restored (missing, fresh or different)."
)
RESUME_SCHEDULER_MISMATCH = _code("RESUME_SCHEDULER_MISMATCH", Severity.ERROR, "The LR scheduler did not resume at the saved position.")
RESUME_RNG_NOT_RESTORED = _code("RESUME_RNG_NOT_RESTORED", Severity.WARNING, "The random-number streams were not restored to their saved state.")
RESUME_DATA_POSITION = _code(
    "RESUME_DATA_POSITION", Severity.ERROR, "The first batches after the resume are not the ones the interrupted run trained next."
)
RESUME_WORLD_SIZE_CHANGED = _code("RESUME_WORLD_SIZE_CHANGED", Severity.WARNING, "The run resumed with a different number of processes.")
RESUME_CONFIG_CHANGED = _code("RESUME_CONFIG_CHANGED", Severity.WARNING, "Training arguments that shape the schedule changed across the resume.")
RESUME_LOSS_JUMP = _code(
    "RESUME_LOSS_JUMP", Severity.WARNING, "The loss after the resume does not continue the saved run's (reference batch or first steps)."
)
LR_CHANGE_IGNORED_ON_RESUME = _code(
    "LR_CHANGE_IGNORED_ON_RESUME", Severity.WARNING,
    "--learning_rate changed at the resume, but the restored scheduler keeps the saved LR: the new value has no effect.",
)
RESUME_UNCHECKED = _code(
    "RESUME_UNCHECKED", Severity.WARNING, "The checkpoint has no resume_check state: the resume was not verified (no check ran)."
)
CODES = [
    RESUME_UNCHECKED, RESUME_MODEL_MISMATCH, RESUME_OPTIMIZER_NOT_RESTORED, RESUME_SCHEDULER_MISMATCH, RESUME_RNG_NOT_RESTORED,
    RESUME_DATA_POSITION, RESUME_WORLD_SIZE_CHANGED, RESUME_CONFIG_CHANGED, RESUME_LOSS_JUMP, LR_CHANGE_IGNORED_ON_RESUME,
]
SCHEDULE_KEYS = (
    "learning_rate", "lr_scheduler_type", "warmup_steps", "warmup_ratio", "max_steps", "num_train_epochs",
    "per_device_train_batch_size", "gradient_accumulation_steps", "seed", "data_seed", "weight_decay", "max_grad_norm",
    "optim", "adam_beta1", "adam_beta2", "adam_epsilon", "bf16", "fp16",
)


class ResumeCheckOptions(BaseModel):
    """Options of the ``resume_check`` plugin."""

    model_config = ConfigDict(extra="forbid")

    stop_on: list[str] = Field(
        default_factory=lambda: [RESUME_MODEL_MISMATCH.code, RESUME_OPTIMIZER_NOT_RESTORED.code, RESUME_DATA_POSITION.code],
        description="Codes that stop training before its first update (on mismatch: stop); every other RESUME_* code warns.",
        json_schema_extra={"names_codes": True},  # checked against the declared codes by harness.core.config
    )
    first_steps: int = Field(3, ge=1, description="Steps after the resume compared with the interrupted run's batches and loss band.")
    loss_window: int = Field(20, ge=3, description="Step losses kept before each save: the band the first losses after a resume must fall in.")
    loss_band_rise: float = Field(0.1, ge=0, description="The first losses may exceed the band's median by this fraction and ...")
    loss_band_z: float = Field(6.0, gt=0, description="... this many robust SDs of the saved window before RESUME_LOSS_JUMP.")
    reference_rows: int = Field(2, ge=1, description="Rows of the run's first batch kept as the reference batch.")
    reference_tokens: int = Field(256, ge=8, description="Tokens per reference row (the rest is cut).")
    config_keys: list[str] = Field(default_factory=lambda: list(SCHEDULE_KEYS), description="Training arguments compared across a resume.")


def _half(trainer: Any) -> bool:
    args = getattr(trainer, "args", None)
    return bool(getattr(args, "bf16", False) or getattr(args, "fp16", False))


class ResumeCheck(Plugin):
    """Fingerprints training state at each save and verifies it after a resume."""

    name = "resume_check"
    Options = ResumeCheckOptions
    CODES = tuple(CODES)
    requires = ("data_hash", "metrics_log")  # the ledger (data position) and metrics.jsonl (the interrupted run's losses)

    def __init__(self) -> None:
        self.options = ResumeCheckOptions()
        self._losses: deque[float] = deque(maxlen=self.options.loss_window)
        self._reference: dict[str, torch.Tensor] | None = None
        self._reference_pending: dict[str, torch.Tensor] = {}  # device slices deferred, not yet on the host
        self._saved: dict[str, Any] | None = None
        self._resume_step: int | None = None
        self._pending_rng = False
        # step -> the sample hashes every rank of the interrupted run trained at it (one set per step, whatever the world size)
        self._expected: dict[int, list[str]] | None = None
        self._wanted: dict[int, Counter[str]] = {}  # the same, counted: how often each sample may come at that step
        self._interrupted_world: int | None = None  # the interrupted run's processes (its ledger's start lines)
        self._trained_at: dict[str, int] = {}  # sample hash -> the step after the checkpoint the interrupted run trained it at
        self._seen_in_step: dict[int, Counter[str]] = {}  # step -> the samples of it this rank has trained so far
        self._exchange_step: int | None = None  # the step whose exchange (data_hash's samples of every rank) is the last one
        self._source_run_dir: Path | None = None  # the harness folder of the run that saved the checkpoint resumed from
        self._position_reported = False
        self._band_checked = 0
        self._earlier_losses: dict[int, float] | None = None
        self._config_changed: dict[str, dict[str, Any]] | None = None  # held until the first update shows which LR won
        self._reshard = self._reshard_optimizer = False

    def setup(self, ctx: Any) -> None:
        self._losses = deque(maxlen=self.options.loss_window)

    @hookimpl
    def on_run_start(self, ctx: Any) -> None:
        self._losses.clear()
        self._resume_step, self._saved, self._expected, self._wanted, self._interrupted_world = None, None, None, {}, None
        self._trained_at, self._seen_in_step, self._source_run_dir, self._exchange_step = {}, {}, None, None
        self._earlier_losses: dict[int, float] | None = None
        self._pending_rng, self._position_reported, self._band_checked = False, False, 0
        self._config_changed = None
        self._reshard = self._reshard_optimizer = False  # resumed with another world size and sharded state: not comparable
        self.idle_hooks("inspect_batch", "on_before_optimizer_step", idle=False)  # called until the reference and the resume's checks are done

    @hookimpl
    def decide_action(self, ctx: Any, finding: Finding) -> str | None:
        return "stop" if finding.code in self.options.stop_on else None

    # -- what is saved ------------------------------------------------------------------------------

    @hookimpl
    def inspect_batch(self, ctx: Any, batch: Any, step: int, micro_step: int) -> None:
        if self._reference is None and hasattr(batch, "get") and torch.is_tensor(batch.get("labels")) and torch.is_tensor(batch.get("input_ids")):
            rows, tokens = self.options.reference_rows, self.options.reference_tokens
            keys = [k for k in ("input_ids", "labels", "attention_mask") if torch.is_tensor(batch.get(k)) and batch[k].dim() == 2]
            self._reference = {}  # filled from the step guard's one read (``_take_reference``)
            self._reference_pending = {k: batch[k][:rows, :tokens].detach().clone() for k in keys}
            for k, tensor in self._reference_pending.items():
                self.defer(f"reference/{k}", tensor)
        if self._resume_step is not None and step <= self._resume_step + self.options.first_steps:
            self._check_after_resume(ctx, batch, step, micro_step)
        elif self._reference is not None:
            self.idle_hooks("inspect_batch")  # the reference is taken and no resume is being checked: nothing per batch

    @hookimpl
    def on_before_optimizer_step(self, ctx: Any, step: int, model: Any, optimizer: Any, grad_norm: Any, loss: Any) -> None:
        self._take_reference()
        if self._config_changed is not None:
            self._report_config_changed(ctx, optimizer, step)
        checking = self._resume_step is not None and step <= self._resume_step + self.options.first_steps
        if checking:
            self._exchange_step = step  # the guard's exchange after this hook carries this step's samples
            if ctx.world_size == 1 and step in self._seen_in_step:  # every sample of the step is here: before its update
                self._check_step_set(ctx, step, [self._seen_in_step[step]])
        if self._reference is not None and not self._reference_pending and self._config_changed is None and not checking:
            self.idle_hooks("on_before_optimizer_step")

    @hookimpl
    def on_run_end(self, ctx: Any) -> None:
        if self._config_changed is not None:  # resumed, but no update ran: judge with the LR the next update would get
            self._report_config_changed(ctx, getattr(ctx.trainer, "optimizer", None), None)

    def _take_reference(self) -> None:
        """The reference rows as host tensors, from the guard's read (or copied here if no guard read them: a save before any step)."""
        if not self._reference_pending:
            return
        pending, self._reference_pending = self._reference_pending, {}
        reference: dict[str, torch.Tensor] = {}
        for k, tensor in pending.items():
            got = self.deferred(f"reference/{k}")
            reference[k] = torch.tensor(got[0], dtype=tensor.dtype) if got else tensor.cpu()
        self._reference = reference

    @hookimpl
    def on_step_end(self, ctx: Any, step: int, metrics: dict[str, Any]) -> None:
        self._take_reference()  # a step whose optimizer never ran: the step end read the deferred values
        if self._exchange_step == step and ctx.world_size > 1 and ctx.is_main:
            self._exchange_step = None
            self._check_exchanged_step(ctx, step)
        loss = metrics.get("loss")  # a host float: the guard read it in the step's one transfer
        if loss is None:
            return
        loss = float(loss)
        self._losses.append(loss)
        if self._resume_step is not None and self._saved and self._band_checked < self.options.first_steps:
            self._band_checked += 1
            self._check_loss_band(ctx, step, loss)

    @hookimpl
    def checkpoint_state(self, ctx: Any, step: int) -> dict[str, Any]:
        trainer = ctx.trainer
        losses = list(self._losses)
        scheduler = getattr(trainer, "lr_scheduler", None)
        state: dict[str, Any] = {
            "step": step,
            "world_size": ctx.world_size,
            "epoch": float(getattr(trainer.state, "epoch", 0.0) or 0.0),
            "config": {k: _plain(getattr(trainer.args, k, None)) for k in self.options.config_keys},
            "params": tensor_sums(param_tensors(trainer.model_wrapped, clone=False)),
            "optimizer": tensor_sums(optimizer_tensors(trainer.optimizer, clone=False)),
            "scheduler": scheduler_state(scheduler),
            "rng": rng_fingerprints(),
            "loss_window": [v for v in losses if math.isfinite(v)],
        }
        reference = self._reference_loss(trainer)
        if reference is not None:
            state["reference"] = {"batch": {k: v.tolist() for k, v in self._reference.items()}, "loss": reference}  # type: ignore[union-attr]
        return state

    def _reference_loss(self, trainer: Any) -> float | None:
        self._take_reference()
        if not self._reference or can_recompute(trainer) is not None:
            return None
        model = trainer.model
        device = next(model.parameters()).device
        batch = {k: v.to(device) for k, v in self._reference.items()}
        was_training = model.training
        model.eval()  # no dropout: the same weights give the same number
        try:
            (losses,) = recompute_losses(model, [batch], {"cpu": torch.get_rng_state()})
        finally:
            model.train(was_training)
        return float(losses.mean()) if losses is not None else None

    # -- what is checked after a resume -----------------------------------------------------------------

    @hookimpl
    def on_resume(self, ctx: Any, checkpoint_dir: Any, state: dict[str, Any] | None) -> None:
        self._resume_step = ctx.step
        self.idle_hooks("inspect_batch", "on_before_optimizer_step", idle=False)  # the first batches after it are checked
        self._saved = state
        # the run that saved the checkpoint: another output_dir's when the resume starts a new one from it (its ledger then
        # says what that run trained next; read only)
        self._source_run_dir = Path(str(checkpoint_dir)).parent / ctx.run_dir.name if checkpoint_dir is not None else None
        if "data_hash" in self.missing and ctx.is_main and not self._expected_samples(ctx):
            # no ledger of what the interrupted run trained next (an earlier attempt with data_hash on would have one)
            self.unchecked(
                RESUME_UNCHECKED.code,
                f"the data position after resuming from {Path(str(checkpoint_dir)).name} (whether the first batches are the "
                "ones the interrupted run trained next)",
                evidence={"checkpoint": str(checkpoint_dir), "unchecked": "data position"},
            )
        borrowed = _state_of_rank_0(Path(str(checkpoint_dir)), ctx.rank) if checkpoint_dir is not None else None
        if borrowed is not None:
            # the saving run had no rank ctx.rank (a resume on more processes): its replicas' state is rank 0's; a file of this
            # rank's own there is left from an earlier save into the same folder by more processes (the Trainer overwrites)
            state = self._saved = borrowed
        if not state:
            self._report_unchecked(ctx, checkpoint_dir)  # nothing to compare with: say so rather than pass silently
            return
        trainer = ctx.trainer
        resized = state.get("world_size") != ctx.world_size
        self._reshard = resized and model_is_sharded(trainer)
        self._reshard_optimizer = resized and optimizer_is_sharded(trainer)
        saved_batch, batch = _batch_geometry(state.get("config") or {}, state.get("world_size")), _batch_geometry(
            {k: _plain(getattr(trainer.args, k, None)) for k in BATCH_KEYS}, ctx.world_size)
        kept = resized and saved_batch is not None and batch is not None and saved_batch[-1] == batch[-1]
        if resized and ctx.is_main:  # the job's world size: one finding, not one per rank
            self._report_world_size(ctx, state, saved_batch, batch, kept)
        config_now = {k: _plain(getattr(trainer.args, k, None)) for k in self.options.config_keys}
        changed = {k: {"saved": state["config"].get(k), "now": v} for k, v in config_now.items() if k in state.get("config", {}) and state["config"][k] != v}
        if kept:  # the per-device batch and accumulation that keep the global batch across the world-size change: said there
            changed = {k: c for k, c in changed.items() if k not in BATCH_KEYS}
        if changed:
            self._config_changed = changed
            if "learning_rate" not in changed:  # else wait for the first update: it shows which LR won
                self._report_config_changed(ctx, None, None)
        self._check_model(ctx, trainer, state)
        self._check_optimizer(ctx, trainer, state)
        self._check_scheduler(ctx, trainer, state)
        self._check_reference(ctx, trainer, state)
        epoch = float(state.get("epoch", 0.0))
        # at an epoch start the loader draws from the RNG first; with another world size the Trainer's per-rank RNG files
        # (rng_state_<r>.pth) do not carry over, as RESUME_WORLD_SIZE_CHANGED says
        self._pending_rng = "rng" in state and epoch != int(epoch) and not resized

    def _report_world_size(self, ctx: Any, state: dict[str, Any], saved_batch: tuple[int, ...] | None,
                           batch: tuple[int, ...] | None, kept: bool) -> None:
        """RESUME_WORLD_SIZE_CHANGED: info when the global batch is kept (the playbook's advice; the data position is
        still compared, as one set of samples per step), a warning when it changed or sharded state could not be compared."""
        saved_world = state.get("world_size")
        what = "the weights and optimizer state are" if self._reshard else "the optimizer state is"
        if saved_batch is not None and batch is not None:
            geometry = f"{_geometry_text(saved_batch)} then, {_geometry_text(batch)} now"
        else:
            geometry = None
        if kept:
            message = (f"the run was saved with {_processes(saved_world)} and resumes with {ctx.world_size}, keeping the global batch "
                       f"({geometry}): each step trains as many samples as before, and the first steps' samples are compared "
                       "with the interrupted run's as one set over all ranks. The per-rank RNG files (rng_state_<r>.pth) do "
                       "not carry over: dropout and sampling draw other numbers than the interrupted run's")
        else:
            message = (f"the run was saved with {_processes(saved_world)} and resumes with {ctx.world_size}"
                       + (f" ({geometry}): the global batch changed, so" if geometry and saved_batch != batch else ":")
                       + " the data position (samples per step) and any per-rank state no longer line up")
        message += (f"; {what} partitioned across the ranks, so each rank now holds other parts and they were not compared."
                    if self._reshard_optimizer else ".")
        evidence = {"saved": saved_world, "now": ctx.world_size, "sharded": self._reshard, "optimizer_sharded": self._reshard_optimizer}
        if saved_batch is not None and batch is not None:
            evidence.update({"saved_global_batch": saved_batch[-1], "global_batch": batch[-1]})
        self.report(RESUME_WORLD_SIZE_CHANGED.code, message, evidence=evidence,
                    severity=Severity.INFO if kept and not self._reshard_optimizer else None)

    def _report_config_changed(self, ctx: Any, optimizer: Any, step: int | None) -> None:
        """RESUME_CONFIG_CHANGED, saying whether a changed learning rate is in effect (LR_CHANGE_IGNORED_ON_RESUME if not)."""
        changed, self._config_changed = self._config_changed or {}, None
        if not ctx.is_main:
            return  # the training arguments are the job's, alike on every rank: one finding, not one per rank
        parts = {k: f"{k} {c['saved']} -> {c['now']}" for k, c in changed.items()}
        evidence: dict[str, Any] = {"changed": changed}
        lr_change = changed.get("learning_rate")
        groups = getattr(optimizer, "param_groups", None)
        if lr_change is not None and groups and isinstance(lr_change["saved"], (int, float)) and isinstance(lr_change["now"], (int, float)):
            scheduler = getattr(ctx.trainer, "lr_scheduler", None)
            lr = judge_lr_at_resume(float(lr_change["saved"]), float(lr_change["now"]), base_lr(scheduler),
                                    float(groups[0]["lr"]), schedule_factor(scheduler))  # host floats: no device read
            evidence["learning_rate"] = lr.evidence()
            parts["learning_rate"] = describe(lr)
            if lr.winner == "restored":
                del parts["learning_rate"]
                self._report_lr_ignored(lr, step)
        if parts:
            self.report(RESUME_CONFIG_CHANGED.code, "training arguments changed across the resume: " + ", ".join(parts.values()) + ".",
                        step=self._resume_step, evidence=evidence)

    def _report_lr_ignored(self, lr: Any, step: int | None) -> None:
        where = f"the first update after the resume (step {step})" if step is not None else "the next update"
        would = f"; --learning_rate {lr.configured:g} would give {lr.configured_would_give:.3g} there" if lr.configured_would_give is not None else ""
        self.report(
            LR_CHANGE_IGNORED_ON_RESUME.code,
            f"--learning_rate is {lr.configured:g} now ({lr.saved:g} at the save), but the Trainer restored scheduler.pt, whose base "
            f"LR is {lr.restored_base if lr.restored_base is not None else lr.saved:g}: {where} used {lr.applied:.3g}{would}. "
            "The new value has no effect on this run; the schedule continues with the saved one.",
            step=step if step is not None else self._resume_step,
            evidence=lr.evidence(),
        )

    def _report_unchecked(self, ctx: Any, checkpoint_dir: Any) -> None:
        state_dir = Path(checkpoint_dir) / STATE_DIR
        state_file = state_dir / f"rank-{ctx.rank}.json"
        if not state_dir.is_dir():
            why = f"{state_dir.name}/ is missing (saved without the harness, copied without it, or killed during the save)"
        elif not state_file.is_file():
            why = f"{state_dir.name}/{state_file.name} is missing (the save was interrupted on this rank, or it ran with another world size)"
        else:
            problem = read_state_file(Path(checkpoint_dir), ctx.rank)[1]
            why = (f"{state_dir.name}/{state_file.name} cannot be used: {problem}" if problem is not None else
                   f"{state_dir.name}/{state_file.name} has no resume_check entry (resume_check was off when it was saved)")
        self.report(
            RESUME_UNCHECKED.code,
            f"resumed from {Path(checkpoint_dir).name} without verifying it: {why}. Weights, optimizer state, scheduler, RNG "
            "streams, training arguments and the reference-batch loss were not compared with the saved run (only the data "
            "position is still checked, against the ledger).",
            evidence={"checkpoint": str(checkpoint_dir), "missing": str(state_file if state_dir.is_dir() else state_dir)},
        )

    def _check_model(self, ctx: Any, trainer: Any, state: dict[str, Any]) -> None:
        if self._reshard:
            return  # another world size cuts the shards elsewhere: per-rank fingerprints cannot match
        saved = state.get("params") or {}
        diff = differing(saved, tensor_sums(param_tensors(trainer.model_wrapped, clone=False)))
        if saved and diff:
            from harness.lib.raw_resume import raw_load_gap

            cause = "the checkpoint's model file was changed, or another model was loaded."
            # a file in transformers' saved format (MoE experts per expert) that the Trainer loaded by raw names: say so
            folder = Path(ctx.resumed_from) if ctx.resumed_from is not None else None
            gap = raw_load_gap(folder, trainer, diff) if folder is not None else None
            self.report(
                RESUME_MODEL_MISMATCH.code,
                f"{len(diff)} of {len(saved)} weight tensors differ from those saved at step {state['step']} "
                f"(first: {', '.join(diff[:3])}): {gap.cause(folder.name, diff, cause) if gap and folder else cause}",
                evidence={"tensors": diff[:50], "count": len(diff), **(gap.evidence() if gap else {})},
            )

    def _check_optimizer(self, ctx: Any, trainer: Any, state: dict[str, Any]) -> None:
        if self._reshard_optimizer:
            return  # ZeRO and FSDP partition the optimizer state by world size: per-rank fingerprints cannot match
        saved = state.get("optimizer") or {}
        now = tensor_sums(optimizer_tensors(trainer.optimizer, clone=False))
        diff = differing(saved, now)
        if saved and diff:
            missing = [n for n in saved if n not in now]
            what = "is empty (optimizer.pt missing or not loaded)" if not now or len(missing) == len(saved) else "differs from the saved one"
            self.report(
                RESUME_OPTIMIZER_NOT_RESTORED.code,
                f"the optimizer state {what}: {len(diff)} of {len(saved)} state tensors do not match step {state['step']}; "
                "Adam restarts its moment estimates, which destabilises the first steps.",
                evidence={"tensors": diff[:50], "saved_tensors": len(saved), "restored_tensors": len(now)},
            )

    def _check_scheduler(self, ctx: Any, trainer: Any, state: dict[str, Any]) -> None:
        saved, now = state.get("scheduler"), scheduler_state(getattr(trainer, "lr_scheduler", None))
        if saved and now and (saved["last_epoch"] != now["last_epoch"] or not math.isclose(saved["lr"], now["lr"], rel_tol=1e-6)):
            self.report(
                RESUME_SCHEDULER_MISMATCH.code,
                f"the LR scheduler resumes at position {now['last_epoch']} (LR {now['lr']:.3g}); it was saved at {saved['last_epoch']} "
                f"(LR {saved['lr']:.3g}): warmup or decay restarts (scheduler.pt missing or not loaded).",
                evidence={"saved": saved, "now": now},
            )

    def _check_reference(self, ctx: Any, trainer: Any, state: dict[str, Any]) -> None:
        saved = state.get("reference")
        if not saved or can_recompute(trainer) is not None:
            return
        self._reference_pending = {}
        self._reference = {k: torch.tensor(v) for k, v in saved["batch"].items()}
        now = self._reference_loss(trainer)
        tolerance = 1e-2 if _half(trainer) else 1e-4
        if now is not None and abs(now - saved["loss"]) > tolerance * max(1.0, abs(saved["loss"])):
            self.report(
                RESUME_LOSS_JUMP.code,
                f"the reference batch's loss is {now:.5f} after the resume and was {saved['loss']:.5f} at the save: the restored "
                "model does not compute what the saved one did.",
                evidence={"reference_loss_saved": saved["loss"], "reference_loss_now": now, "source": "reference batch"},
            )

    def _check_after_resume(self, ctx: Any, batch: Any, step: int, micro: int) -> None:
        if self._pending_rng and step == (self._resume_step or 0) + 1 and micro == 0:
            self._pending_rng = False
            saved, now = (self._saved or {}).get("rng", {}), rng_fingerprints()
            streams = [k for k, v in saved.items() if now.get(k) != v]
            if streams:
                self.report(
                    RESUME_RNG_NOT_RESTORED.code,
                    f"at the first step after the resume the random streams {', '.join(streams)} are not those saved at step "
                    f"{self._resume_step} (rng_state*.pth missing or not loaded): dropout masks and sampling differ from the interrupted run.",
                    evidence={"streams": streams},
                )
        if self._position_reported or not hasattr(batch, "get") or not torch.is_tensor(batch.get("input_ids")):
            return
        if getattr(ctx, "data_edit", None):  # a rollback left rows out: the batches after the resume differ on purpose
            self._position_reported = True
            return
        want = self._expected_samples(ctx).get(step)
        if want is None:
            return  # the interrupted run did not get this far: nothing to compare with
        got = hex64_all(batch_row_hashes(batch, masked_lm=ctx.masked_lm).tolist())
        # a step's samples are compared with the interrupted run's samples of that step over all its ranks, whatever the
        # world size or the micro-batches of either run: a resume on 1 process x 16 of a run on 2 x 8 trains, at each step,
        # the 16 samples both ranks trained there (its summed gradient is the same). Here, as the micro-batches arrive
        # (before the step's update), each rank's samples must be among them, no more often than the interrupted run had
        # them; that all ranks' samples together are that set is checked when they meet in the step's exchange
        # (``_check_step_set``)
        wanted = self._wanted.setdefault(step, Counter(want))
        seen = self._seen_in_step.setdefault(step, Counter())
        offset = sum(seen.values())
        first = None
        for i, sample in enumerate(got):
            seen[sample] += 1
            if first is None and seen[sample] > wanted.get(sample, 0):
                first = i
        if first is None:
            return
        self._position_reported = True
        sample = got[first]
        where = self._trained_at.get(sample)
        if wanted.get(sample, 0):
            what = f"its sample {first} is one the interrupted run trained at step {step} {wanted[sample]} time(s) only, and it comes again"
        elif where is not None:
            what = f"its sample {first} is one the interrupted run trained at step {where}"
        else:
            what = f"its sample {first} is none the interrupted run trained after the checkpoint"
        world = self._interrupted_world
        over = f" over its {world} ranks" if world and world > 1 else ""
        cause, cause_evidence = self._world_size_cause(ctx)
        self.report(
            RESUME_DATA_POSITION.code,
            f"micro-batch {micro} of step {step}, the first after resuming from step {self._resume_step}, holds samples the "
            f"interrupted run did not train at that step (this run's samples {offset}-{offset + len(got) - 1} of the step on "
            f"rank {ctx.rank} must be among the {len(want)} samples it trained there{over}): {what}. The data loader did not "
            "resume at the saved position." + cause,
            step=step,
            evidence={"sample_hashes": got[:16], "interrupted_run_sample_hashes": want[:16], "first_different": first,
                      "interrupted_run_step_of_first_different": where, "resume_step": self._resume_step,
                      "interrupted_run_samples_at_step": len(want), "interrupted_run_world_size": world, **cause_evidence},
        )

    def _check_exchanged_step(self, ctx: Any, step: int) -> None:
        """Rank 0 of several: the step's samples of every rank, from data_hash's slot of the step's exchange (no collective
        of its own), compared as one set; not judged when a rank's samples did not all arrive (RANK_DATA_OVERLAP and, at
        the run end, DATA_SKIPPED or DATA_SKIPPED_UNCHECKED say the rest)."""
        gathered = ctx.shared(DATA_HASH_SLOT, owner=DATA_HASH)
        if gathered is None or any(g is None for g in gathered) or ctx.shared_cut(DATA_HASH_SLOT, owner=DATA_HASH):
            return
        self._check_step_set(ctx, step, [Counter(hex64_all(g or [])) for g in gathered])

    def _check_step_set(self, ctx: Any, step: int, per_rank: list[Counter[str]]) -> None:
        """RESUME_DATA_POSITION when the step's samples of all ranks together are not the set the interrupted run trained
        at that step: some trained by no rank, or some on several ranks more often than the interrupted run had them.

        A rank whose own samples are not among the set reported at its micro-batch already (``_check_after_resume``)."""
        if self._position_reported or getattr(ctx, "data_edit", None) or step not in self._seen_in_step:
            return
        want = self._expected_samples(ctx).get(step)
        if want is None:
            return
        wanted = self._wanted.setdefault(step, Counter(want))
        if any(any(n > wanted.get(h, 0) for h, n in samples.items()) for samples in per_rank):
            return  # that rank's own check said it, at its micro-batch
        together: Counter[str] = sum(per_rank, Counter())
        # a sample the interrupted run had twice at the step (the distributed sampler's padding of an epoch's last round,
        # which a resume on fewer processes does not repeat) counts as trained once it came once
        missing, extra = Counter({h: n for h, n in wanted.items() if not together.get(h)}), together - wanted
        if not missing and not extra:
            return
        self._position_reported = True
        world = self._interrupted_world
        over = f" over its {world} ranks" if world and world > 1 else ""
        parts = []
        if missing:
            parts.append(f"{sum(missing.values())} of them no rank trained")
        if extra:
            parts.append(f"{sum(extra.values())} came on more than one rank, more often than the interrupted run had them")
        when = ("training stops before the next update (this step's was applied: the ranks' samples meet only in the "
                "step's exchange)" if ctx.world_size > 1 else "training stops before this step's update")
        cause, cause_evidence = self._world_size_cause(ctx)
        self.report(
            RESUME_DATA_POSITION.code,
            f"step {step}, {step - (self._resume_step or 0)} step(s) after resuming from step {self._resume_step}, trained "
            f"{sum(together.values())} samples on {_processes(ctx.world_size)} where the interrupted run trained {len(want)}"
            f"{over}; compared as one set, {' and '.join(parts)}. The data loader did not resume at the saved position; "
            f"{when}." + cause,
            step=step,
            evidence={"step_samples": sum(together.values()), "interrupted_run_samples_at_step": len(want),
                      "missing": sum(missing.values()), "extra": sum(extra.values()), "missing_hashes": list(missing)[:16],
                      "extra_hashes": list(extra)[:16], "resume_step": self._resume_step, "compared": "one set over all ranks",
                      "interrupted_run_world_size": world, **cause_evidence},
        )

    def _world_size_cause(self, ctx: Any) -> tuple[str, dict[str, Any]]:
        """The world-size change as the cause of a wrong data position (in words and evidence), or nothing when unchanged."""
        saved = self._saved or {}
        saved_world = saved.get("world_size") if isinstance(saved.get("world_size"), int) else self._interrupted_world
        if saved_world is None or saved_world == ctx.world_size:
            return "", {}
        saved_batch = _batch_geometry(saved.get("config") or {}, saved_world)
        batch = _batch_geometry({k: _plain(getattr(ctx.trainer.args, k, None)) for k in BATCH_KEYS}, ctx.world_size)
        evidence: dict[str, Any] = {"cause": "world_size_changed", "saved_world_size": saved_world, "world_size": ctx.world_size}
        if saved_batch is None or batch is None:
            return (f" The cause is the world-size change ({_processes(saved_world)} then, {ctx.world_size} now): a step holds "
                    f"another number of samples. Fix: resume with {_processes(saved_world)}, or keep the global batch (per-device "
                    "batch x gradient accumulation x processes)."), evidence
        evidence.update({"saved_global_batch": saved_batch[-1], "global_batch": batch[-1]})
        if saved_batch[-1] == batch[-1]:
            return (f" The world size changed ({_geometry_text(saved_batch)} then, {_geometry_text(batch)} now) with the global "
                    "batch kept, yet the samples differ: the loader or its sampler splits the data by process in a way of its "
                    f"own. Fix: resume with {_processes(saved_world)}."), evidence
        resume = self._resume_step or 0
        advice = ""
        if saved_batch[-1] % (ctx.world_size * batch[1]) == 0:  # the per-device batch that keeps the global batch here
            advice = (f", or keep the global batch of {saved_batch[-1]} on {_processes(ctx.world_size)}: "
                      f"--per_device_train_batch_size {saved_batch[-1] // (ctx.world_size * batch[1])} with "
                      f"--gradient_accumulation_steps {batch[1]}")
        return (f" The cause is the world-size change: {_geometry_text(saved_batch)} then, {_geometry_text(batch)} now. The "
                f"Trainer's data skip counts steps, not samples: the {resume} steps before the checkpoint are {resume * batch[-1]} "
                f"samples now and were {resume * saved_batch[-1]}, so every step from here trains other samples. Fix: resume "
                f"with {_processes(saved_world)}{advice}."), evidence

    def _interrupted_losses(self, ctx: Any) -> dict[int, float]:
        """The losses the interrupted run logged after the checkpoint (read once, before this run logs the same steps)."""
        if self._earlier_losses is None:
            resume = self._resume_step or 0
            logged = _read_logged_losses(ctx.run_dir / "metrics.jsonl")
            self._earlier_losses = {s: v for s, v in logged.items() if s > resume}
        return self._earlier_losses

    def _expected_samples(self, ctx: Any) -> dict[int, list[str]]:
        """step -> the sample hashes every rank of the interrupted attempt trained at that step after the checkpoint (from
        data_hash's ledgers, all ranks); also fills ``_trained_at`` for the evidence and the interrupted run's world size."""
        if self._expected is None:
            last = (self._resume_step or 0) + self.options.first_steps
            found = continuation(ctx.run_dir, self._resume_step or 0)
            source = self._source_run_dir
            if not found.records and source is not None and source.resolve() != ctx.run_dir.resolve() and not source.is_symlink():
                found = continuation(source, self._resume_step or 0, running_here=False)
            self._interrupted_world = found.world_size
            ranks_at: dict[int, set[int]] = {}
            for record in found.records:
                ranks_at.setdefault(record["step"], set()).add(record["rank"])
                for sample in record.get("sample_hashes") or []:
                    self._trained_at.setdefault(str(sample), record["step"])
            ranks = set().union(*ranks_at.values()) if ranks_at else set()
            # a step that only some ranks wrote is the kill's (the others died before their line): its set is not whole
            self._expected = {step: samples for step, samples in found.steps().items() if step <= last and ranks_at[step] == ranks}
        return self._expected

    def _check_loss_band(self, ctx: Any, step: int, loss: float) -> None:
        window = (self._saved or {}).get("loss_window") or []
        if len(window) < 3 or not math.isfinite(loss):
            return
        j = judge(loss, window, 3, len(window))
        assert j is not None
        median, sd = j.median, j.sd
        o = self.options
        earlier = self._interrupted_losses(ctx).get(step)
        if earlier is not None and loss - earlier <= o.loss_band_rise * abs(earlier):
            return  # the interrupted run had this loss at this step too (a hard batch in the data, not the resume)
        if loss - median > max(o.loss_band_rise * abs(median), o.loss_band_z * sd):
            self._band_checked = o.first_steps  # once
            self.report(
                RESUME_LOSS_JUMP.code,
                f"the loss at step {step}, {step - (self._resume_step or 0)} step(s) after the resume, is {loss:.4f}: above the "
                f"band of the {len(window)} steps before the save (median {median:.4f}); the curve does not continue.",
                step=step,
                evidence={"loss": loss, "saved_window_median": median, "robust_sd": sd, "source": "first steps"},
            )


BATCH_KEYS = ("per_device_train_batch_size", "gradient_accumulation_steps")
# the step exchange's slot in which data_hash (a required plugin) shares every rank's sample hashes of the step, read here
# by name: the one-set comparison needs no collective of its own
DATA_HASH, DATA_HASH_SLOT = "data_hash", "hashes"


def _batch_geometry(config: dict[str, Any], world_size: Any) -> tuple[int, int, int, int] | None:
    """(per-device batch, accumulation, processes, global batch) from training arguments, or None when one is not known."""
    per_device, accumulation = config.get(BATCH_KEYS[0]), config.get(BATCH_KEYS[1])
    if not all(isinstance(v, int) and not isinstance(v, bool) and v > 0 for v in (per_device, accumulation, world_size)):
        return None
    return per_device, accumulation, world_size, per_device * accumulation * world_size


def _geometry_text(geometry: tuple[int, ...]) -> str:
    per_device, accumulation, world, total = geometry
    return f"{_processes(world)} x {per_device} per device x {accumulation} accumulation = global batch {total}"


def _processes(count: Any) -> str:
    return f"{count} process" if count == 1 else f"{count} processes"


def _state_of_rank_0(checkpoint_dir: Path, rank: int) -> dict[str, Any] | None:
    """Rank 0's resume_check state for a rank the saving run did not have (a resume on more processes), else None.

    Its weights, optimizer state (when not partitioned), scheduler, training
    arguments and reference batch are those of every data-parallel replica.
    """
    if rank == 0:
        return None
    state = read_state_file(checkpoint_dir, 0)[0].get("resume_check")
    world = state.get("world_size") if isinstance(state, dict) else None
    return state if isinstance(world, int) and world <= rank else None


def _read_logged_losses(path: Any) -> dict[int, float]:
    """step -> loss logged in ``metrics.jsonl`` so far (by ``metrics_log`` on rank 0), the latest line per step.

    A non-finite loss is written as the string "nan"/"inf" (strict JSON): read back as the float it stands for.
    """
    out: dict[int, float] = {}
    for record in read_jsonl(Path(path), require_step=True):  # a torn or damaged line costs that line
        loss = as_float(record.get("loss"))
        if loss is not None:
            out[record["step"]] = loss
    return out


def _plain(value: Any) -> Any:
    """A JSON-comparable form of a training argument (enums by value)."""
    value = getattr(value, "value", value)
    return value if isinstance(value, (int, float, str, bool, type(None))) else str(value)
