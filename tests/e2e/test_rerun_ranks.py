"""rerun across two processes (torchrun, DDP over gloo): a fault that stays on rank 1 is named as rank 1's."""
from __future__ import annotations

from pathlib import Path

import pytest

from conftest import FAULTS, findings_of, torchrun, wrapped_example, write_yaml

pytestmark = pytest.mark.slow


def _run(tmp_path: Path, faults: dict[str, object], steps: int = 5) -> Path:
    out = tmp_path / "run"
    config = write_yaml(tmp_path / "h.yaml", {"plugins": ["nan_guard", "rerun", FAULTS], "fault_injector": faults})
    result = wrapped_example(out, config, launcher=torchrun(2), steps=steps, save_steps=0)
    assert result.returncode == 0, result.stderr[-4000:]
    return out


def test_each_verdict_on_two_ranks_in_one_run(tmp_path: Path) -> None:
    """One 10-step two-process run, one fault per verdict (a process start costs more than the steps):
    step 3 a one-shot NaN in a forward on each rank (transient), step 5 a NaN batch on every rank (reproduced, once),
    step 7 a NaN batch on rank 1 only (reproduced: rank 0 computes it NaN too), step 9 rank 1's device (rank suspect)."""
    faults = {"nonfinite_loss_at_steps": [3], "nan_batch_at_steps": [5], "nan_batch_on_rank": 1, "nan_batch_on_rank_at_steps": [7],
              "nan_forward_on_rank": 1, "nan_forward_at_step": 9}
    out = _run(tmp_path, faults, steps=10)
    verdicts = [(f["code"], f["step"]) for f in findings_of(out) if f["code"].startswith("FAULT_")]
    assert sorted(verdicts, key=lambda v: v[1]) == [("FAULT_TRANSIENT", 3), ("FAULT_TRANSIENT", 3), ("FAULT_REPRODUCED", 5),
                                                   ("FAULT_REPRODUCED", 7), ("FAULT_RANK_SUSPECT", 9)], verdicts
    # each rank had its own one-shot NaN and recomputed its own part clean: each names itself
    assert sorted(f["rank"] for f in findings_of(out, "FAULT_TRANSIENT")) == [0, 1]

    reproduced = {f["step"]: f for f in findings_of(out, "FAULT_REPRODUCED")}
    everywhere = reproduced[5]  # both ranks reproduced their own NaN batch: one event, one finding, no neighbour check
    assert everywhere["rank"] == 0 and everywhere["evidence"]["neighbour"].startswith("not needed: all 2 ranks reproduced")
    on_rank_1 = reproduced[7]  # only rank 1's batch: rank 0 recomputes it and gets NaN too, so the data, not the device
    assert on_rank_1["rank"] == 1 and on_rank_1["evidence"]["neighbour"]["rank"] == 0
    assert on_rank_1["evidence"]["neighbour"]["losses"] == ["nan"]

    (suspect,) = findings_of(out, "FAULT_RANK_SUSPECT")
    assert suspect["rank"] == 1 and suspect["evidence"]["suspect_rank"] == 1
    assert "rank 1's device is suspect" in suspect["message"]
    neighbour = suspect["evidence"]["neighbour"]
    assert neighbour["rank"] == 0 and all(isinstance(v, float) for v in neighbour["losses"])  # rank 0 computed them clean
    assert suspect["evidence"]["original_losses"] == ["nan"] and suspect["evidence"]["rerun_losses"] == ["nan"]
    assert {(f["rank"], f["step"]) for f in findings_of(out, "NONFINITE_LOSS") if f["step"] == 9} == {(1, 9)}


def test_a_neighbour_check_failing_on_one_rank_still_meets_the_other(tmp_path: Path) -> None:
    """Rank 1's device turns a step NaN and its neighbour check fails before its first collective: rank 1 still takes
    part (sending nothing), so rank 0 is not left in the broadcast; the failure is rank 1's INTERNAL_PLUGIN_ERROR.
    Before, rank 0 waited in the broadcast until the watchdog (here after 20 s) aborted the job."""
    out = tmp_path / "run"
    config = write_yaml(tmp_path / "h.yaml", {
        "plugins": ["nan_guard", "rerun", "watchdog", FAULTS],
        "watchdog": {"floor_s": 20, "hang_action": "abort"},
        "fault_injector": {"nan_forward_on_rank": 1, "nan_forward_at_step": 3, "break_methods": ["rerun._neighbour_check"],
                           "break_on_rank": 1, "break_at_step": 3},
    })
    result = wrapped_example(out, config, launcher=torchrun(2), steps=5, save_steps=0)
    assert result.returncode == 0, result.stderr[-4000:]
    assert findings_of(out, "RANK_HANG") == []
    errors = findings_of(out, "INTERNAL_PLUGIN_ERROR")
    assert {(f["plugin"], f["rank"], f["step"]) for f in errors} == {("rerun", 1, 3)}
    assert {(f["rank"], f["step"]) for f in findings_of(out, "NONFINITE_LOSS")} == {(1, 3)}
