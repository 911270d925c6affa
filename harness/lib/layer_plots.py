"""Per-block figures of ``layer_stats``: one per statistic, one line per block over the steps, from ``layer_stats.jsonl`` alone.

The draw functions fill a matplotlib axes (the report renders them with its
own fixed size and margins, :mod:`harness.report.section_plots`), so this
module needs no matplotlib import. Points where a block's statistic left its
baseline are crossed; steps of findings (``marks``) are dotted lines. A
resume replays steps: each replay starts a new line of the same colour
(no line back in time).
"""
from __future__ import annotations

import math
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

from harness.core.jsonl import REPORT_SAMPLE_BYTES, read_jsonl
from harness.core.strictjson import as_float
from harness.lib.layer_history import FILE

# (column, file stem, title, y label, log scale when every value is positive)
FIGURES = (
    ("grad_norm", "grad_norm", "Gradient norm per block (pre-clip)", "grad norm", True),
    ("param_norm", "param_norm", "Parameter norm per block", "param norm", True),
    ("update_ratio", "update_ratio", "Update-to-weight ratio per block", "||dW|| / ||W||", True),
    ("exp_avg_sq_norm", "adam_second_moment", "Adam second moment (exp_avg_sq norm) per block", "exp_avg_sq norm", True),
    ("attn_logit_max", "attn_logit_max", "Max attention logit per block", "max logit", False),
)
LEGEND_BLOCKS = 12  # more blocks than this: the legend names the first and the last only

Series = dict[str, list[list[tuple[int, float, bool]]]]  # block -> segments of (step, value, left its baseline)


def read_series(run_dir: Path, columns: Iterable[str]) -> dict[str, Series]:
    """Each of ``columns`` per block, in one pass over the file; a block's line splits where its step goes back (a resume)."""
    wanted = list(columns)
    series: dict[str, Series] = {column: {} for column in wanted}
    last: dict[str, int] = {}
    for row in read_jsonl(Path(run_dir) / FILE, require_step=True, sample_bytes=REPORT_SAMPLE_BYTES):
        block, step = row.get("block"), row["step"]
        if not isinstance(block, str):
            continue
        replay = block in last and step <= last[block]
        last[block] = step
        left = row.get("left_baseline") if isinstance(row.get("left_baseline"), list) else []
        for column in wanted:
            segments = series[column].setdefault(block, [])
            if not segments or replay:
                segments.append([])
            value = as_float(row.get(column))  # "nan"/"inf" strings (strict JSON) as the floats they are
            if value is not None and math.isfinite(value):
                segments[-1].append((step, value, column in left))
    return {column: {b: [p for p in segs if p] for b, segs in per.items() if any(segs)} for column, per in series.items()}


def draw_series(axes: Any, series: Series, ylabel: str, log: bool, marks: Iterable[int] = ()) -> bool:
    """One line per block (colours in block order), crosses where it left its baseline; False when nothing was measured."""
    if not any(points for segments in series.values() for points in segments):
        return False
    from matplotlib import colormaps

    cmap = colormaps["viridis"]
    blocks = list(series)
    for i, block in enumerate(blocks):
        color = cmap(i / max(1, len(blocks) - 1))
        named = len(blocks) <= LEGEND_BLOCKS or i in (0, len(blocks) - 1)
        for j, points in enumerate(series[block]):
            label = block if named and j == 0 else None
            axes.plot([p[0] for p in points], [p[1] for p in points], color=color, linewidth=1.0, label=label)
            left = [(p[0], p[1]) for p in points if p[2]]
            if left:
                axes.scatter([p[0] for p in left], [p[1] for p in left], marker="x", color="tab:red", s=30, zorder=5)
    values = [p[1] for segments in series.values() for points in segments for p in points]
    if log and all(v > 0 for v in values):
        axes.set_yscale("log")
    for k, step in enumerate(sorted(set(marks))):
        axes.axvline(step, color="black", alpha=0.5, linewidth=1, linestyle=":", label="finding" if k == 0 else None)
    from matplotlib.ticker import MaxNLocator

    axes.xaxis.set_major_locator(MaxNLocator(integer=True))  # steps
    axes.set_xlabel("optimizer step")
    axes.set_ylabel(ylabel)
    axes.legend(fontsize=6, loc="upper left", ncol=2 if len(blocks) > 6 else 1)
    return True


def layer_figures(run_dir: Path, findings: Iterable[Any] = ()) -> list[tuple[str, str, Callable[[Any], bool]]]:
    """``(name, title, draw)`` per statistic; ``findings`` (with ``code`` and ``step``): steps marked on every figure.

    Marked: the layer codes and loss spikes, the findings these figures explain.
    """
    codes = {"LAYER_GRAD_SURGE", "UPDATE_RATIO_HIGH", "ATTENTION_LOGIT_GROWTH", "LOSS_SPIKE", "GRAD_NORM_SPIKE"}
    marks = sorted({f.step for f in findings if getattr(f, "code", None) in codes and isinstance(getattr(f, "step", None), int)})
    figures = []
    every = read_series(run_dir, [f[0] for f in FIGURES])
    for column, name, title, ylabel, log in FIGURES:
        series = every[column]
        if series:
            figures.append((name, title, lambda axes, s=series, y=ylabel, g=log: draw_series(axes, s, y, g, marks)))
    return figures
