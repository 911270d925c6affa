"""Per-block plots as text: a sparkline of each statistic over the run, from ``layer_stats.jsonl`` alone.

Text plots read the same in ``report.md``, the HTML report, MLflow and a
terminal, and need no file beside the report. Each line is scaled to its own
range (log scale, since these norms span decades); the table gives the
numbers.
"""
from __future__ import annotations

import math
from pathlib import Path
from typing import Any

from harness.core.jsonl import REPORT_SAMPLE_BYTES, read_jsonl
from harness.core.strictjson import as_float
from harness.lib.layer_history import FILE

BARS = "▁▂▃▄▅▆▇█"
SHOWN = (("grad_norm", "grad norm"), ("update_ratio", "update ratio"), ("attn_logit_max", "max attention logit"))
WIDTH = 40


def sparkline(values: list[float | None], width: int = WIDTH) -> str:
    """``values`` (None: not measured) binned to ``width`` characters on a log scale; ' ' where nothing was measured."""
    if not values:
        return ""
    bins: list[list[float]] = [[] for _ in range(min(width, len(values)))]
    for i, v in enumerate(values):
        if v is not None and math.isfinite(v) and v > 0:
            bins[i * len(bins) // len(values)].append(math.log10(v))
    points = [max(b) if b else None for b in bins]
    known = [p for p in points if p is not None]
    if not known:
        return " " * len(points)
    low, high = min(known), max(known)
    span = high - low or 1.0
    return "".join(" " if p is None else BARS[min(len(BARS) - 1, int((p - low) / span * (len(BARS) - 1) + 0.5))] for p in points)


def layer_table(run_dir: Path) -> str | None:
    """A markdown table: per block and statistic, its sparkline, last and largest value; None without rows."""
    series: dict[str, dict[str, list[float | None]]] = {}
    steps: list[int] = []
    for row in read_jsonl(Path(run_dir) / FILE, require_step=True, sample_bytes=REPORT_SAMPLE_BYTES):
        block = row.get("block")
        if not isinstance(block, str):
            continue
        if not steps or row["step"] != steps[-1]:
            steps.append(row["step"])
        per_block = series.setdefault(block, {m: [] for m, _ in SHOWN})
        for metric, _ in SHOWN:
            value = row.get(metric)
            per_block[metric].append(as_float(value))  # "nan"/"inf" strings (strict JSON) as the floats they are
    if not series:
        return None
    lines = [f"Measured at {len(steps)} steps ({steps[0]}..{steps[-1]}); each line on its own log scale, left to right.", "",
             "| block | statistic | over the run | last | max |", "|---|---|---|---|---|"]
    for block, metrics in series.items():
        for metric, label in SHOWN:
            values = metrics[metric]
            known = [v for v in values if v is not None and math.isfinite(v)]
            if not known:
                continue
            lines.append(f"| `{block}` | {label} | `{sparkline(values)}` | {_fmt(values[-1])} | {_fmt(max(known))} |")
    return "\n".join(lines) + "\n"


def _fmt(value: Any) -> str:
    return f"{value:.3g}" if isinstance(value, float) and math.isfinite(value) else "-"
