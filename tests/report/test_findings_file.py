"""A findings.jsonl that is missing, not a file, a symbolic link or unreadable is said, not read as "no finding"."""
from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import pytest

from cli_in_process import harness_in_process
from handmade_runs import finding_record, make_run

STOPPED = {"attempts": [{"started": 1_700_000_000.0, "resumed_from": None, "start_step": 0, "status": "stopped",
                         "ended": 1_700_000_100.0, "end_step": 4}]}


def _damage(run_dir: Path, case: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> str:
    """Damage the run's findings.jsonl as ``case`` says; the words the note must hold."""
    findings = run_dir / "findings.jsonl"
    if case == "missing":
        findings.unlink()
        return "findings.jsonl is missing"
    if case == "directory":
        findings.unlink()
        findings.mkdir()
        return "findings.jsonl could not be read (it is a directory)"
    if case == "symlink":  # a received run pointing out of itself: never read through, whatever it points at
        outside = tmp_path / "elsewhere.jsonl"
        outside.write_text(json.dumps(finding_record(code="PLANTED_CODE", severity="critical")) + "\n", encoding="utf-8")
        findings.unlink()
        findings.symlink_to(outside)
        return "findings.jsonl is a symbolic link: not followed"
    assert case == "unreadable"  # tests run as root, where a chmod 000 does not stop a read: the open fails instead
    real_open = os.open

    def refusing_open(path: Any, flags: int, *args: Any, **kwargs: Any) -> int:
        if Path(path) == findings:
            raise PermissionError(13, "Permission denied", str(path))
        return real_open(path, flags, *args, **kwargs)

    monkeypatch.setattr("harness.report.record.os.open", refusing_open)
    return "findings.jsonl could not be read (PermissionError)"


@pytest.mark.parametrize("case", ["missing", "directory", "symlink", "unreadable"])
def test_an_unread_findings_file_is_noted_and_the_verdict_claims_no_finding(
        tmp_path: Path, case: str, capsys: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    out = tmp_path / "out"
    run_dir = make_run(out, run_json=STOPPED)
    words = _damage(run_dir, case, tmp_path, monkeypatch)

    explain = harness_in_process(capsys, monkeypatch, "explain", str(out))
    assert explain.returncode == 0
    text = " ".join(explain.stdout.split())
    assert "the harness stopped training" in text
    assert "no finding at warning or above" not in text and "No findings." not in text
    assert f"Note: {words}" in text  # the note names the file and what is wrong with it
    assert f"findings not known: {words}" in text  # and the verdict says so itself
    assert "PLANTED_CODE" not in text

    report = harness_in_process(capsys, monkeypatch, "report", str(out), "--no-plots")
    assert report.returncode == 0, report.stderr
    markdown = (run_dir / "report.md").read_text(encoding="utf-8")
    assert "no finding at warning or above" not in markdown and "No findings." not in markdown
    notes = markdown.split("## Notes", 1)[1]
    assert words in notes
    assert "PLANTED_CODE" not in markdown
    assert "No findings." not in (run_dir / "report.html").read_text(encoding="utf-8")
    if case == "symlink":
        assert (run_dir / "findings.jsonl").is_symlink()  # left as received


def test_an_intact_empty_findings_file_still_reads_no_finding(tmp_path: Path, capsys: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    out = tmp_path / "out"
    make_run(out, findings=[])
    explain = harness_in_process(capsys, monkeypatch, "explain", str(out))
    assert "healthy: training completed at step 4; no finding at warning or above." in " ".join(explain.stdout.split())
    assert "No findings." in explain.stdout and "Note:" not in explain.stdout


def test_a_linked_spill_file_is_not_read_through(tmp_path: Path, capsys: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    out = tmp_path / "out"
    run_dir = make_run(out)
    outside = tmp_path / "elsewhere.jsonl"
    outside.write_text(json.dumps(finding_record(code="PLANTED_CODE", severity="critical", id="x1")) + "\n", encoding="utf-8")
    (run_dir / "ranks").mkdir()
    (run_dir / "ranks" / "findings.rank-1.jsonl").symlink_to(outside)
    text = " ".join(harness_in_process(capsys, monkeypatch, "explain", str(out)).stdout.split())
    assert "PLANTED_CODE" not in text and "NONFINITE_LOSS" in text
    assert "Note: ranks/findings.rank-1.jsonl is a symbolic link: not followed" in text
