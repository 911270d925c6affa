"""The background thread that proves checkpoints, one after the other, off the training step.

The training thread queues a :class:`Job` at each save (rank 0); the thread
waits until every rank's harness save marker is there (the other ranks'
``rng_state_<r>.pth`` may still be being written), then runs the checks of
:mod:`harness.lib.checkpoint_verify` and :mod:`harness.lib.checkpoint_loss`,
writes ``harness_proven`` when all passed, and leaves an :class:`Outcome`
for the training thread, which makes the findings and rotates (findings and
deletions happen there only). ``pending()`` and ``last_proven`` tell the
rotation what it must keep; both change under one lock.

The weights are judged as the part of the model that wrote them
(:mod:`harness.lib.checkpoint_target`): a transformers model's file in the
layout it fits (its names in memory, or transformers' saved format:
:mod:`harness.lib.checkpoint_layout`) and by the reference value of a copy
rebuilt through transformers' loading; a PEFT adapter's file by the names
PEFT saves and by its tensors, equal to the adapter's at the save. A
checkpoint that passes every check gets ``harness_proven``; one whose proof
cannot be made (no batch the model accepts, a model above ``max_model_mb``,
a model whose saved format cannot be built, so that names fitting no layout
may be a format not known here) but which is complete with readable, finite
weights gets ``harness_checked`` with the reason, which
``harness resume-point`` falls back to when nothing is proven. Names that fit
neither the model's own nor its saved format, both known, are another
model's weights: corrupt, never marked.
"""
from __future__ import annotations

import collections
import os
import queue
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from harness.lib.checkpoint_layout import NameLayout, layout_problems, memory_layout, saved_layout
from harness.lib.checkpoint_loss import Reference, matches, rebuilt_loss, tolerance
from harness.lib.checkpoint_target import Target
from harness.lib.checkpoint_verify import Layout, Problem, Weights, check_complete, read_weights
from harness.lib.checkpoints import STATE_DIR, TRAINER_STATE, marker_name
from harness.lib.proven import file_manifest, forget_proof, write_checked, write_proven


@dataclass
class Job:
    """One checkpoint to prove, with what the training thread knew at its save."""

    output_dir: Path
    checkpoint: Path
    step: int
    layout: Layout
    reference: Reference | None = None
    no_loss_reason: str | None = None  # why no reference loss was taken (None with a reference, or when not asked)
    expected: dict[str, Any] | None = None  # the target's state-dict shapes (checkpoint_verify.expected_shapes)
    target: Target | None = None  # what the weights file holds (None: the model of ``reference``, when there is one)
    adapter: dict[str, Any] | None = None  # a PEFT adapter's tensors at the save (CPU copies), under the names PEFT saves
    raw_resume: bool = False  # the trainer resumes the weights by their names as saved (transformers.Trainer's own loader)
    rtol: float | None = None
    rank_wait_s: float = 120.0
    wait_for_ranks: bool = True  # wait for every rank's harness save marker (written after all on_checkpoint_save hooks)
    not_saved: str | None = None  # why this rank's harness state of the save was not written (no marker will come)
    save_cost_s: float = 0.0


@dataclass
class Outcome:
    """What the thread found about one checkpoint."""

    job: Job
    problems: list[Problem] = field(default_factory=list)
    unverified: list[str] = field(default_factory=list)
    checks: list[str] = field(default_factory=list)
    loss_from_disk: float | None = None
    resume_warning: str | None = None  # what the Trainer's own resume of this (good) checkpoint would leave unrestored
    seconds: float = 0.0
    proven: bool = False
    checked: bool = False  # not proven, but complete with readable, finite weights: harness_checked was written
    loud: bool = False  # unverified for a reason of this save (a rank late, the check failed), not of the run's format


def wait_for_ranks(checkpoint: Path, world_size: int, timeout: float) -> list[int]:
    """Wait until every rank's harness save marker exists; the ranks still missing after ``timeout``."""
    deadline = time.monotonic() + timeout
    while True:
        missing = [r for r in range(world_size) if not (checkpoint / STATE_DIR / marker_name(r)).is_file()]
        if not missing or time.monotonic() >= deadline:
            return missing
        time.sleep(0.05)


