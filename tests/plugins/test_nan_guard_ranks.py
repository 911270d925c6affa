"""nan_guard across two processes (torchrun, DDP over gloo): gradients made non-finite by another rank are named as that rank's.

Under DDP the gradient all-reduce carries one rank's NaN to every rank, so a rank whose own losses were all finite
still sees a NaN gradient norm. Its NONFINITE_GRAD must name the rank whose loss was non-finite (the step exchange
tells it) instead of blaming itself with a "transient fault".
"""
from __future__ import annotations

from pathlib import Path

import pytest

from conftest import FAULTS, findings_of, read_jsonl, torchrun, wrapped_example, write_yaml

pytestmark = pytest.mark.slow


def test_a_nan_loss_on_rank_1_is_named_by_rank_0_and_a_gradient_fault_everywhere_is_still_skipped(tmp_path: Path) -> None:
    """One run (a process start costs more than the steps): step 3 a NaN batch on rank 1 only; steps 5, 6 and 7 infinite
    gradients on both ranks (no loss non-finite), the third in a row escalating to save_and_stop."""
    from harness.lib.stops import EXIT_STOPPED

    out = tmp_path / "run"
    faults = {"nan_batch_on_rank": 1, "nan_batch_on_rank_at_steps": [3], "inf_grad_at_steps": [5, 6, 7], "snapshot_steps": [3, 5]}
    config = write_yaml(tmp_path / "h.yaml", {"plugins": ["nan_guard", "rerun", FAULTS], "fault_injector": faults})
    result = wrapped_example(out, config, launcher=torchrun(2), steps=9, save_steps=0)
    assert result.returncode == EXIT_STOPPED, result.stderr[-4000:]

    # step 3: rank 1's own loss is NaN (the culprit, an error that skips the step)
    (loss,) = findings_of(out, "NONFINITE_LOSS")
    assert (loss["rank"], loss["step"], loss["severity"], loss["action"]) == (1, 3, "error", "skip_step")
    # rank 0's NaN gradients came from rank 1 through the all-reduce: named, not blamed on rank 0, not "transient"
    (grad_3,) = [f for f in findings_of(out, "NONFINITE_GRAD") if f["step"] == 3]
    assert grad_3["rank"] == 0 and grad_3["severity"] == "info", grad_3
    assert grad_3["evidence"]["nonfinite_loss_on_ranks"] == [1], grad_3["evidence"]
    assert "rank 1" in grad_3["message"] and "all-reduce" in grad_3["message"], grad_3["message"]
    assert "transient" not in grad_3["message"], grad_3["message"]
    # the skip is rank 1's NONFINITE_LOSS's: the harness's record of the action names it, not rank 0's consequence
    (taken_3,) = [f for f in findings_of(out, "ACTION_TAKEN") if f["step"] == 3]
    assert "NONFINITE_LOSS" in taken_3["message"] and "rank 1" in taken_3["message"], taken_3["message"]
    # rank 0 recomputing its own clean batch is no fault of the machine either
    assert not [f for f in findings_of(out, "FAULT_TRANSIENT") if f["step"] == 3]
    assert [(f["rank"], f["step"]) for f in findings_of(out, "FAULT_REPRODUCED")] == [(1, 3)]

    # steps 5-7: no rank's loss was non-finite; every rank reports its own NONFINITE_GRAD as an error, and its action is
    # taken on every rank although the finding is written after the ranks agreed (the ask goes to the agreement before)
    late = sorted((f["step"], f["rank"], f["severity"], f["action"]) for f in findings_of(out, "NONFINITE_GRAD") if f["step"] >= 5)
    assert late == [(5, 0, "error", "skip_step"), (5, 1, "error", "skip_step"), (6, 0, "error", "skip_step"), (6, 1, "error", "skip_step"),
                    (7, 0, "error", "save_and_stop"), (7, 1, "error", "save_and_stop")], late
    for finding in findings_of(out, "NONFINITE_GRAD"):
        if finding["step"] >= 5:
            evidence = finding["evidence"]
            assert evidence["nonfinite_loss_on_ranks"] == [] and evidence["nonfinite_grad_on_ranks"] == [0, 1] and evidence["from_ranks"] == []
            assert "not reproduced anywhere" in finding["message"], finding["message"]  # every rank reran its own backward clean
    for rank in (0, 1):
        snaps = {r["step"]: r for r in read_jsonl(out / "harness" / f"fault_injector.rank-{rank}.jsonl")}
        for step in (3, 5):
            assert snaps[step]["skipped"] and snaps[step]["params_changed"] == [], (rank, step, snaps[step])
    taken = [(f["step"], f["evidence"].get("action")) for f in findings_of(out, "ACTION_TAKEN")]
    assert taken == [(3, "skip_step"), (5, "skip_step"), (6, "skip_step"), (7, "save_and_stop")], taken
    assert (out / "checkpoint-7").is_dir() and not (out / "checkpoint-9").exists()
