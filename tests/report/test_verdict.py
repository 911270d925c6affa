"""The verdict names the attempt and the step that stopped, not the highest step of any attempt (pure logic)."""
from __future__ import annotations

from pathlib import Path
from typing import Any

from harness.core.findings import Finding, Severity
from harness.report.build import attempts_with_outcome
from harness.report.record import RunRecord
from harness.report.verdict import verdict_of

T0 = 1_000_000.0


def _finding(code: str, step: int, at: float, action: str = "continue", **evidence: Any) -> Finding:
    return Finding(code=code, severity=Severity.ERROR if action != "continue" else Severity.INFO, plugin="resume_check",
                   message=f"{code} at {step}", step=step, evidence=evidence, action=action, time=at)


def _run(tmp_path: Path, attempts: list[dict[str, Any]], findings: list[Finding], steps: list[dict[str, Any]]) -> RunRecord:
    return RunRecord(run_dir=tmp_path / "harness", info={"attempts": attempts}, findings=findings, steps=steps, logs=[])


def killed_then_stopped(tmp_path: Path) -> RunRecord:
    """Attempt 1 killed at step 14 (checkpoint-10 kept); attempt 2 resumed from it, stopped by resume_check at step 11."""
    attempts = [
        {"started": T0, "resumed_from": None, "start_step": 0, "status": "running"},
        {"started": T0 + 100, "resumed_from": "/runs/clm/checkpoint-10", "start_step": 10, "status": "stopped", "end_step": 11},
    ]
    cause = _finding("RESUME_DATA_POSITION", 11, T0 + 101, action="stop")
    findings = [
        _finding("LOSS_SPIKE", 13, T0 + 13, action="save_and_stop"),  # the killed attempt's own stop request: not this stop's cause
        cause,
        Finding(code="ACTION_TAKEN", severity=Severity.INFO, plugin="harness", message="harness stopped training at step 11",
                step=11, evidence={"action": "stop", "cause": cause.id}, action="continue", time=T0 + 102),
    ]
    steps = [{"step": s, "time": T0 + s} for s in range(1, 15)] + [{"step": 11, "time": T0 + 101}]
    return _run(tmp_path, attempts, findings, steps)


def test_a_stopped_resume_is_reported_at_its_own_step_and_attempt(tmp_path: Path) -> None:
    run = killed_then_stopped(tmp_path)
    verdict = verdict_of(run)
    assert verdict.label == "failed"
    assert "the harness stopped training at step 11 after RESUME_DATA_POSITION (attempt 2, resumed from checkpoint-10)" in verdict.reason
    assert "14" not in verdict.reason  # the killed attempt's last step (the old bug: "stopped at step 14")
    assert run.last_step == 14  # the extent of the run is still known
    assert run.attempt_stop(1) == (11, ["RESUME_DATA_POSITION"])


def test_each_attempt_says_how_it_ended(tmp_path: Path) -> None:
    rows = attempts_with_outcome(killed_then_stopped(tmp_path))
    assert [r["outcome"] for r in rows] == ["never recorded its end (killed?)", "stopped by the harness at step 11 after RESUME_DATA_POSITION"]
    assert rows[1]["status"] == "stopped"  # run.json's own field is left as it was


def test_a_killed_attempt_ends_at_the_last_step_it_recorded(tmp_path: Path) -> None:
    attempts = [
        {"started": T0, "resumed_from": None, "start_step": 0, "status": "completed", "end_step": 20},
        {"started": T0 + 100, "resumed_from": "/runs/clm/checkpoint-10", "start_step": 10, "status": "running"},
    ]
    steps = [{"step": s, "time": T0 + s} for s in range(1, 21)] + [{"step": s, "time": T0 + 100 + s} for s in range(11, 14)]
    run = _run(tmp_path, attempts, [_finding("DATA_REPEATED", 14, T0 + 115)], steps)
    assert run.attempt_end_step(-1) == 14 and run.attempt_end_step(0) == 20
    reason = verdict_of(run).reason
    assert ("never reached its end at step 14 or later (the last step recorded): killed, or still running elsewhere "
            "(attempt 2, resumed from checkpoint-10)") in reason


