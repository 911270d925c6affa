"""Figures a plugin's report section carries: drawn like the report's own plots, saved as ``report/plots/<plugin>-<name>.png``.

A plugin returns ``ReportSection(..., plots=render_all([(name, title, draw), ...]))``;
the report names each file after the section's plugin and the plot's name,
both reduced to ``[A-Za-z0-9_-]`` (a received run directory is data: a name
such as ``../../x`` must not leave ``report/plots``), made unique, and
written beside the built-in plots.
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


def safe_stem(text: str, limit: int = 60) -> str:
    """``text`` as a file stem that cannot name a path: runs of other characters become ``_``, ends trimmed."""
    return _UNSAFE.sub("_", str(text)).strip("_-")[:limit] or "plot"


def render_all(specs: Iterable[FigureSpec]) -> tuple[Plot, ...]:
    """Each ``(name, title, draw)`` drawn to PNG; figures with nothing to draw are left out."""
    plots = []
    for name, title, draw in specs:
        png = render_png(title, draw)
        if png is not None:
            plots.append(Plot(name, title, png))
    return tuple(plots)


def name_section_plots(sections: Sequence[ReportSection], taken: Iterable[str] = ()) -> list[ReportSection]:
    """The sections with their plots renamed to unique, safe ``<plugin>-<name>`` stems (``taken``: the built-in ones)."""
    used = set(taken)
    named = []
    for section in sections:
        if not section.plots:
            named.append(section)
            continue
        plots = []
        for plot in list(section.plots)[:MAX_PER_SECTION]:
            if not isinstance(plot, Plot) or not isinstance(plot.png, bytes):
                continue
            stem = base = f"{safe_stem(section.plugin or 'plugin', 40)}-{safe_stem(plot.name)}"
            count = 1
            while stem in used:
                count += 1
                stem = f"{base}-{count}"
            used.add(stem)
            plots.append(Plot(stem, str(plot.title), plot.png))
        named.append(dataclasses.replace(section, plots=tuple(plots)))
    return named
