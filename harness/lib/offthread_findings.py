"""A finding written from a thread that is not the training thread (a watchdog, while training is stuck).

``ctx.report`` runs hooks (``decide_action``, ``on_finding``): plugin code that
expects the training thread, and that may wait on what the stuck thread
holds. A finding made while the training thread is stuck goes straight to
this rank's findings file instead (``findings.jsonl`` on rank 0,
``ranks/findings.rank-<r>.jsonl`` elsewhere: the files every report reads),
through its own :class:`~harness.core.findings.FindingsFile`: one line per
``write``, flushed and fsynced at once, in append mode, so that it lands
whole beside the lines the training thread's own handle appends. On rank 0
its console line is printed from this thread at once (the console is all
a user watching a hung job sees; it never raises). No hook
fires for it and it is not shipped to rank 0 in the step exchange: rank 0
copies it into ``findings.jsonl`` from the spill file at the end of its
``train()`` call (``RunContext.merge_rank_findings``, which announces it
there, on rank 0's training thread), and every report reads
the spill files too (:func:`harness.core.findings.read_run_findings`).
"""
from __future__ import annotations

from pathlib import Path
from typing import Any

from harness.core.findings import Finding, FindingCode, FindingsFile, Severity, findings_path
from harness.lib.safe_paths import safe_target


def record_offthread(ctx: Any, code: FindingCode, message: str, *, step: int, evidence: dict[str, Any], plugin: str,
                     action: str = "continue") -> Finding:
    """Make and write a finding from any thread; the config's severity override applies, no hook runs."""
    override = getattr(getattr(ctx, "options", None), "severity", {}).get(code.code)
    finding = Finding(code=code.code, severity=Severity(override or code.severity), plugin=plugin, message=message, step=step,
                      rank=ctx.rank, evidence=evidence, playbook=code.playbook, action=action)
    path = safe_target(Path(ctx.run_dir), findings_path(ctx.run_dir, ctx.rank))
    sink = FindingsFile(path)
    try:
        sink.append(finding)
    finally:
        sink.close()
    findings = getattr(ctx, "findings", None)
    if isinstance(findings, list):
        findings.append(finding)  # rank 0's live report and tests see it (a list append is atomic)
    console = getattr(ctx, "console", None)
    if console is not None:
        console.show(finding)  # rank 0's live line: a hung training thread makes no other (show never raises)
    return finding


__all__ = ["findings_path", "record_offthread"]
