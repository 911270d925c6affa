"""A finding written from another thread lands whole beside the training thread's own, where every report reads it."""
from __future__ import annotations

import threading
from pathlib import Path
from types import SimpleNamespace

from harness.core.findings import Finding, FindingCode, FindingsFile, Severity, read_findings, read_run_findings
from harness.lib.offthread_findings import findings_path, record_offthread

CODE = FindingCode("RANK_HANG", Severity.CRITICAL, "hung", "hangs#rank_hang")


def _ctx(run_dir: Path, rank: int, severity: dict[str, str] | None = None) -> SimpleNamespace:
    return SimpleNamespace(rank=rank, run_dir=run_dir, options=SimpleNamespace(severity=severity or {}), findings=[])


def test_concurrent_appends_from_two_threads_keep_every_line(tmp_path: Path) -> None:
    path = findings_path(tmp_path, 0)
    own = FindingsFile(path)  # the training thread's sink (the findings hub's file)
    ctx = _ctx(tmp_path, 0)

    def training_thread() -> None:
        for i in range(120):
            own.append(Finding("TEST_FAULT", Severity.WARNING, "x", "y" * 500, step=i))

    def watchdog_thread() -> None:
        for i in range(12):
            record_offthread(ctx, CODE, "z" * 3000, step=i, evidence={"i": i, "frames": ["f"] * 50}, plugin="watchdog")

    threads = [threading.Thread(target=training_thread), threading.Thread(target=watchdog_thread)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    own.close()
    skipped: dict[str, int] = {}
    found = read_findings(path, skipped)
    assert skipped == {} and len(found) == 132 and len({f.id for f in found}) == 132
    assert sum(f.code == "RANK_HANG" for f in found) == 12 and len(ctx.findings) == 12


def test_a_spilled_finding_of_another_rank_reaches_the_run_findings_with_the_severity_override(tmp_path: Path) -> None:
    finding = record_offthread(_ctx(tmp_path, 1, {"RANK_HANG": "error"}), CODE, "rank 1 hung", step=5, evidence={"where": "w"},
                               plugin="watchdog", action="stop")
    assert findings_path(tmp_path, 1) == tmp_path / "ranks" / "findings.rank-1.jsonl"
    (read,) = read_run_findings(tmp_path)
    assert read.id == finding.id and read.rank == 1 and read.severity is Severity.ERROR and read.action == "stop"
    assert read.playbook == "hangs#rank_hang" and read.step == 5
