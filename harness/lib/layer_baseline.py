"""A robust baseline per block and metric: which blocks' statistics left their own recent history.

Each (block, metric) keeps a :class:`harness.lib.robust.Baseline` of its
normal values (median and MAD of step-to-step differences, outliers never
admitted, as the spike detector keeps for the loss). A value is an outlier
("left its baseline") when it is ``z`` robust SDs and ``min_ratio`` times
above the median; a value that stays out for ``patience`` samples in a row is
a new level, and the baseline restarts from it.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

from harness.lib.robust import Baseline

JUDGED = ("grad_norm", "update_ratio", "attn_logit_max")  # the metrics that can surge; the others are recorded only
RECORDED = ("param_norm", "exp_avg_sq_norm")


@dataclass(frozen=True)
class Verdict:
    value: float
    median: float | None
    z: float | None
    ready: bool  # the baseline held min_history values
    outlier: bool

    @property
    def ratio(self) -> float | None:
        if self.median is None or self.median <= 0:
            return None
        return self.value / self.median


class LayerBaselines:
    """The baselines of every (block, metric) of one run."""

    def __init__(self, window: int, min_history: int, level_steps: int, z: float, min_ratio: float, patience: int) -> None:
        self.window, self.min_history, self.level_steps = window, min_history, level_steps
        self.z, self.min_ratio, self.patience = z, min_ratio, patience
        self._bases: dict[tuple[str, str], Baseline] = {}
        self._runs: dict[tuple[str, str], int] = {}

    def _base(self, key: tuple[str, str]) -> Baseline:
        base = self._bases.get(key)
        if base is None:
            base = self._bases[key] = Baseline(self.window, self.min_history, self.level_steps)
        return base

    def judge(self, block: str, metric: str, value: float) -> Verdict | None:
        """``value`` against the block's own history of ``metric`` (admitted unless it is an outlier); None if not finite."""
        if not math.isfinite(value):
            return None
        key = (block, metric)
        base = self._base(key)
        j = base.judge(value)
        outlier = j is not None and value > j.median * self.min_ratio and j.z > self.z
        ready = base.ready
        if not outlier:
            base.admit(value)
            self._runs[key] = 0
        else:
            self._runs[key] = self._runs.get(key, 0) + 1
            if self._runs[key] >= self.patience:  # a new level, not a surge: it becomes the baseline
                base.clear()
                base.admit(value)
                self._runs[key] = 0
        return Verdict(value, j.median if j else None, j.z if j else None, ready, outlier and ready)

    def state(self) -> dict[str, list[float]]:
        """JSON-able: the windows, keyed ``block|metric`` (for a checkpoint)."""
        return {f"{b}|{m}": list(base.values) for (b, m), base in self._bases.items()}

    def restore(self, state: dict[str, list[float]]) -> None:
        for key, values in state.items():
            block, _, metric = key.rpartition("|")
            base = self._base((block, metric))
            base.clear()
            base.values.extend(float(v) for v in values)
