"""One measured step of ``layer_stats`` turned into rows and surges: the host-side half of the plugin.

The device side queues a ``[groups, len(COLUMNS)]`` tensor; its host value
(a list of rows, NaN where a statistic was not measured) becomes one JSON row
per group, judged against each block's own baseline
(:class:`harness.lib.layer_baseline.LayerBaselines`), plus what a finding
needs: per code, the blocks over their baseline or over an absolute limit.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

from harness.lib.layer_baseline import JUDGED, LayerBaselines, Verdict

COLUMNS = ("grad_norm", "param_norm", "update_norm", "update_ratio", "exp_avg_sq_norm", "attn_logit_max")


@dataclass
class Flag:
    """One block's statistic that a finding names."""

    block: str
    value: float
    median: float | None
    ratio: float | None
    z: float | None
    over_limit: bool

    def as_dict(self) -> dict[str, Any]:
        return {"block": self.block, "value": self.value, "median": self.median, "x": self.ratio, "z": self.z,
                "over_limit": self.over_limit}


@dataclass
class Judged:
    rows: list[dict[str, Any]] = field(default_factory=list)
    flags: dict[str, list[Flag]] = field(default_factory=dict)  # metric -> blocks flagged


def _finite(value: Any) -> float | None:
    return float(value) if isinstance(value, (int, float)) and math.isfinite(value) else None


def judge_step(step: int, names: list[str], values: list[list[float]], baselines: LayerBaselines,
               limits: dict[str, float]) -> Judged:
    """Rows of ``step`` (one per group) and the flagged blocks per judged metric; ``limits``: metric -> absolute limit."""
    judged = Judged(flags={m: [] for m in JUDGED})
    for name, row_values in zip(names, values):
        row: dict[str, Any] = {"step": step, "block": name}
        row.update({c: _finite(v) for c, v in zip(COLUMNS, row_values)})
        medians: dict[str, float | None] = {}
        ratios: dict[str, float | None] = {}
        left: list[str] = []
        for metric in JUDGED:
            value = row.get(metric)
            verdict: Verdict | None = baselines.judge(name, metric, value) if value is not None else None
            if verdict is None:
                continue
            medians[metric], ratios[metric] = verdict.median, verdict.ratio
            limit = limits.get(metric)
            over = limit is not None and verdict.value > limit
            if verdict.outlier:
                left.append(metric)
            if verdict.outlier or over:
                judged.flags[metric].append(Flag(name, verdict.value, verdict.median, verdict.ratio, verdict.z, over))
        row.update({"baseline": medians, "x": ratios, "left_baseline": left})
        judged.rows.append(row)
    return judged


def describe_flags(flags: list[Flag], limit: float | None, shown: int = 4) -> str:
    """``model.layers.1 0.0760 (x3.8 its baseline median 0.0199); ...`` for a finding's message."""
    words = "; ".join(
        f"{f.block} {f.value:.4g}" + (f" (x{f.ratio:.1f} its baseline median {f.median:.4g})" if f.ratio else "")
        + (f" over the limit {limit:g}" if f.over_limit and limit is not None else "") for f in flags[:shown]
    )
    return words + (f"; and {len(flags) - shown} more" if len(flags) > shown else "")
