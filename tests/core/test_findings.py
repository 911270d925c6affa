"""Findings file: flushed per finding, deduplicated by id, readable after a torn write."""
from __future__ import annotations

from pathlib import Path

from harness.core.findings import Finding, FindingsFile, Severity, read_findings, read_run_findings


def _finding(code: str = "X", **kw: object) -> Finding:
    return Finding(code=code, severity=Severity.WARNING, plugin="p", message="m", **kw)  # type: ignore[arg-type]


def test_append_is_on_disk_before_close(tmp_path: Path) -> None:
    sink = FindingsFile(tmp_path / "findings.jsonl")
    sink.append(_finding(step=3))
    # a second reader sees it while the writer still holds the file open
    assert [f.step for f in read_findings(tmp_path / "findings.jsonl")] == [3]
    sink.close()


def test_same_id_written_once_even_across_reopen(tmp_path: Path) -> None:
    f = _finding()
    sink = FindingsFile(tmp_path / "findings.jsonl")
    assert sink.append(f) is True
    assert sink.append(f) is False
    sink.close()
    again = FindingsFile(tmp_path / "findings.jsonl")
    assert again.append(f) is False
    again.close()
    assert len(read_findings(tmp_path / "findings.jsonl")) == 1


def test_torn_last_line_is_ignored(tmp_path: Path) -> None:
    path = tmp_path / "findings.jsonl"
    path.write_text(_finding(step=1).to_json() + "\n" + '{"code": "Y", "sev', encoding="utf-8")
    assert [f.step for f in read_findings(path)] == [1]


def test_run_findings_merge_spill_files_without_duplicates(tmp_path: Path) -> None:
    shared, only_spill = _finding("A", rank=1), _finding("B", rank=1)
    main = FindingsFile(tmp_path / "findings.jsonl")
    main.append(shared)
    spill = FindingsFile(tmp_path / "ranks" / "findings.rank-1.jsonl")
    spill.append(shared)
    spill.append(only_spill)
    assert sorted(f.code for f in read_run_findings(tmp_path)) == ["A", "B"]


def test_evidence_with_tensors_and_paths_serialises(tmp_path: Path) -> None:
    import torch

    f = _finding(evidence={"t": torch.tensor([1.5, 2.0]), "p": tmp_path, "s": torch.tensor(3)})
    sink = FindingsFile(tmp_path / "f.jsonl")
    sink.append(f)
    (back,) = read_findings(tmp_path / "f.jsonl")
    assert back.evidence == {"t": [1.5, 2.0], "p": str(tmp_path), "s": 3}
    assert back.severity is Severity.WARNING
