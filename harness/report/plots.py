"""The report's plots, drawn with matplotlib's Agg canvas (no display, no pyplot state) into PNG bytes."""
from __future__ import annotations

import io
import math
from dataclasses import dataclass
from typing import Any, Callable

from harness.report.record import RunRecord, as_float

SPIKE_CODES = ("LOSS_SPIKE", "LOSS_DIVERGENCE")
NONFINITE_CODES = ("NONFINITE_LOSS", "NONFINITE_GRAD")


@dataclass(frozen=True)
class Plot:
    name: str  # file stem under report/plots/
    title: str
    png: bytes


def make_plots(run: RunRecord) -> list[Plot]:
    """Every plot the run's numbers allow (none when ``steps.jsonl`` is empty)."""
    if not run.steps:
        return []
    plots = []
    for name, title, draw in (
        ("loss", "Loss per token processed", _draw_loss),
        ("grad_norm", "Gradient norm", _draw_grad_norm),
        ("lr", "Learning rate", _draw_lr),
        ("throughput", "Throughput", _draw_throughput),
    ):
        png = render_png(title, lambda axes, draw=draw: draw(run, axes))
        if png is not None:
            plots.append(Plot(name, title, png))
    return plots


def render_png(title: str, draw: Callable[[Any], bool]) -> bytes | None:
    """One figure as PNG bytes: ``draw(axes)`` fills it (False: nothing to show, no figure); fixed size and margins."""
    from matplotlib.figure import Figure

    figure = Figure(figsize=(7.5, 3.0), dpi=90)
    axes = figure.subplots()
    if not draw(axes):
        return None
    axes.set_title(title, fontsize=10)
    axes.grid(True, alpha=0.3)
    figure.subplots_adjust(left=0.1, right=0.98, top=0.88, bottom=0.2)  # fixed margins: tight_layout costs more than drawing
    buffer = io.BytesIO()
    figure.savefig(buffer, format="png")
    return buffer.getvalue()


def _segments(run: RunRecord) -> list[list[dict[str, Any]]]:
    """Step records split where the step number goes back (a resume or rollback replays steps)."""
    segments: list[list[dict[str, Any]]] = []
    previous = None
    for record in run.steps:
        step = record.get("step")
        if not isinstance(step, int):
            continue
        if previous is None or step <= previous:
            segments.append([])
        segments[-1].append(record)
        previous = step
    return segments


def record_of(run: RunRecord, finding: Any) -> dict[str, Any] | None:
    """The step record a finding was made at: same step, the first one written after the finding (a resume
    or rollback replays steps, and the replayed record must not take the original's marker)."""
    return _first_after([r for r in run.steps if r.get("step") == finding.step], finding)


def records_of(run: RunRecord, findings: list[Any]) -> list[dict[str, Any]]:
    """:func:`record_of` for each finding, in one pass over the steps: O(steps + findings), not their product."""
    if not findings:
        return []
    wanted = {f.step for f in findings if isinstance(f.step, int)}
    by_step: dict[int, list[dict[str, Any]]] = {}
    for record in run.steps:
        step = record.get("step")
        if isinstance(step, int) and step in wanted:
            by_step.setdefault(step, []).append(record)
    picked = (_first_after(by_step.get(f.step, []) if isinstance(f.step, int) else [], f) for f in findings)
    return [record for record in picked if record is not None]


def _first_after(candidates: list[dict[str, Any]], finding: Any) -> dict[str, Any] | None:
    if not candidates:
        return None
    after = [r for r in candidates if (as_float(r.get("time")) or float("inf")) >= finding.time - 1.0]
    return (after or candidates)[0]


def _x(run: RunRecord) -> tuple[str, str]:
    has_tokens = all((as_float(r.get("tokens")) or 0) > 0 for r in run.steps)
    return ("tokens", "tokens processed") if has_tokens else ("step", "optimizer step")