def prove(job: Job) -> Outcome:
    """Every check on ``job``'s folder, in order; ``harness_proven`` written when all passed, ``harness_checked`` when only the
    proof could not be made."""
    started = time.perf_counter()
    out = Outcome(job)
    linked = job.wait_for_ranks and (job.checkpoint / STATE_DIR).is_symlink()  # the saves refused to write through it: no marker will come
    waits = job.wait_for_ranks and not linked and job.not_saved is None
    late = wait_for_ranks(job.checkpoint, job.layout.world_size, job.rank_wait_s) if waits else []
    if linked:
        out.loud = True
        out.unverified.append(f"its {STATE_DIR} folder is a link; the harness writes nothing through a link, so no rank's "
                              "part of the save is marked complete")
    elif job.not_saved is not None:  # this rank knows its own marker will never come
        out.loud = True
        out.unverified.append(f"{job.not_saved}, so its part of the save is not marked complete")
    elif late:
        out.loud = True
        out.unverified.append(f"rank(s) {late} did not finish their part of the save within {job.rank_wait_s:g} s "
                              "(their files are not visible here: another node's disk, or still writing)")
    else:
        out.problems.extend(check_complete(job.checkpoint, job.step, job.layout))
        out.checks.append("complete")
        _check_weights(job, out)
    out.seconds = time.perf_counter() - started
    out.proven = not out.problems and not out.unverified
    # complete, readable and finite, only the proof itself could not be made (not a reason of this save: a rank late,
    # the check failing): what a resume can still use when nothing is proven
    out.checked = not out.proven and not out.problems and not out.loud and {"complete", "weights_finite"} <= set(out.checks)
    if out.proven or out.checked:
        record = {"step": job.step, "checks": out.checks, "loss_at_save": job.reference.loss if job.reference else None,
                  "loss_from_disk": out.loss_from_disk, "verify_seconds": round(out.seconds, 4),
                  "save_cost_seconds": round(job.save_cost_s, 4), "files": file_manifest(job.checkpoint)}
        if out.checked:
            record["not_proven"] = "; ".join(out.unverified)
        if out.resume_warning:
            record["resume_warning"] = out.resume_warning
        if not _mark(job, record, write_proven if out.proven else write_checked):
            out.proven = out.checked = False
    return out


def _mark(job: Job, record: dict[str, Any], write: Any) -> bool:
    """Write the marker unless the checkpoint was rotated away meanwhile; whether it stands."""
    if _rotated_away(job.checkpoint):  # the Trainer's own rotation deleted it while it was checked: nothing to mark
        return False
    write(job.output_dir, job.checkpoint, record)
    if _rotated_away(job.checkpoint):  # deleted as the marker went in: take it out, so the folder's deletion completes
        forget_proof(job.output_dir, job.checkpoint)
        try:
            os.rmdir(job.checkpoint)  # only if empty: what the rotation's rmtree could not remove for the marker
        except OSError:
            pass
        return False
    return True


def _rotated_away(checkpoint: Path) -> bool:
    """The Trainer's rotation (``save_total_limit`` without ``keep_proven``) deletes a checkpoint while it may be checked."""
    return not (checkpoint / TRAINER_STATE).is_file()


def _target(job: Job) -> Target | None:
    if job.target is not None:
        return job.target
    if job.reference is not None:  # a job made without a target: the reference's model is the one saved
        return Target("model", getattr(job.reference.model_class, "__name__", "the model"), "", job.reference.model_class,
                      job.reference.config)
    return None


def _unprefixed(weights: Weights, prefix: str) -> tuple[dict[str, tuple[int, ...]], dict[str, Any]]:
    """The file's shapes and tensors with ``prefix.`` taken off every name, when every name has it (a wrapper's whole
    state dict saved, not the transformers model inside it); else as they are."""
    if not prefix or not weights.shapes or not all(name.startswith(prefix + ".") for name in weights.shapes):
        return weights.shapes, weights.tensors
    cut = len(prefix) + 1
    return {k[cut:]: v for k, v in weights.shapes.items()}, {k[cut:]: v for k, v in weights.tensors.items()}


