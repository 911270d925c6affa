"""preemption across two processes (torchrun, DDP over gloo): SIGTERM on rank 1 alone stops both ranks at one checkpoint.

torchrun forwards a SIGTERM sent to itself to every worker; here the signal
reaches rank 1 only (it signals itself in the middle of step 4, as a
scheduler's notice to one node would), so only the guard's agreement can
stop rank 0. Then a two-process resume from that checkpoint is silent.
"""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from conftest import FAULTS, findings_of, torchrun, wrapped_example, write_yaml
from harness.lib.stops import EXIT_STOPPED

pytestmark = pytest.mark.slow

STEP = 4


def test_sigterm_on_rank_1_checkpoints_both_ranks_at_one_step_and_the_resume_is_silent(tmp_path: Path) -> None:
    out = tmp_path / "run"
    faults = {"signal_at_step": STEP, "signal_on_rank": 1, "signal_name": "SIGTERM"}
    config = write_yaml(tmp_path / "h.yaml", {"plugins": ["defaults", FAULTS], "fault_injector": faults})
    result = wrapped_example(out, config, launcher=torchrun(2), steps=8, save_steps=0)
    # every rank exited 0 (torchrun says so), and wrap turns the harness stop into 75
    assert result.returncode == EXIT_STOPPED, result.stderr[-4000:]
    assert "(the command itself exited 0)" in result.stderr and f"stopped training at step {STEP}" in result.stderr
    assert (out / "harness" / "signalled.rank-1").exists() and not (out / "harness" / "signalled.rank-0").exists()

    checkpoint = out / f"checkpoint-{STEP}"
    assert sorted(p.name for p in out.glob("checkpoint-*")) == [checkpoint.name]  # one checkpoint, the same step on both ranks
    for name in ("model.safetensors", "optimizer.pt", "scheduler.pt", "rng_state_0.pth", "rng_state_1.pth", "trainer_state.json",
                 "harness_state/rank-0.json", "harness_state/rank-1.json"):
        assert (checkpoint / name).stat().st_size > 0, name
    assert json.loads((checkpoint / "trainer_state.json").read_text())["global_step"] == STEP

    (preempted,) = findings_of(out, "PREEMPTED")
    assert preempted["rank"] == 1 and preempted["step"] == STEP and preempted["action"] == "continue"
    assert preempted["evidence"]["signal"] == "SIGTERM" and preempted["evidence"]["checkpoint"] == str(checkpoint)
    (taken,) = findings_of(out, "ACTION_TAKEN")  # rank 0 applied the update of the interrupted step, then saved
    assert taken["evidence"]["update_applied"] is True and "PREEMPTED" in taken["message"]
    assert [f["code"] for f in findings_of(out) if f["severity"] not in ("info", "debug")] == []

    resume = write_yaml(tmp_path / "resume.yaml", {})
    again = wrapped_example(out, resume, "--resume_from_checkpoint", str(checkpoint), launcher=torchrun(2), steps=8, save_steps=0)
    assert again.returncode == 0, again.stderr[-4000:]
    steps = [json.loads(line)["step"] for line in (out / "harness" / "steps.jsonl").read_text().splitlines() if line.strip()]
    assert steps[-1] == 8
    loud = [(f["code"], f["rank"], f["step"]) for f in findings_of(out) if f["severity"] not in ("info", "debug")]
    assert loud == [] and [f["code"] for f in findings_of(out) if f["code"].startswith(("RESUME_", "DATA_"))] == []