def _draw_loss(run: RunRecord, axes: Any) -> bool:
    key, label = _x(run)
    drew = False
    segments = _segments(run)
    for i, segment in enumerate(segments):
        points = [(as_float(r.get(key)), as_float(r.get("loss"))) for r in segment]
        points = [(x, y) for x, y in points if x is not None and y is not None and math.isfinite(y)]
        if points:
            axes.plot([p[0] for p in points], [p[1] for p in points], color="tab:blue", linewidth=1.2, label="train loss" if i == 0 else None)
            drew = True
        if i > 0 and segment:
            first = segment[0]
            x0 = (as_float(first.get(key)) or 0) - (as_float(first.get("step_tokens")) or 0 if key == "tokens" else 1)
            axes.axvline(x0, color="grey", linestyle="--", linewidth=1, label="resume" if i == 1 else None)
    by_step = {r["step"]: r for r in run.steps if isinstance(r.get("step"), int)}  # the last record of a step
    skipped = [as_float(r.get(key)) for r in run.steps if r.get("skipped") or r.get("optimizer_skipped")]
    for j, x in enumerate(v for v in skipped if v is not None):
        axes.axvline(x, color="tab:orange", alpha=0.5, linewidth=1, label="skipped step" if j == 0 else None)
    spikes = records_of(run, [f for f in run.findings if f.code in SPIKE_CODES])
    points = [(as_float(r.get(key)), as_float(r.get("loss"))) for r in spikes]
    points = [(x, y) for x, y in points if x is not None and y is not None and math.isfinite(y)]
    if points:
        axes.scatter([p[0] for p in points], [p[1] for p in points], marker="x", color="tab:red", s=50, zorder=5, label="spike")
    evals = [(r["step"], as_float(r.get("eval_loss"))) for r in run.logs if r.get("eval_loss") is not None and r.get("step") in by_step]
    if evals:
        axes.scatter([as_float(by_step[s].get(key)) for s, _ in evals], [v for _, v in evals], color="tab:green", s=18, label="eval loss")
    axes.set_xlabel(label)
    axes.set_ylabel("loss")
    if drew:
        axes.legend(fontsize=7, loc="upper right")
    return drew


def _plot_by_segment(run: RunRecord, axes: Any, key: str, **style: Any) -> list[tuple[int, float]]:
    """Plot ``key`` against the step, one line per segment (no line back to a replayed step); the points drawn."""
    drawn: list[tuple[int, float]] = []
    label = style.pop("label", None)
    for segment in _segments(run):
        points = [(r["step"], v) for r in segment if (v := as_float(r.get(key))) is not None and math.isfinite(v)]
        if points:
            axes.plot([p[0] for p in points], [p[1] for p in points], label=label if not drawn else None, **style)
            drawn += points
    return drawn


def _draw_grad_norm(run: RunRecord, axes: Any) -> bool:
    drawn = _plot_by_segment(run, axes, "grad_norm", color="tab:purple", linewidth=1.2, label="grad norm")
    if not drawn:
        return False
    steps, norms = [p[0] for p in drawn], [p[1] for p in drawn]
    if all(v > 0 for v in norms):
        axes.set_yscale("log")
    spiked = records_of(run, [f for f in run.findings if f.code == "GRAD_NORM_SPIKE"])
    marked = [(r["step"], v) for r in spiked if (v := as_float(r.get("grad_norm"))) is not None and math.isfinite(v)]
    if marked:
        axes.scatter([s for s, _ in marked], [v for _, v in marked], marker="x", color="tab:red", s=50, zorder=5, label="spike")
    bad = sorted({f.step for f in run.findings if f.code in NONFINITE_CODES and f.step is not None})
    for j, step in enumerate(bad):
        axes.axvline(step, color="black", alpha=0.6, linewidth=1, linestyle=":", label="non-finite" if j == 0 else None)
    axes.set_xlabel("optimizer step")
    axes.legend(fontsize=7, loc="upper right")
    return True


def _draw_lr(run: RunRecord, axes: Any) -> bool:
    if not _plot_by_segment(run, axes, "lr", color="tab:green", linewidth=1.2):
        return False
    axes.set_xlabel("optimizer step")
    axes.set_ylabel("learning rate")
    return True


def _draw_throughput(run: RunRecord, axes: Any) -> bool:
    wait = axes.twinx()
    drawn = 0
    for segment in _segments(run):
        points = []
        for record in segment:
            tokens, seconds = as_float(record.get("step_tokens")), as_float(record.get("step_time"))
            if tokens and seconds and seconds > 0:
                points.append((record["step"], tokens / seconds, (as_float(record.get("data_time")) or 0.0) / seconds))
        if points:
            first = not drawn
            axes.plot([p[0] for p in points], [p[1] for p in points], color="tab:blue", linewidth=1.0, label="tokens/s (all ranks)" if first else None)
            wait.plot([p[0] for p in points], [min(p[2], 1.0) for p in points], color="tab:orange", linewidth=0.8, alpha=0.7,
                      label="data wait fraction" if first else None)
            drawn += len(points)
    if drawn < 2:
        return False
    axes.set_xlabel("optimizer step")
    axes.set_ylabel("tokens/s")
    wait.set_ylim(0, 1)
    wait.set_ylabel("data wait", fontsize=8)
    handles = axes.get_legend_handles_labels()[0] + wait.get_legend_handles_labels()[0]
    axes.legend(handles=handles, fontsize=7, loc="upper right")
    return True