def _layouts(job: Job, target: Target | None) -> tuple[list[NameLayout], bool]:
    """The layouts the weights file may be in, and whether they are all it can be in (a PEFT adapter's names; a
    transformers model's own names and its saved format, built from its config): a file fitting none of them then
    holds another model's weights."""
    assert job.expected is not None
    if target is not None and target.kind == "adapter":
        return [NameLayout("the adapter's names as PEFT saves them", dict(job.expected))], True
    layouts = [memory_layout(job.expected)]
    if target is not None and target.model_class is not None:
        saved = saved_layout(target.model_class, target.config)
        if saved is not None:
            return [*layouts, saved], True
    return layouts, False


def _check_weights(job: Job, out: Outcome) -> None:
    weights = read_weights(job.checkpoint, keep=job.reference is not None or job.adapter is not None)
    out.problems.extend(weights.problems)
    if weights.unverified:
        out.unverified.append(weights.unverified)
        return
    if weights.problems:
        return
    out.checks.append("weights_finite")
    target = _target(job)
    file = weights.files[0] if len(weights.files) == 1 else "weights"
    shapes, tensors = _unprefixed(weights, target.prefix if target is not None else "")
    if job.expected is not None:
        layouts, every_layout = _layouts(job, target)
        problems, not_comparable = layout_problems(shapes, layouts, file)
        out.problems.extend(problems)
        if not_comparable and every_layout:  # not a format unknown here: the weights of another model
            what = target.name if target is not None else "the model"
            out.problems.append(Problem(file, f"{not_comparable}: another model's weights, not those of {what}"))
            return
        if not_comparable:  # the saved format could not be built: possibly a format not known here (harness_checked)
            out.unverified.append(not_comparable)
            return
        if problems:
            return
        out.checks.append("shapes")
        if job.raw_resume and target is not None and target.kind == "model" and not target.prefix:
            out.resume_warning = _raw_resume_gaps(shapes, job.expected, job.checkpoint.name)
    if target is not None and target.kind == "adapter":
        _check_adapter(job, tensors, file, out)
        return
    if job.reference is None:
        if job.no_loss_reason:
            out.unverified.append(f"the reference loss: {job.no_loss_reason}")
        return
    _check_loss(job, job.reference, tensors, file, out)


def _raw_resume_gaps(shapes: dict[str, tuple[int, ...]], expected: dict[str, Any], name: str) -> str | None:
    """transformers' ``Trainer._load_from_checkpoint`` (5.x) loads a checkpoint with ``load_state_dict(strict=False)`` by
    the names as saved, without the conversion ``from_pretrained`` applies: in a file of the saved format it finds no
    fused MoE experts, and leaves them as the resumed script built them. What it would leave unrestored, said once."""
    from harness.lib.checkpoint_layout import missing_names
    from harness.lib.raw_resume import RAW_LOAD, fix

    gaps = missing_names(shapes, memory_layout(expected))
    if not gaps:
        return None
    return (f"the Trainer's own resume loads {name}'s tensors {RAW_LOAD}, and would leave {len(gaps)} of the model's tensors as "
            f"the resumed script builds them, e.g. {', '.join(gaps[:3])}: {fix(name)}; else the resume_check plugin stops the "
            "resume with RESUME_MODEL_MISMATCH")


def _check_adapter(job: Job, tensors: dict[str, Any], file: str, out: Outcome) -> None:
    """Every adapter tensor on disk equals the adapter's at the save (what ``load_adapter`` restores)."""
    import torch

    if job.adapter is None:
        if job.no_loss_reason:
            out.unverified.append(f"the adapter's values: {job.no_loss_reason}")
        return
    differ = []
    for name, at_save in job.adapter.items():
        on_disk = tensors.get(name)
        if on_disk is None or on_disk.shape != at_save.shape or not torch.equal(on_disk.to(at_save.dtype), at_save):
            differ.append(name)
    if differ:
        out.problems.append(Problem(file, f"{len(differ)} of the adapter's {len(job.adapter)} tensors differ from the adapter in memory "
                                          f"at the save, e.g. {', '.join(differ[:3])}: not the adapter that was training"))
    else:
        out.checks.append("adapter_weights")


