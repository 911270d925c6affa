"""The evaluation losses' trend: an eval loss that rises evaluation after evaluation, whatever the training loss does.

A training loss that falls while the eval loss climbs is overfitting (or
an eval set unlike the training data); one that explodes with it has lost
what it learned. Either way the evaluations say it first in numbers the user
already logs. Judged at each evaluation (host floats, once per evaluation):
the eval loss rose at ``rises`` evaluations in a row and stands ``min_rise``
above its best, and, where the eval set's size is known and its loss is one
term per example (a classifier's), more than two standard errors of a mean
over that many examples (``2 / sqrt(n)``: a cross-entropy's per-example
spread is about its mean), so that 40 examples near chance do not make a
trend.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True)
class EvalRise:
    key: str
    step: int
    value: float
    best: float
    best_step: int
    rises: list[tuple[int, float]]  # the evaluations of the climb, (step, value), oldest first
    train_at_best: float | None
    train_now: float | None

    @property
    def rise(self) -> float:
        return self.value / self.best - 1.0 if self.best > 0 else math.inf

    @property
    def overfitting(self) -> bool:
        """The training loss fell over the climb (by more than 2%)."""
        return self.train_at_best is not None and self.train_now is not None and self.train_now < self.train_at_best * 0.98

    def training_words(self, exploded: bool) -> str:
        """What the training loss did over the same steps."""
        if self.train_at_best is None or self.train_now is None:
            return "the training loss is not known for those steps"
        change = f"from {self.train_at_best:.4f} at step {self.best_step} to {self.train_now:.4f} at step {self.step}"
        if exploded:
            return f"while the training loss exploded ({change}, above where the run started)"
        if self.overfitting:
            return (f"while the training loss fell ({change}): the model fits the training data and generalises worse "
                    "(overfitting: too many epochs, too high a learning rate, or an eval set unlike the training data)")
        if self.train_now > self.train_at_best * 1.02:
            return f"and the training loss rose with it ({change})"
        return f"while the training loss held ({change})"

    def evidence(self) -> dict[str, Any]:
        return {"metric": self.key, "eval_loss": self.value, "best": self.best, "best_step": self.best_step, "rise": self.rise,
                "evaluations": [{"step": s, "value": v} for s, v in self.rises], "train_loss_at_best": self.train_at_best,
                "train_loss_now": self.train_now}


@dataclass
class EvalTrend:
    """Per eval-loss metric, its evaluations (see the module); ``observe`` returns a rise once per climb."""

    rises: int = 2
    min_rise: float = 0.05
    history: dict[str, list[tuple[int, float, float | None]]] = field(default_factory=dict)  # key -> (step, eval, train level)
    reported: dict[str, bool] = field(default_factory=dict)

    def observe(self, step: int, metrics: dict[str, Any], train_level: float | None,
                examples: dict[str, int] | None = None) -> list[EvalRise]:
        """``examples``: per metric key, the eval set's examples when its loss has one term per example (else none)."""
        found = []
        for key, raw in metrics.items():
            if not (key.startswith("eval_") and key.endswith("loss")) or isinstance(raw, bool):
                continue
            try:
                value = float(raw)
            except (TypeError, ValueError):
                continue
            if not math.isfinite(value):
                continue
            seen = self.history.setdefault(key, [])
            if seen and seen[-1][0] == step:
                continue  # the same evaluation reported twice
            seen.append((step, value, train_level))
            del seen[:-200]
            n = (examples or {}).get(key)
            rise = self._rise(key, seen, max(self.min_rise, 2.0 / math.sqrt(n)) if n else self.min_rise)
            if rise is not None:
                found.append(rise)
        return found

    def _rise(self, key: str, seen: list[tuple[int, float, float | None]], min_rise: float) -> EvalRise | None:
        values = [v for _, v, _ in seen]
        climbing = len(values) > self.rises and all(values[-i] > values[-i - 1] for i in range(1, self.rises + 1))
        best_index = min(range(len(values)), key=values.__getitem__)
        best = values[best_index]
        if not climbing or values[-1] <= best * (1.0 + min_rise):
            if values[-1] <= best:
                self.reported[key] = False  # a new best: a later climb is a new episode
            return None
        if self.reported.get(key):
            return None
        self.reported[key] = True
        step, value, train_now = seen[-1]
        best_step, _, train_at_best = seen[best_index]
        climb = [(s, v) for s, v, _ in seen[best_index:]]
        return EvalRise(key, step, value, best, best_step, climb, train_at_best, train_now)

    def state(self) -> dict[str, Any]:
        return {"history": {k: [list(e) for e in v[-50:]] for k, v in self.history.items()}, "reported": dict(self.reported)}

    def restore(self, state: dict[str, Any] | None) -> None:
        if not state:
            return
        self.history = {str(k): [(int(s), float(v), None if t is None else float(t)) for s, v, t in entries]
                        for k, entries in (state.get("history") or {}).items()}
        self.reported = {str(k): bool(v) for k, v in (state.get("reported") or {}).items()}
