"""report.md: the report for terminals, MLflow and code review; links relative to the run directory."""
from __future__ import annotations

import datetime as dt
from typing import Any

from harness.core.findings import Severity
from harness.report.build import next_step, steps_to_take
from harness.report.model import FindingGroup, Report, cell
from harness.lib.textsafe import md_code, md_escape

PLOTS_DIR = "report/plots"
PLAYBOOKS_DIR = "report/playbooks"
SEVERITY_ORDER = (Severity.CRITICAL, Severity.ERROR, Severity.WARNING, Severity.INFO)


def playbook_href(group_or_link: Any) -> str | None:
    link = group_or_link.playbook.link if isinstance(group_or_link, FindingGroup) and group_or_link.playbook else group_or_link
    return f"{PLAYBOOKS_DIR}/{link}" if isinstance(link, str) else None


def when(seconds: Any) -> str:
    if not isinstance(seconds, (int, float)) or isinstance(seconds, bool):
        return "-"
    try:
        return dt.datetime.fromtimestamp(seconds).strftime("%Y-%m-%d %H:%M:%S")
    except (OverflowError, OSError, ValueError):  # a damaged run.json: nonsense times are shown as unknown
        return "-"


def render_markdown(report: Report) -> str:
    out: list[str] = [f"# {md_escape(report.title)}", ""]  # text from the run (folder names, codes, errors) is data: escaped
    out += [f"**Verdict: {report.verdict.label}.** {md_escape(report.verdict.reason)}", ""]
    out += _findings(report)
    out += _next_steps(report)
    if report.symptoms:
        out += ["## Worth a look", "", "The numbers point at these general playbooks (the harness cannot prove them alone):", ""]
        for symptom, section in report.symptoms:
            name = section.title if section else symptom.topic
            target = f"[{name}]({playbook_href(section.link)})" if section else name
            out.append(f"- {target}: {symptom.why}")
        out.append("")
    if report.plots:
        out += ["## Plots", ""]
        for plot in report.plots:
            out += [f"![{plot.title}]({PLOTS_DIR}/{plot.name}.png)", ""]
    out += ["## Run card", "", "| | |", "|---|---|"]
    out += [f"| {cell(label)} | {cell(value)} |" for label, value in report.card]
    out.append("")
    out += _attempts(report)
    for section in report.sections:
        out += [f"## {section.title}", "", section.markdown.strip(), ""]
        out += [line for plot in section.plots for line in (f"![{md_escape(plot.title)}]({PLOTS_DIR}/{plot.name}.png)", "")]
    if report.notes:
        out += ["## Notes", ""] + [f"- {cell(note, 1000)}" for note in report.notes] + [""]
    out += [f"_Built from {md_code(report.run_dir)} at {when(dt.datetime.now().timestamp())}; rebuild with {md_code(f'harness report {report.run_dir.parent}')}._", ""]
    return "\n".join(out)


def _findings(report: Report) -> list[str]:
    out = ["## Findings", ""]
    if not report.groups:
        return out + [cell(report.no_findings_text, 1000), ""]
    for severity in SEVERITY_ORDER:
        groups = [g for g in report.groups if g.severity is severity]
        if not groups:
            continue
        out += [f"### {severity.value} ({sum(g.count for g in groups)})", ""]
        out += ["| code | count | steps | ranks | what happened | action | evidence |", "|---|---|---|---|---|---|---|"]
        for g in groups:
            href = playbook_href(g)
            code = f"[{cell(g.code, 80)}]({href})" if href else cell(g.code, 80)
            evidence = ", ".join(f"[{cell(label, 40)}]({path})" for label, path in g.evidence) or "-"
            ranks = ",".join(str(r) for r in g.ranks)
            out.append(f"| {code} | {g.count} | {g.step_range} | {ranks} | {cell(g.message)} | {cell(', '.join(g.actions) or '-')} | {evidence} |")
        out.append("")
    return out


def _next_steps(report: Report) -> list[str]:
    groups = steps_to_take(report.groups)
    if not groups:
        return []
    out = ["## Next steps", "", "The first step of each finding's playbook (`harness explain` prints the same):", ""]
    for i, group in enumerate(groups, 1):
        href = playbook_href(group)
        more = f" ([playbook]({href}))" if href else ""
        out.append(f"{i}. **{cell(group.code, 80)}** (step {group.step_range}): {next_step(group, report.run_dir.parent)}{more}")
    return out + [""]


def _attempts(report: Report) -> list[str]:
    if not report.attempts:
        return []
    out = ["## Attempts", "", "| # | started | resumed from | steps | ended | error |", "|---|---|---|---|---|---|"]
    for i, attempt in enumerate(report.attempts, 1):
        status = cell(attempt.get("outcome") or attempt.get("status", "?"), 160)
        span = cell(f"{attempt.get('start_step', '?')}-{attempt.get('end_step', '?')}", 80)
        resumed = attempt.get("resumed_from") or "-"
        out.append(f"| {i} | {when(attempt.get('started'))} | {cell(resumed, 120)} | {span} | {status} | {cell(attempt.get('error', '-'), 200)} |")
    return out + [""]
