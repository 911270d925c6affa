"""Run-end findings of other ranks reach findings.jsonl exactly once (torchrun, two processes, DDP over gloo).

Rank 1 gets a NaN batch at step 3 (only rank 1): nan_guard reports NONFINITE_LOSS there mid-run (carried to
rank 0 by the step exchange); the fault injector reports TEST_FAULT on rank 1 in its on_run_end, after the last
exchange (carried by rank 0 merging rank 1's spill file when the run ends). SKIPPED_STEPS, the agreed skip's summary,
is rank 0's alone.
"""
from __future__ import annotations

from collections import Counter
from pathlib import Path

import pytest

from conftest import FAULTS, read_jsonl, torchrun, wrapped_example, write_yaml

pytestmark = pytest.mark.slow


def test_rank_1_run_end_finding_lands_in_findings_jsonl_once_and_mid_run_ones_are_not_doubled(tmp_path: Path) -> None:
    out = tmp_path / "run"
    config = write_yaml(tmp_path / "h.yaml", {
        "plugins": ["nan_guard", FAULTS],
        "fault_injector": {"nan_batch_on_rank": 1, "nan_batch_on_rank_at_steps": [3],
                           "report_in": "on_run_end", "report_at_step": 5, "report_on_rank": 1},
    })
    result = wrapped_example(out, config, launcher=torchrun(2), steps=5, save_steps=0)
    assert result.returncode == 0, result.stderr[-4000:]
    run_dir = out / "harness"
    main = read_jsonl(run_dir / "findings.jsonl")
    spilled = read_jsonl(run_dir / "ranks" / "findings.rank-1.jsonl")

    # rank 1's run-end finding, made after the last step exchange
    (late,) = [f for f in spilled if f["code"] == "TEST_FAULT"]
    assert late["rank"] == 1 and late["step"] == 5 and "in on_run_end" in late["message"]
    assert [f["id"] for f in main if f["code"] == "TEST_FAULT"] == [late["id"]]
    # rank 1's mid-run finding, carried by the step exchange: still once
    assert [(f["rank"], f["step"]) for f in main if f["code"] == "NONFINITE_LOSS"] == [(1, 3)]
    # every finding rank 1 made is in findings.jsonl, and no finding is in it twice
    ids = Counter(f["id"] for f in main)
    assert [i for i, n in ids.items() if n > 1] == []
    assert [f["code"] for f in spilled if f["id"] not in ids] == []
    # the skip every rank agreed is summed up once, by rank 0 (each rank said it before: SKIPPED_STEPS x2)
    assert [(f["rank"], f["evidence"]["skipped_steps"]) for f in main if f["code"] == "SKIPPED_STEPS"] == [(0, [3])]
    # the report (which merges the spill files itself) counts each once
    report = (run_dir / "report.md").read_text(encoding="utf-8")
    (row,) = [line for line in report.splitlines() if line.startswith("| [TEST_FAULT]")]
    assert "| 1 | 5 | 1 |" in row, row  # one finding, at step 5, rank 1