def _check_loss(job: Job, reference: Reference, tensors: dict[str, Any], file: str, out: Outcome) -> None:
    try:
        loss, missing = rebuilt_loss(reference, tensors)
    except Exception as exc:  # noqa: BLE001 - a model that will not rebuild from its config: not checked, not corrupt
        out.unverified.append(f"the reference loss: the model did not rebuild from its config ({type(exc).__name__}: {str(exc)[:160]})")
        return
    out.loss_from_disk = loss
    allowed = tolerance(reference, job.rtol)
    if missing:
        out.problems.append(Problem(file, f"leaves {len(missing)} tensor(s) of the model unset, e.g. {', '.join(missing[:3])}"))
    elif loss is None:
        out.unverified.append(f"the reference loss: the rebuilt model returned no value of the kind taken at the save ({reference.kind})")
    elif not matches(reference.loss, loss, allowed):
        out.problems.append(Problem(file, f"gives the reference batch {reference.describe()} of {loss:.6g}; the model in memory gave "
                                          f"{reference.loss:.6g} at the save (relative tolerance {allowed:g}): not the weights that were training"))
    else:
        out.checks.append("reference_loss" if reference.kind == "loss" else "reference_output")


class ProofWorker:
    """A daemon thread proving queued checkpoints in order; outcomes wait in ``take()`` for the training thread."""

    def __init__(self) -> None:
        self._jobs: queue.Queue[Job | None] = queue.Queue()
        self._outcomes: collections.deque[Outcome] = collections.deque()
        self._lock = threading.Lock()
        self._pending: dict[int, Path] = {}
        self.last_proven: Path | None = None
        self.error: BaseException | None = None
        self._thread = threading.Thread(target=self._work, name="harness-checkpoint-proof", daemon=True)
        self._thread.start()

    def submit(self, job: Job) -> None:
        with self._lock:
            self._pending[job.step] = job.checkpoint
        self._jobs.put(job)

    def pending(self) -> list[Path]:
        with self._lock:
            return list(self._pending.values())

    def keep(self) -> list[Path]:
        """What rotation must not delete now: the last proven checkpoint and every one still being checked."""
        with self._lock:
            return [*self._pending.values(), *([self.last_proven] if self.last_proven else [])]

    def has_outcomes(self) -> bool:
        return bool(self._outcomes)

    def take(self) -> list[Outcome]:
        taken = []
        while self._outcomes:
            taken.append(self._outcomes.popleft())
        return taken

    def wait(self, timeout: float) -> bool:
        """Wait until nothing is pending (True) or ``timeout`` passed (False)."""
        deadline = time.monotonic() + timeout
        while self.pending() and self._thread.is_alive():
            if time.monotonic() >= deadline:
                return False
            time.sleep(0.02)
        return not self.pending()

    def close(self) -> None:
        self._jobs.put(None)

    def _work(self) -> None:
        while True:
            job = self._jobs.get()
            if job is None:
                return
            try:
                outcome = prove(job)
            except BaseException as exc:  # noqa: BLE001 - reported by the training thread; the next job still runs
                self.error = exc
                outcome = Outcome(job, loud=True, unverified=[f"the check itself failed ({type(exc).__name__}: {str(exc)[:200]})"])
            with self._lock:
                if outcome.proven and (self.last_proven is None or job.step >= (_step(self.last_proven) or -1)):
                    self.last_proven = job.checkpoint
                self._outcomes.append(outcome)
                self._pending.pop(job.step, None)


def _step(path: Path) -> int | None:
    from harness.lib.checkpoints import checkpoint_step

    return checkpoint_step(path)
