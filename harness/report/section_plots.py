"""Figures a plugin's report section carries: drawn like the report's own plots, saved as ``report/plots/<plugin>-<name>.png``.

A plugin returns ``ReportSection(..., plots=((name, title, draw), ...))``
with ``draw(axes) -> bool`` (False: nothing to show), or ready
:class:`~harness.report.plots.Plot` objects. The report draws them only when
it draws plots at all (``report_plots``, ``--no-plots``), with its own size
and margins, and names each file after the section's plugin and the plot's
name, both reduced to ``[A-Za-z0-9_-]`` (a received run directory is data:
a name such as ``../../x`` must not leave ``report/plots``) and made unique.
"""
from __future__ import annotations

import dataclasses
import re
from collections.abc import Callable, Iterable, Sequence
from typing import Any

from harness.report.model import ReportSection
from harness.report.plots import Plot, render_png

MAX_PER_SECTION = 16  # more figures than anyone reads; a plugin gone wrong must not fill the disk
_UNSAFE = re.compile(r"[^A-Za-z0-9_-]+")
FigureSpec = tuple[str, str, Callable[[Any], bool]]  # (name, title, draw(axes) -> drew anything)


def safe_stem(text: Any, limit: int = 60) -> str:
    """``text`` as a file stem that cannot name a path: runs of other characters become ``_``, ends trimmed."""
    return _UNSAFE.sub("_", str(text)).strip("_-")[:limit] or "plot"


def render(item: Any) -> Plot | None:
    """A section's plot as a :class:`Plot`: a spec drawn now, a Plot as is; None for nothing drawn or anything else."""
    if isinstance(item, Plot):
        return item if isinstance(item.png, bytes) else None
    if isinstance(item, tuple) and len(item) == 3 and callable(item[2]):
        png = render_png(str(item[1]), item[2])
        return Plot(str(item[0]), str(item[1]), png) if png is not None else None
    return None


def render_all(specs: Iterable[FigureSpec]) -> tuple[Plot, ...]:
    """Each ``(name, title, draw)`` drawn to PNG now (for a plugin that wants the bytes); empty figures left out."""
    return tuple(plot for spec in specs if (plot := render(spec)) is not None)


def name_section_plots(sections: Sequence[ReportSection], taken: Iterable[str] = ()) -> tuple[list[ReportSection], list[str]]:
    """The sections with their plots drawn and named ``<plugin>-<name>`` (safe, unique; ``taken``: the built-in ones), and notes."""
    used, named, notes = set(taken), [], []
    for section in sections:
        if not section.plots:
            named.append(section)
            continue
        plots = []
        for item in list(section.plots)[:MAX_PER_SECTION]:
            try:
                plot = render(item)
            except Exception as exc:  # noqa: BLE001 - one figure that fails costs that figure, noted
                notes.append(f"a plot of section '{section.title}' could not be drawn: {type(exc).__name__}: {exc}")
                continue
            if plot is None:
                continue
            stem = base = f"{safe_stem(section.plugin or 'plugin', 40)}-{safe_stem(plot.name)}"
            count = 1
            while stem in used:
                count += 1
                stem = f"{base}-{count}"
            used.add(stem)
            plots.append(Plot(stem, plot.title, plot.png))
        named.append(dataclasses.replace(section, plots=tuple(plots)))
    return named, notes
