"""Rank 1 raises inside a training step on two CPU ranks (gloo): rank 0 then dies of the failed collective. The verdict
names rank 1 and its ValueError, with rank 0's gloo error as what followed, not as the cause."""
from __future__ import annotations

import pytest

from conftest import EXAMPLE, harness_cli, torchrun

pytestmark = pytest.mark.slow


def test_the_rank_that_crashed_first_is_named_not_the_gloo_error_that_followed(tmp_path) -> None:
    out = tmp_path / "crash"
    script = [str(EXAMPLE), "--output_dir", str(out), "--max_steps", "14", "--crash_rank", "1", "--crash_step", "10"]
    result = harness_cli("wrap", "--", *torchrun(), *script)
    assert result.returncode != 0, result.stderr[-4000:]
    assert "ValueError: injected crash on rank 1 at step 10" in result.stderr  # the script really crashed there

    marker = (out / "harness" / "ranks" / "attempt.rank-1").read_text(encoding="utf-8")
    assert marker.startswith("ended\n") and '"status": "crashed"' in marker and "ValueError: injected crash on rank 1 at step 10" in marker

    wanted = "training crashed after step 9: rank 1 raised ValueError: injected crash on rank 1 at step 10 (rank 0 then failed with "
    summary = result.stderr[result.stderr.index("harness wrap: summary"):]
    assert wanted in summary, summary
    explained = harness_cli("explain", str(out))
    assert explained.returncode == 0, explained.stderr
    verdict = " ".join(explained.stdout.split())
    assert wanted in verdict, verdict
    secondary = verdict[verdict.index("(rank 0 then failed with"):]
    assert secondary.startswith("(rank 0 then failed with RuntimeError:") and "Connection" in secondary, verdict
    assert "pair.cc" not in verdict  # the short form

    rebuilt = harness_cli("report", str(out))
    assert rebuilt.returncode == 0, rebuilt.stderr
    report = (out / "harness" / "report.md").read_text(encoding="utf-8")
    assert "rank 1 raised ValueError: injected crash on rank 1 at step 10" in report  # verdict and the Attempts table
    assert report.count("rank 1 raised ValueError") >= 2, report
