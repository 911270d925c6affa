"""The absolute anchor of a loss curve: a ceiling from the untrained level and the run's own first losses.

A running baseline judges each step against the steps before it, so a run
that is ruined from its first updates forms its baseline on the ruined level
and is called healthy. The anchor does not move with the run: its ceiling is
``1 + margin`` times the higher of the untrained level (ln V, ln(labels))
and the run's first loss (taken before any update, so never ruined), and at
most ``start_ratio`` times the run's start (the median of its healthy first
losses: a fine-tune that starts at 1.0 has lost what it knew at 3.0, far
under ln V). A loss over the ceiling for ``confirm_steps`` steps in a row, or
once at ``far_ratio`` times it, is a breach.

A step loss is a mean over its loss terms: thousands of tokens for a
language model, but only the rows of the batch for a classifier, a
contrastive or a regression loss, where one batch of four can score far
above ln(labels) on a healthy run. So for such a loss the value judged is
the mean of the last steps that together hold ``anchor_terms`` terms, and
its margin is at least three standard errors of that mean (``3 / sqrt(n)``
of the level: a cross-entropy's per-term spread is about its mean): 37% for
64 rows, wider while fewer are in. A token loss, whose step holds more terms
than that, is judged one step at a time with ``margin``. Pure host
arithmetic: a few operations per step.
"""
from __future__ import annotations

import math
import statistics
from collections import deque
from dataclasses import dataclass, field
from typing import Any

START_STEPS = 3  # the first losses the run's start is the median of (more when one step holds few terms)
MAX_WINDOW = 32  # steps a judged mean spans at most


@dataclass(frozen=True)
class Breach:
    """A loss over the anchor's ceiling (the numbers a finding needs)."""

    step: int
    loss: float  # the value judged: the step's loss, or the mean of the last ``averaged_steps`` steps
    ceiling: float
    steps_above: int  # steps in a row over the ceiling, this one included
    first_above: int  # the first step of those
    start: float | None
    first_loss: float | None
    untrained: float | None
    basis: str | None  # how the untrained level was found (ln(vocab=512)), None without one
    averaged_steps: int = 1

    def describe(self) -> str:
        """What the loss is above, in numbers: the untrained level and the run's start."""
        parts = []
        if self.untrained is not None and self.basis:
            parts.append(f"{self.loss / self.untrained:.2f}x {self.basis}={self.untrained:.3f}, what an untrained model scores")
        if self.start:
            parts.append(f"{self.loss / self.start:.2f}x the run's start {self.start:.4f} (its healthy first losses)")
        return ", and ".join(parts)

    def what(self) -> str:
        """The value's name in a message: ``loss at step 12``, or ``mean loss of the 8 steps to step 12``."""
        return f"loss at step {self.step}" if self.averaged_steps == 1 else f"mean loss of the {self.averaged_steps} steps to step {self.step}"

    def evidence(self) -> dict[str, Any]:
        return {"loss": self.loss, "ceiling": self.ceiling, "steps_above": self.steps_above, "first_step_above": self.first_above,
                "start": self.start, "first_loss": self.first_loss, "untrained_level": self.untrained, "untrained_basis": self.basis,
                "averaged_steps": self.averaged_steps}


