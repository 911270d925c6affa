"""nan_guard across two processes (torchrun, DDP over gloo): gradients made non-finite by another rank are not blamed on this one.

Under DDP the gradient all-reduce carries one rank's NaN to every rank, so a rank whose own losses were all finite
still sees a NaN gradient norm. Its NONFINITE_GRAD (written at once, before the ranks meet) must say that its own
backward did not make the NaN and that it may come from another rank, not call it a transient fault of this rank; the
report, which reads every rank's findings, names the rank where the step started.
"""
from __future__ import annotations

from pathlib import Path

import pytest

from conftest import FAULTS, findings_of, read_jsonl, torchrun, wrapped_example, write_yaml
from harness.core.console import shorten

pytestmark = pytest.mark.slow


def test_a_nan_loss_on_rank_1_is_traced_to_rank_1_and_a_gradient_fault_everywhere_to_no_rank(tmp_path: Path) -> None:
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
    # rank 0's NaN gradients came from rank 1 through the all-reduce: its own backward is cleared, not called transient
    (grad_3,) = [f for f in findings_of(out, "NONFINITE_GRAD") if f["step"] == 3]
    assert grad_3["rank"] == 0 and grad_3["evidence"]["world_size"] == 2, grad_3
    assert grad_3["evidence"]["reproduced_in_backward"] is False, grad_3["evidence"]
    assert "did not make the NaN" in grad_3["message"] and "all-reduce" in grad_3["message"], grad_3["message"]
    assert "not reproduced: a transient fault" not in grad_3["message"], grad_3["message"]
    # the verdict leads: the live console line (the message's start) already clears rank 0
    assert "not made by this rank's own data or backward" in shorten(grad_3["message"]), shorten(grad_3["message"])
    assert [(f["rank"], f["step"]) for f in findings_of(out, "FAULT_REPRODUCED")] == [(1, 3)]

    # steps 5-7: no rank's loss was non-finite; every rank reports its own NONFINITE_GRAD, the steps are skipped, the
    # third in a row escalates
    late = sorted((f["step"], f["rank"], f["action"]) for f in findings_of(out, "NONFINITE_GRAD") if f["step"] >= 5)
    assert late == [(5, 0, "skip_step"), (5, 1, "skip_step"), (6, 0, "skip_step"), (6, 1, "skip_step"),
                    (7, 0, "save_and_stop"), (7, 1, "save_and_stop")], late
    for rank in (0, 1):
        snaps = {r["step"]: r for r in read_jsonl(out / "harness" / f"fault_injector.rank-{rank}.jsonl")}
        for step in (3, 5):
            assert snaps[step]["skipped"] and snaps[step]["params_changed"] == [], (rank, step, snaps[step])
    taken = [(f["step"], f["evidence"].get("action")) for f in findings_of(out, "ACTION_TAKEN")]
    assert taken == [(3, "skip_step"), (5, "skip_step"), (6, "skip_step"), (7, "save_and_stop")], taken
    assert (out / "checkpoint-7").is_dir() and not (out / "checkpoint-9").exists()

    # the report reads every rank's findings: step 3 started on rank 1, steps 5-7 on no rank's own computation
    report = (out / "harness" / "report.md").read_text(encoding="utf-8")
    section = report[report.index("## Non-finite steps"):]
    section = section[: section.find("\n## ", 1) if "\n## " in section[1:] else len(section)]
    assert "| 3 | 1 | 0 | rank 1: its own loss" in section, section
    for step in (5, 6, 7):
        assert f"| {step} | - | 0, 1 | no rank: every rank's own backward, rerun, is finite" in section, section
