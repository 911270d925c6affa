"""The background thread that proves checkpoints, one after the other, off the training step.

The training thread queues a :class:`Job` at each save (rank 0); the thread
waits until every rank's harness save marker is there (the other ranks'
``rng_state_<r>.pth`` may still be being written), then runs the checks of
:mod:`harness.lib.checkpoint_verify` and :mod:`harness.lib.checkpoint_loss`,
writes ``harness_proven`` when all passed, and leaves an :class:`Outcome`
for the training thread, which makes the findings and rotates (findings and
deletions happen there only). ``pending()`` and ``last_proven`` tell the
rotation what it must keep; both change under one lock.
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

from harness.lib.checkpoint_loss import Reference, matches, rebuilt_loss, tolerance
from harness.lib.checkpoint_verify import Layout, Problem, check_complete, read_weights, shape_problems
from harness.lib.checkpoints import STATE_DIR, TRAINER_STATE, marker_name
from harness.lib.proven import file_manifest, forget_proof, write_proven


@dataclass
class Job:
    """One checkpoint to prove, with what the training thread knew at its save."""

    output_dir: Path
    checkpoint: Path
    step: int
    layout: Layout
    reference: Reference | None = None
    no_loss_reason: str | None = None  # why no reference loss was taken (None with a reference, or when not asked)
    expected: dict[str, Any] | None = None  # the model's state-dict shapes (checkpoint_verify.expected_shapes)
    rtol: float | None = None
    rank_wait_s: float = 120.0
    wait_for_ranks: bool = True  # wait for every rank's harness save marker (written after all on_checkpoint_save hooks)
    save_cost_s: float = 0.0


@dataclass
class Outcome:
    """What the thread found about one checkpoint."""

    job: Job
    problems: list[Problem] = field(default_factory=list)
    unverified: list[str] = field(default_factory=list)
    checks: list[str] = field(default_factory=list)
    loss_from_disk: float | None = None
    seconds: float = 0.0
    proven: bool = False
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
    """Every check on ``job``'s folder, in order; the marker written when all passed."""
    started = time.perf_counter()
    out = Outcome(job)
    late = wait_for_ranks(job.checkpoint, job.layout.world_size, job.rank_wait_s) if job.wait_for_ranks else []
    if late:
        out.loud = True
        out.unverified.append(f"rank(s) {late} did not finish their part of the save within {job.rank_wait_s:g} s "
                              "(their files are not visible here: another node's disk, or still writing)")
    else:
        out.problems.extend(check_complete(job.checkpoint, job.step, job.layout))
        out.checks.append("complete")
        _check_weights(job, out)
    out.seconds = time.perf_counter() - started
    out.proven = not out.problems and not out.unverified
    if out.proven:
        record = {"step": job.step, "checks": out.checks, "loss_at_save": job.reference.loss if job.reference else None,
                  "loss_from_disk": out.loss_from_disk, "verify_seconds": round(out.seconds, 4),
                  "save_cost_seconds": round(job.save_cost_s, 4), "files": file_manifest(job.checkpoint)}
        if _rotated_away(job.checkpoint):  # the Trainer's own rotation deleted it while it was checked: nothing to mark
            out.proven = False
            return out
        write_proven(job.output_dir, job.checkpoint, record)
        if _rotated_away(job.checkpoint):  # deleted as the marker went in: take it out, so the folder's deletion completes
            forget_proof(job.output_dir, job.checkpoint)
            try:
                os.rmdir(job.checkpoint)  # only if empty: what the rotation's rmtree could not remove for the marker
            except OSError:
                pass
            out.proven = False
    return out


def _rotated_away(checkpoint: Path) -> bool:
    """The Trainer's rotation (``save_total_limit`` without ``keep_proven``) deletes a checkpoint while it may be checked."""
    return not (checkpoint / TRAINER_STATE).is_file()


def _check_weights(job: Job, out: Outcome) -> None:
    weights = read_weights(job.checkpoint, keep=job.reference is not None)
    out.problems.extend(weights.problems)
    if weights.unverified:
        out.unverified.append(weights.unverified)
        return
    if weights.problems:
        return
    out.checks.append("weights_finite")
    if job.expected is not None:
        problems, not_comparable = shape_problems(weights, job.expected)
        out.problems.extend(problems)
        if not_comparable:
            out.unverified.append(not_comparable)
            return
        if problems:
            return
        out.checks.append("shapes")
    if job.reference is None:
        if job.no_loss_reason:
            out.unverified.append(f"the reference loss: {job.no_loss_reason}")
        return
    _check_loss(job, job.reference, weights.tensors, out)


def _check_loss(job: Job, reference: Reference, tensors: dict[str, Any], out: Outcome) -> None:
    try:
        loss, missing = rebuilt_loss(reference, tensors)
    except Exception as exc:  # noqa: BLE001 - a model that will not rebuild from its config: not checked, not corrupt
        out.unverified.append(f"the reference loss: the model did not rebuild from its config ({type(exc).__name__}: {str(exc)[:160]})")
        return
    out.loss_from_disk = loss
    name = "model.safetensors" if (job.checkpoint / "model.safetensors").is_file() else "weights"
    if missing:
        out.problems.append(Problem(name, f"leaves {len(missing)} tensor(s) of the model unset, e.g. {', '.join(missing[:3])}"))
    elif loss is None:
        out.unverified.append("the reference loss: the rebuilt model returned no loss")
    elif not matches(reference.loss, loss, tolerance(reference, job.rtol)):
        out.problems.append(Problem(name, f"gives the reference batch a loss of {loss:.6g}; the model in memory gave {reference.loss:.6g} "
                                          f"at the save (relative tolerance {tolerance(reference, job.rtol):g}): not the weights that were training"))
    else:
        out.checks.append("reference_loss")


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
