"""Where a non-finite step started, across ranks: from every rank's NONFINITE_LOSS / NONFINITE_GRAD of that step.

With data parallelism the gradient all-reduce hands one rank's NaN to every
rank, so each rank's own finding sees only its part: a rank whose losses were
finite cannot tell, when it reports, whose NaN reached it. The run's findings,
all ranks together, can: a rank whose loss was non-finite at the step made it;
else a rank whose own backward (no all-reduce) reproduces the NaN; else no
rank's computation explains it (every rank that reran its backward got finite
gradients: a transient fault, or the all-reduce itself).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Iterable

LOSS_CODE, GRAD_CODE = "NONFINITE_LOSS", "NONFINITE_GRAD"


@dataclass
class NonfiniteStep:
    """One step's non-finite findings over every rank, and the rank(s) where the NaN started."""

    step: int
    loss_ranks: list[int] = field(default_factory=list)  # their own loss was non-finite
    grad_ranks: list[int] = field(default_factory=list)  # losses finite, gradients not
    reproduced_ranks: list[int] = field(default_factory=list)  # their own backward, rerun, gave non-finite gradients again
    clean_rerun_ranks: list[int] = field(default_factory=list)  # their own backward, rerun, gave finite gradients
    nonfinite_weights: dict[int, list[str]] = field(default_factory=dict)  # rank -> its weights found NaN/Inf by the locate pass
    several_ranks: bool = False  # a finding of this step came from a run of several ranks

    @property
    def started_on(self) -> list[int]:
        """The ranks whose own computation made the NaN (empty: not determined from the findings)."""
        return self.loss_ranks or self.reproduced_ranks

    def origin(self) -> str:
        """The 'started on' cell of the report: a rank and why, or why none."""
        if self.loss_ranks:
            weights = [f"rank {r}'s {', '.join(names[:3])}" for r, names in sorted(self.nonfinite_weights.items()) if r in self.loss_ranks]
            state = (f"; weights already NaN/Inf ({'; '.join(weights)}): the model state, not the batch or the device"
                     if weights else "")
            return f"{_ranks(self.loss_ranks)}: its own loss{state} (every other rank's NaN came through the gradient all-reduce)"
        if self.reproduced_ranks:
            return f"{_ranks(self.reproduced_ranks)}: its own backward reproduces the NaN"
        if self.grad_ranks and self.clean_rerun_ranks == self.grad_ranks:
            return "no rank: every rank's own backward, rerun, is finite (a transient fault, or the all-reduce itself)"
        return "not determined: no rank's loss was non-finite, and not every rank could rerun its own backward"


def nonfinite_steps(findings: Iterable[Any]) -> list[NonfiniteStep]:
    """The steps with a non-finite loss or gradient on some rank, in step order (findings of any rank, as read back)."""
    steps: dict[int, NonfiniteStep] = {}
    for finding in findings:
        code, step, rank = getattr(finding, "code", None), getattr(finding, "step", None), getattr(finding, "rank", None)
        if code not in (LOSS_CODE, GRAD_CODE) or not isinstance(step, int) or not isinstance(rank, int):
            continue
        entry = steps.setdefault(step, NonfiniteStep(step))
        evidence = getattr(finding, "evidence", None)
        evidence = evidence if isinstance(evidence, dict) else {}
        if rank > 0 or (_as_int(evidence.get("world_size")) or 1) > 1:
            entry.several_ranks = True
        if code == LOSS_CODE:
            _add(entry.loss_ranks, rank)
            weights = evidence.get("nonfinite_params_of_module")
            names = [w.get("param") for w in weights if isinstance(w, dict)] if isinstance(weights, list) else []
            if any(isinstance(n, str) for n in names):
                entry.nonfinite_weights[rank] = [n for n in names if isinstance(n, str)]
            continue
        _add(entry.grad_ranks, rank)
        reproduced = evidence.get("reproduced_in_backward")
        if reproduced is True:
            _add(entry.reproduced_ranks, rank)
        elif reproduced is False:
            _add(entry.clean_rerun_ranks, rank)
    return [steps[s] for s in sorted(steps)]


def _as_int(value: Any) -> int | None:
    """An int field of the evidence (a bool is not one), else None."""
    return value if isinstance(value, int) and not isinstance(value, bool) else None


def _add(ranks: list[int], rank: int) -> None:
    if rank not in ranks:
        ranks.append(rank)
        ranks.sort()


def listed(ranks: list[int]) -> str:
    """A report cell: ``0, 1``, or ``-`` for none."""
    return ", ".join(str(r) for r in ranks) or "-"


def _ranks(ranks: list[int]) -> str:
    return f"rank {ranks[0]}" if len(ranks) == 1 else "ranks " + ", ".join(str(r) for r in ranks)