def test_a_crash_names_its_attempt_and_step(tmp_path: Path) -> None:
    attempts = [{"started": T0, "resumed_from": None, "start_step": 0, "status": "crashed", "end_step": 6, "error": "RuntimeError: boom"}]
    reason = verdict_of(_run(tmp_path, attempts, [], [{"step": 6, "time": T0 + 6}])).reason
    assert reason.startswith("training crashed after step 6 with RuntimeError: boom (attempt 1)")


def test_a_plugin_stop_without_action_taken_still_names_its_cause(tmp_path: Path) -> None:
    attempts = [{"started": T0, "resumed_from": None, "start_step": 0, "status": "stopped", "end_step": 4}]
    stop = Finding(code="PLUGIN_STOP", severity=Severity.ERROR, plugin="probe", message="stop", step=4, action="continue", time=T0 + 4)
    assert "stopped training at step 4 after PLUGIN_STOP (attempt 1)" in verdict_of(_run(tmp_path, attempts, [stop], [])).reason


def test_a_run_without_run_json_keeps_the_old_wording(tmp_path: Path) -> None:
    run = _run(tmp_path, [], [], [{"step": 3}])
    assert verdict_of(run).reason.startswith("no record of how training ended (run.json missing)")
    (tmp_path / "harness").mkdir()
    (tmp_path / "harness" / "run.json").write_text('{"attempts": [{"started": 1', encoding="utf-8")  # cut off mid-write
    run = RunRecord.load(tmp_path / "harness")
    assert verdict_of(run).reason.startswith("no record of how training ended (run.json could not be read)")
    (tmp_path / "harness" / "run.json").write_text('{"attempts": []}', encoding="utf-8")
    run = RunRecord.load(tmp_path / "harness")
    assert verdict_of(run).reason.startswith("no record of how training ended (run.json records no attempt that ended)")


def test_a_policy_loss_that_does_not_fall_is_no_symptom(tmp_path: Path) -> None:
    """GRPO's (and DPO's) loss is no progress signal: "loss-not-decreasing" is for token losses only."""
    from harness.report.verdict import symptoms_of

    steps = [{"step": s, "loss": -0.3 + 0.002 * s} for s in range(1, 41)]  # flat to slightly rising
    token = _run(tmp_path / "lm", [], [], steps)
    token.info.update({"trainer": "Trainer", "stage": "causal-lm"})
    policy = _run(tmp_path / "grpo", [], [], steps)
    policy.info.update({"trainer": "GRPOTrainer", "stage": "grpo"})
    assert [s.topic for s in symptoms_of(token)] == ["loss-not-decreasing"]
    assert [s.topic for s in symptoms_of(policy)] == []


def test_an_interrupt_is_no_crash_also_in_an_older_run_json(tmp_path: Path) -> None:
    for status, error in (("interrupted", "KeyboardInterrupt: "), ("crashed", "KeyboardInterrupt: ")):  # new, and as older runs wrote it
        attempts = [{"started": T0, "resumed_from": None, "start_step": 0, "status": status, "end_step": 56, "error": error}]
        run = _run(tmp_path, attempts, [], [{"step": 56, "time": T0 + 56}])
        verdict = verdict_of(run)
        assert verdict.label == "failed"
        assert verdict.reason.startswith("training was interrupted (Ctrl-C / SIGINT) after step 56 (attempt 1);"), verdict.reason
        assert "crashed" not in verdict.reason and "KeyboardInterrupt" not in verdict.reason
        (row,) = attempts_with_outcome(run)
        assert row["outcome"] == "interrupted (Ctrl-C / SIGINT)" and row["error"] == "KeyboardInterrupt"
        assert row["status"] == status  # run.json's own field is left as it was


def test_an_exception_without_a_message_shows_its_type_alone(tmp_path: Path) -> None:
    attempts = [{"started": T0, "resumed_from": None, "start_step": 0, "status": "crashed", "end_step": 6, "error": "RuntimeError: "}]
    reason = verdict_of(_run(tmp_path, attempts, [], [{"step": 6, "time": T0 + 6}])).reason
    assert reason.startswith("training crashed after step 6 with RuntimeError (attempt 1);"), reason
