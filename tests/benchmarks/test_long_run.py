"""benchmarks/long_run.py: a short run prints the table at each mark and the three verdict lines."""
from __future__ import annotations

import re
import sys
import warnings
from typing import Any

import pytest
import torch
from transformers.utils import logging as hf_logging

from conftest import REPO

sys.path.insert(0, str(REPO / "benchmarks"))
import long_run  # noqa: E402


@pytest.fixture
def restored_process_settings() -> Any:
    """main() sets torch's thread count, transformers' verbosity and warning filters for the process: put them back."""
    threads, verbosity = torch.get_num_threads(), hf_logging.get_verbosity()
    with warnings.catch_warnings():
        yield
    torch.set_num_threads(threads)
    hf_logging.set_verbosity(verbosity)


def test_a_short_run_prints_a_row_per_mark_and_the_verdicts(capsys: Any, restored_process_settings: Any) -> None:
    code = long_run.main(["--steps", "120", "--window", "20", "--no-plots"])
    out = capsys.readouterr().out
    rows = [line for line in out.splitlines() if re.match(r"^\s+\d+ \|", line)]
    assert [int(r.split("|")[0]) for r in rows] == [12, 60, 120], out
    for row in rows:
        cells = [c.strip() for c in row.split("|")]
        step_us, fresh_us, ratio, rss, per_step = float(cells[1]), float(cells[2]), float(cells[3]), float(cells[6]), float(cells[7])
        assert step_us > 0 and fresh_us > 0 and ratio == pytest.approx(step_us / fresh_us, rel=0.01, abs=0.002), row
        assert rss > 0 and per_step > 0, row  # steps.jsonl and the data ledger are written every step
    # the synthetic curve has no spike: nothing to report but the one note that a stand-in model's loss has no untrained level
    assert "1 findings (LOSS_UNANCHORED)" in out, out
    assert re.search(r"per-step time at step 120 vs a fresh run's first 20 steps: \d+ us / \d+ us = \d\.\d{3}x", out), out
    assert re.search(r"RSS growth over the run: [+-]\d+\.\d MB", out), out
    assert re.search(r"harness report build time: \d+\.\d\d s \(exit 0; healthy", out), out
    verdicts = re.findall(r"\b(within|OVER) the (?:1\.10x|100 MB) budget", out)
    assert len(verdicts) == 2 and code == (0 if verdicts == ["within", "within"] else 1), out


def test_marks_are_the_issue_s_up_to_the_run_length_and_a_short_run_gets_its_own() -> None:
    assert long_run.marks_for(100_000) == [1_000, 10_000, 30_000, 100_000]
    assert long_run.marks_for(50_000) == [1_000, 10_000, 30_000, 50_000]
    assert long_run.marks_for(300) == [30, 150, 300]


def test_a_window_row_compares_the_medians_of_the_interleaved_steps() -> None:
    window = long_run.Window(walls=[0.001, 0.003, 0.002], hooks=[0.0005] * 3, fresh=[0.002, 0.004, 0.001], bytes_at_open=1000)
    row = window.row(step=10, written=1000 + 3 * 600)
    assert row["wall_us"] == pytest.approx(2000) and row["fresh_us"] == pytest.approx(2000) and row["ratio"] == pytest.approx(1.0)
    assert row["bytes_per_step"] == pytest.approx(600) and row["fresh_steps"] == 3 and row["mean_us"] == pytest.approx(2000)