@dataclass
class LossAnchor:
    """The run's start and ceiling; ``observe`` each finite step loss in order (see the module)."""

    untrained: float | None = None
    basis: str | None = None
    margin: float = 0.1
    start_ratio: float = 3.0
    confirm_steps: int = 2
    far_ratio: float = 1.5
    anchor_terms: int = 64
    terms: int | None = None  # loss terms per step (labelled tokens, or rows); None: unknown, judged one step at a time
    first: list[float] = field(default_factory=list)  # the run's first finite losses (up to start_steps), in order
    above_run: int = 0  # judged values in a row over the ceiling
    breached: bool = False  # a breach happened in this run (for the end-of-run recovery check)
    in_breach: bool = False  # the current run of steps over the ceiling was reported
    recent: deque[float] = field(default_factory=lambda: deque(maxlen=MAX_WINDOW))
    last: tuple[float, int] | None = None  # the last value judged and how many steps it averages
    _cached: tuple[tuple[Any, ...], float | None] | None = field(default=None, repr=False, compare=False)

    @property
    def window(self) -> int:
        """Steps whose mean is judged: enough to hold ``anchor_terms`` loss terms (1 for a token loss)."""
        if not self.terms or self.terms >= self.anchor_terms:
            return 1
        return min(MAX_WINDOW, math.ceil(self.anchor_terms / self.terms))

    @property
    def start_steps(self) -> int:
        return min(16, max(START_STEPS, self.window))

    def start(self) -> float | None:
        """The median of the first losses that were under the ceiling the first loss alone sets (the healthiest early
        steps: a step-2 blow-up is not the start)."""
        if not self.first:
            return None
        limit = self._ceiling_of(self.first[0], self.first[0], self.margin_for(self.window))
        healthy = [v for v in self.first if limit is None or v <= limit]
        return statistics.median(healthy) if healthy else self.first[0]

    def start_words(self) -> str:
        """The start in a message, with what it is: ``0.7169, the median of its first 3 losses``."""
        start = self.start()
        if start is None:
            return "not known"
        limit = self._ceiling_of(self.first[0], self.first[0], self.margin_for(self.window))
        healthy = sum(1 for v in self.first if limit is None or v <= limit) or 1
        return f"{start:.4f}, the median of its first {healthy} loss{'es' if healthy > 1 else ''}"

    def margin_for(self, steps: int) -> float:
        """The margin for a mean over ``steps`` steps: ``margin`` for a loss whose step holds ``anchor_terms`` terms or more;
        for fewer, at least three standard errors of the mean's terms (see the module)."""
        if not self.terms or self.terms >= self.anchor_terms:
            return self.margin
        return max(self.margin, 3.0 / math.sqrt(self.terms * steps))

    def _ceiling_of(self, first: float, start: float, margin: float) -> float | None:
        bounds = []
        if self.untrained is not None:
            bounds.append((1.0 + margin) * max(self.untrained, first))
        if start > 0:
            bounds.append(self.start_ratio * start)
        return min(bounds) if bounds else None

    def ceiling(self, steps: int | None = None) -> float | None:
        """The loss above which a run has lost what it learned, for a mean over ``steps`` steps (default: the window);
        None until the first loss is seen. It changes only while the first losses come in, the untrained level is set or
        the window fills, so it is computed once per such change (a per-step call)."""
        steps = self.window if steps is None else steps
        key = (len(self.first), self.untrained, steps, self.terms)
        if self._cached is None or self._cached[0] != key:
            start = self.start()
            self._cached = (key, None if start is None else self._ceiling_of(self.first[0], start, self.margin_for(steps)))
        return self._cached[1]

    def observe(self, step: int, loss: float) -> Breach | None:
        """Take the step's loss; a :class:`Breach` when the value judged (see the module) is over the ceiling (every such
        step: ``in_breach`` tells whether its run was already reported); None under it."""
        if not math.isfinite(loss):
            return None  # nan_guard's
        window = self.window
        recent = self.recent
        recent.append(loss)
        steps = min(len(recent), window)
        judged = loss if steps == 1 else math.fsum(list(recent)[-steps:]) / steps
        self.last = (judged, steps)
        ceiling = self.ceiling(steps)
        if len(self.first) < self.start_steps:
            self.first.append(loss)
        if ceiling is None or judged <= ceiling:
            self.above_run, self.in_breach = 0, False
            return None
        self.above_run += 1
        if self.above_run < self.confirm_steps and judged < self.far_ratio * ceiling:
            return None  # one noisy step over the line: wait for the next
        self.breached = True
        return Breach(step, judged, ceiling, self.above_run, step - self.above_run + 1, self.start(),
                      self.first[0] if self.first else None, self.untrained, self.basis, steps)

    def level(self, losses: list[float], level_steps: int) -> float | None:
        """A run's loss level at its end: the median of its last ``level_steps`` losses, or, when a step holds few terms,
        the mean of the last steps that hold ``anchor_terms`` (whichever spans more steps)."""
        if not losses:
            return None
        if self.window == 1:
            return statistics.median(losses[-level_steps:])
        return math.fsum(losses[-max(level_steps, self.window):]) / len(losses[-max(level_steps, self.window):])

    def above(self, loss: float) -> bool:
        """Whether ``loss`` is over the ceiling now (without taking it)."""
        ceiling = self.ceiling()
        return ceiling is not None and math.isfinite(loss) and loss > ceiling

    def not_recovered(self, level: float, margin: float) -> bool:
        """Whether a loss level stays above the run's start by more than ``margin``."""
        start = self.start()
        return start is not None and start > 0 and level > start * (1.0 + margin)

    def state(self) -> dict[str, Any]:
        return {"first": list(self.first), "above_run": self.above_run, "breached": self.breached, "in_breach": self.in_breach,
                "recent": list(self.recent), "terms": self.terms}

    def restore(self, state: dict[str, Any] | None) -> None:
        if not state:
            return
        self.first = [float(v) for v in state.get("first", [])][:16]
        self.above_run = int(state.get("above_run", 0))
        self.breached = bool(state.get("breached", False))
        self.in_breach = bool(state.get("in_breach", False))
        self.recent.extend(float(v) for v in state.get("recent", []))
        terms = state.get("terms")
        self.terms = int(terms) if isinstance(terms, int) and terms > 0 else self.terms
        self._cached = None


def loss_terms(batches: list[Any], token: bool) -> int | None:
    """How many terms a step's loss averages, from the micro-batches' shapes (no device read): a token loss's label
    positions, a classifier's rows (its label positions for token classification), or the rows of a batch without
    labels (a contrastive or custom loss). None when no tensor says."""
    total = 0
    for batch in batches:
        labels = batch.get("labels") if hasattr(batch, "get") else None
        shape = getattr(labels, "shape", None)
        if shape is not None and len(shape) >= 1:
            total += math.prod(shape) if (token or len(shape) >= 2) else int(shape[0])
            continue
        values = batch.values() if hasattr(batch, "values") else ()
        rows = next((int(v.shape[0]) for v in values if getattr(v, "shape", None) is not None and len(v.shape) >= 1), None)
        if rows is None:
            return None
        total += rows
    return total or None
