"""``harness wrap``'s closing summary: after the command ended, what the harness found, on stderr.

The live console lines scroll away with the Trainer's output; the summary
is the last thing on screen: per run directory the job produced (named by
the markers in wrap's private folder, :mod:`harness.lib.wrapped_runs`), the
verdict (:func:`harness.report.verdict.verdict_of`, as the report says it),
the findings counted by code, worst severity first, the report's path and
the ``harness explain`` command.
"""
from __future__ import annotations

import dataclasses
from collections import Counter
from collections.abc import Mapping
from pathlib import Path
from typing import Sequence

from harness.core.findings import Severity
from harness.report.record import RunRecord
from harness.report.verdict import verdict_of

HEAD = "harness wrap:"
CLOCK_SLACK_S = 1.0  # a finding stamped this much before the job began still counts (clock steps, rounding)


def closing_summary(run_dirs: Sequence[Path] | Mapping[Path, float | None]) -> str:
    """The summary text for ``run_dirs`` (one line saying so when the command produced none); a mapping gives each run
    directory the wall time this job began there, so that findings of earlier jobs in it are not counted as this job's."""
    since_of = dict(run_dirs) if isinstance(run_dirs, Mapping) else dict.fromkeys(run_dirs)
    if not run_dirs:
        return (f"{HEAD} no harness run directory was produced (the command trained no Trainer with the harness "
                "attached, or the harness refused to start training: its message is above), so there is nothing to "
                "summarise.\n")
    blocks = []
    for run_dir, since in since_of.items():
        try:
            blocks.append(_run_summary(Path(run_dir), since))
        except Exception as exc:  # noqa: BLE001 - a damaged run directory must not change wrap's exit status
            blocks.append(f"{HEAD} run {run_dir}: could not be read for the summary ({type(exc).__name__}: {exc}); "
                          f"try `harness explain {Path(run_dir).parent}`.\n")
    return "".join(blocks)


def _run_summary(run_dir: Path, since: float | None = None) -> str:
    run = RunRecord.load(run_dir)
    cutoff = since - CLOCK_SLACK_S if since is not None else float("-inf")
    earlier = [f for f in run.findings if f.time < cutoff]
    if earlier:  # an earlier job trained into the same output_dir: its findings are in the run directory, not this job's
        run = dataclasses.replace(run, findings=[f for f in run.findings if f.time >= cutoff])
    lines = [f"{HEAD} summary of {run_dir}",
             f"  verdict: {verdict_of(run).line()}",
             f"  findings: {code_counts(run)}"
             + (f" ({len(earlier)} finding(s) of earlier jobs in this run directory not counted)" if earlier else ""),
             f"  report: {_report_path(run_dir)}",
             f"  next: harness explain {run.output_dir}"]
    return "\n".join(lines) + "\n"


def code_counts(run: RunRecord) -> str:
    """``NONFINITE_LOSS x2 (warning), ACTION_TAKEN x1 (info)``: every code once, worst severity first, then most frequent."""
    counts = Counter(f.code for f in run.findings)
    if not counts:
        return "none" if run.findings_known else f"not known ({run.findings_unknown})"
    severity: dict[str, Severity] = {}
    for finding in run.findings:
        if finding.code not in severity or finding.severity > severity[finding.code]:
            severity[finding.code] = finding.severity
    order = sorted(counts, key=lambda code: (-severity[code].rank, -counts[code], code))
    return ", ".join(f"{code} x{counts[code]} ({severity[code].value})" for code in order)


def _report_path(run_dir: Path) -> str:
    html, markdown = run_dir / "report.html", run_dir / "report.md"
    if html.exists():
        return f"{html}" + (" (and report.md)" if markdown.exists() else "")
    if markdown.exists():
        return str(markdown)
    return f"none written (`harness report {run_dir.parent}` builds it)"
