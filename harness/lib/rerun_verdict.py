"""The rerun verdict's arithmetic: the calibrated tolerance and whether a recomputation reproduced a step.

Pure functions on host floats (no torch), so that they are tested in
milliseconds. A value "matches" its original when both are non-finite, or
both are finite and their relative difference is within the tolerance; the
tolerance is ``max(floor, factor x measured)``, where ``measured`` is the
relative difference a clean step's rerun showed at the start of the run
(the run's own nondeterminism: atomics, kernel choice, reduction order).
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from enum import Enum


class Outcome(str, Enum):
    """What a rank's local rerun of a flagged step says."""

    REPRODUCED = "reproduced"  # the same numbers again: the data or the model state
    TRANSIENT = "transient"  # different numbers: the original was not what these inputs give
    CLEAN_HERE = "clean_here"  # several ranks: this rank's part was clean and stays clean (the fault came from elsewhere)


OUTCOME_CODES = {Outcome.REPRODUCED: 2, Outcome.TRANSIENT: 3, Outcome.CLEAN_HERE: 1}  # as shared over the step exchange
OUTCOME_OF_CODE = {v: k for k, v in OUTCOME_CODES.items()}


@dataclass(frozen=True)
class Tolerance:
    """The relative tolerance of a comparison: ``max(floor, factor x measured)``."""

    floor: float
    factor: float
    measured: float | None = None  # None until the calibration ran

    @property
    def value(self) -> float:
        measured = self.measured if self.measured is not None and math.isfinite(self.measured) else 0.0
        return max(self.floor, self.factor * measured)

    def calibrated(self, measured: float) -> "Tolerance":
        return Tolerance(self.floor, self.factor, measured)


def relative_difference(original: float, rerun: float) -> float:
    """|a - b| / max(|a|, |b|); 0 for two equal values (both zero included), inf when only one is finite."""
    if not math.isfinite(original) or not math.isfinite(rerun):
        return 0.0 if not math.isfinite(original) and not math.isfinite(rerun) else math.inf
    scale = max(abs(original), abs(rerun))
    return abs(original - rerun) / scale if scale > 0 else 0.0


def matches(original: float, rerun: float, tolerance: float) -> bool:
    return relative_difference(original, rerun) <= tolerance


def measured_nondeterminism(original_losses: list[float], rerun_losses: list[float], original_norm: float | None,
                            rerun_norm: float | None) -> float | None:
    """The largest relative difference between a clean step and its rerun (None if nothing finite to compare)."""
    pairs = list(zip(original_losses, rerun_losses))
    if original_norm is not None and rerun_norm is not None:
        pairs.append((original_norm, rerun_norm))
    diffs = [relative_difference(a, b) for a, b in pairs if math.isfinite(a) and math.isfinite(b)]
    return max(diffs) if diffs else None


@dataclass(frozen=True)
class Comparison:
    """A rerun against its original step: the outcome and the numbers behind it."""

    outcome: Outcome
    loss_differences: list[float]
    grad_difference: float | None
    reason: str


def compare(original_losses: list[float], rerun_losses: list[float], tolerance: float, *, original_norm: float | None,
            rerun_norm: float | None, rerun_grads_finite: bool | None, norms_comparable: bool) -> Comparison:
    """Judge one rank's rerun.

    ``norms_comparable``: one process, where the Trainer's grad norm is this
    rank's own. With several ranks it is the all-reduced norm: only its
    finiteness says something, and a rank whose losses and gradients come
    back finite while the reduced norm was not is ``CLEAN_HERE``.
    """
    diffs = [relative_difference(a, b) for a, b in zip(original_losses, rerun_losses)]
    if len(original_losses) != len(rerun_losses):
        return Comparison(Outcome.TRANSIENT, diffs, None, f"{len(rerun_losses)} micro-batches recomputed of {len(original_losses)}")
    bad = [i for i, d in enumerate(diffs) if d > tolerance]
    if bad:
        i = bad[0]
        return Comparison(Outcome.TRANSIENT, diffs, None, f"micro-batch {i}: loss {original_losses[i]} then {rerun_losses[i]}")
    if norms_comparable and original_norm is not None and rerun_norm is not None:
        grad_diff = relative_difference(original_norm, rerun_norm)
        if grad_diff > tolerance:
            return Comparison(Outcome.TRANSIENT, diffs, grad_diff, f"grad norm {original_norm} then {rerun_norm}")
        return Comparison(Outcome.REPRODUCED, diffs, grad_diff, "every loss and the grad norm again")
    if original_norm is not None and not math.isfinite(original_norm) and rerun_grads_finite is not None:
        if rerun_grads_finite:
            return Comparison(Outcome.CLEAN_HERE, diffs, None, "the reduced grad norm was non-finite; this rank's own gradients are finite")
        return Comparison(Outcome.REPRODUCED, diffs, None, "every loss again, and this rank's own gradients are non-finite again")
    return Comparison(Outcome.REPRODUCED, diffs, None, "every loss again (the grad norm is all-reduced: not compared)")


def neighbour_agrees(original_losses: list[float], neighbour_losses: list[float], tolerance: float,
                     source_grads_finite: bool | None, neighbour_grads_finite: bool | None) -> bool:
    """Whether the neighbour rank, recomputing the suspect rank's micro-batches, got what the suspect rank got."""
    if len(original_losses) != len(neighbour_losses):
        return False
    if any(not matches(a, b, tolerance) for a, b in zip(original_losses, neighbour_losses)):
        return False
    return source_grads_finite is None or neighbour_grads_finite is None or source_grads_finite == neighbour_grads_finite
