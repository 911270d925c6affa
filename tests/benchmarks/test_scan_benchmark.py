"""benchmarks/scan.py at a tiny size: the script runs, all three sides find exactly the planted examples, the lines print."""
from __future__ import annotations

import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


def test_scan_benchmark_runs_small(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    sys.path.insert(0, str(REPO / "benchmarks"))
    try:
        import scan as bench
    finally:
        sys.path.remove(str(REPO / "benchmarks"))
    args = ["--words", "40000", "--examples", "30", "--planted", "4", "--files", "2", "--vocabulary", "5000", "--repeat", "1", "--cache", str(tmp_path)]
    assert bench.main(args) == 0
    out = capsys.readouterr().out.strip().splitlines()
    assert any(line.startswith("janitor baseline:") and "M words/s" in line for line in out)
    assert any(line.startswith("harness scan, 2 workers:") and "WRONG" not in line for line in out)
    assert out[-1].startswith("speed-up of harness scan (1 worker) over the janitor baseline: ") and out[-1].endswith("x")
    marker = next(tmp_path.glob("*/corpus.json"))
    written = {p: p.stat().st_mtime_ns for p in marker.parent.iterdir()}
    assert bench.main(args) == 0
    assert {p: p.stat().st_mtime_ns for p in marker.parent.iterdir()} == written  # cached: generated once
