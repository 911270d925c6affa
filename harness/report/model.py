"""The report as data: what both renderers (markdown, HTML) draw from."""
from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from harness.core.findings import Finding, Severity
from harness.lib.playbook import Section
from harness.report.plots import Plot
from harness.report.verdict import Symptom, Verdict
from harness.lib.textsafe import md_cell


def cell(text: Any, limit: int = 400) -> str:
    """Text made safe for one markdown table cell: one line, escaped (no link or HTML comes through), long text cut."""
    return md_cell(text, limit)


def md_table(headers: list[str], rows: Any, limit: int = 400) -> str:
    """A GitHub markdown table; cells are escaped with :func:`cell`, except ones already holding links."""
    lines = ["| " + " | ".join(headers) + " |", "|" + "---|" * len(headers)]
    for row in rows:
        lines.append("| " + " | ".join(v.markdown if isinstance(v, Raw) else cell(v, limit) for v in row) + " |")
    return "\n".join(lines)


@dataclass(frozen=True)
class Raw:
    """A table cell that is markdown already (a link), written as is."""

    markdown: str


@dataclass(frozen=True)
class ReportSection:
    """A section a plugin contributes through the ``report_sections`` hook.

    ``markdown`` is rendered as is in report.md and converted for report.html;
    relative links in it are relative to the run directory (where both reports live).
    ``plots``: ``(name, title, draw(axes) -> bool)`` specs or ready :class:`Plot`
    objects (:mod:`harness.report.section_plots`), drawn when the report
    draws plots, saved as ``report/plots/<plugin>-<name>.png``, linked from
    report.md after the markdown and embedded in report.html like the
    report's own plots. The built report holds :class:`Plot` objects only.
    """

    title: str
    markdown: str
    plugin: str = ""
    plots: tuple[Any, ...] = ()


@dataclass
class FindingGroup:
    """Every finding of one code, summarised."""

    code: str
    severity: Severity
    findings: list[Finding]
    playbook: Section | None
    evidence: list[tuple[str, str]] = field(default_factory=list)  # (label, path relative to the run directory)
    left_out: int = 0  # findings of this code counted but not held (a run with thousands of them: report.record)

    @property
    def count(self) -> int:
        return len(self.findings) + self.left_out

    @property
    def steps(self) -> list[int]:
        return sorted({f.step for f in self.findings if f.step is not None})

    @property
    def step_range(self) -> str:
        steps = self.steps
        if not steps:
            return "-"
        return str(steps[0]) if steps[0] == steps[-1] else f"{steps[0]}-{steps[-1]}"

    @property
    def ranks(self) -> list[int]:
        return sorted({f.rank for f in self.findings})

    @property
    def message(self) -> str:
        """The first finding's message (the numbers), as the one shown in tables."""
        return self.findings[0].message

    @property
    def actions(self) -> list[str]:
        return sorted({f.action for f in self.findings if f.action and f.action != "continue"})


@dataclass
class Report:
    run_dir: Path
    title: str
    verdict: Verdict
    groups: list[FindingGroup]
    symptoms: list[tuple[Symptom, Section | None]]
    plots: list[Plot]
    card: list[tuple[str, str]]
    attempts: list[dict[str, Any]]
    sections: list[ReportSection]
    notes: list[str] = field(default_factory=list)
    findings_unknown: str | None = None  # why findings.jsonl was not read: then "No findings." would be untrue

    @property
    def no_findings_text(self) -> str:
        """What the Findings section says when it lists none: none were made, or none could be read."""
        if self.findings_unknown is None:
            return "No findings."
        return f"No findings could be read: {self.findings_unknown} (see the notes)."

    @property
    def all_plots(self) -> list[Plot]:
        """Every PNG the report writes under report/plots: its own, then the sections'."""
        return list(self.plots) + [plot for section in self.sections for plot in section.plots if isinstance(plot, Plot)]

    @property
    def playbook_sections(self) -> list[Section]:
        """Every playbook section the report links to, once, in report order."""
        seen: dict[str, Section] = {}
        for group in self.groups:
            if group.playbook is not None:
                seen.setdefault(group.playbook.link, group.playbook)
        for _, section in self.symptoms:
            if section is not None:
                seen.setdefault(section.link, section)
        return list(seen.values())
