"""The loss and grad-norm plots mark spike findings on their step records in one pass over the steps (O(steps + findings))."""
from __future__ import annotations

from pathlib import Path
from typing import Any

from harness.core.findings import Finding, Severity
from harness.report.plots import record_of, records_of
from harness.report.record import RunRecord


class CountingSteps(list):  # type: ignore[type-arg]
    """A step list that counts how often it is walked: the report must not walk it once per finding."""

    walks = 0

    def __iter__(self) -> Any:
        CountingSteps.walks += 1
        return super().__iter__()


def _run(steps: list[dict[str, Any]], findings: list[Finding]) -> RunRecord:
    return RunRecord(run_dir=Path("unused"), info={}, findings=findings, steps=CountingSteps(steps), logs=[])


def _finding(step: int | None, at: float) -> Finding:
    return Finding("LOSS_SPIKE", Severity.WARNING, "spike_capture", "a spike", step=step, time=at)


def test_records_of_picks_what_record_of_picks_including_a_replayed_step() -> None:
    # steps 1-6, then a resume replays 4-6 later; the finding at 5 after the resume takes the replayed record
    steps = [{"step": s, "loss": 1.0, "time": float(s)} for s in range(1, 7)]
    steps += [{"step": s, "loss": 2.0, "time": 100.0 + s} for s in range(4, 7)]
    findings = [_finding(2, 2.0), _finding(5, 5.0), _finding(5, 105.0), _finding(99, 1.0), _finding(None, 1.0)]
    run = _run(steps, findings)
    expected = [r for f in findings if (r := record_of(run, f)) is not None]
    assert [r["time"] for r in expected] == [2.0, 5.0, 105.0]
    assert records_of(run, findings) == expected


def test_records_of_walks_the_steps_once_whatever_the_number_of_findings() -> None:
    run = _run([{"step": s, "loss": 1.0, "time": float(s)} for s in range(1, 2001)], [])
    findings = [_finding(s, float(s)) for s in range(1, 2001, 10)]
    CountingSteps.walks = 0
    picked = records_of(run, findings)
    assert len(picked) == len(findings) and CountingSteps.walks == 1
    CountingSteps.walks = 0
    assert records_of(run, []) == [] and CountingSteps.walks == 0
