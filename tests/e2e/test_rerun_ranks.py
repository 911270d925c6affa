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


def test_a_rank_1_only_corruption_is_named_rank_suspect(tmp_path: Path) -> None:
    out = _run(tmp_path, {"nan_forward_on_rank": 1, "nan_forward_at_step": 3})
    (suspect,) = findings_of(out, "FAULT_RANK_SUSPECT")
    assert suspect["step"] == 3 and suspect["rank"] == 1 and suspect["evidence"]["suspect_rank"] == 1
    assert "rank 1's device is suspect" in suspect["message"]
    neighbour = suspect["evidence"]["neighbour"]
    assert neighbour["rank"] == 0 and all(isinstance(v, float) for v in neighbour["losses"])  # rank 0 computed them clean
    assert suspect["evidence"]["original_losses"] == ["nan"] and suspect["evidence"]["rerun_losses"] == ["nan"]
    assert findings_of(out, "FAULT_REPRODUCED") == [] and findings_of(out, "FAULT_TRANSIENT") == []
    (loss,) = findings_of(out, "NONFINITE_LOSS")
    assert loss["rank"] == 1 and loss["step"] == 3


def test_a_nan_batch_reproduces_on_the_neighbour_too_and_on_every_rank_is_one_finding(tmp_path: Path) -> None:
    out = _run(tmp_path, {"nan_batch_at_steps": [3], "nan_batch_on_rank": 1, "nan_batch_on_rank_at_steps": [5]}, steps=6)
    reproduced = {f["step"]: f for f in findings_of(out, "FAULT_REPRODUCED")}
    assert sorted(reproduced) == [3, 5] and len(findings_of(out, "FAULT_REPRODUCED")) == 2
    everywhere = reproduced[3]  # both ranks reproduced their own NaN batch: one event, one finding, no neighbour check
    assert everywhere["rank"] == 0 and everywhere["evidence"]["neighbour"].startswith("not needed: all 2 ranks reproduced")
    on_rank_1 = reproduced[5]  # only rank 1's batch: rank 0 recomputes it and gets NaN too, so the data, not the device
    assert on_rank_1["rank"] == 1 and on_rank_1["evidence"]["neighbour"]["rank"] == 0
    assert on_rank_1["evidence"]["neighbour"]["losses"] == ["nan"]
    assert findings_of(out, "FAULT_RANK_SUSPECT") == [] and findings_of(out, "FAULT_TRANSIENT") == []


def test_a_one_shot_nan_on_two_ranks_is_transient(tmp_path: Path) -> None:
    out = _run(tmp_path, {"nonfinite_loss_at_steps": [3]})
    transient = findings_of(out, "FAULT_TRANSIENT")
    assert transient and {f["step"] for f in transient} == {3}
    assert findings_of(out, "FAULT_RANK_SUSPECT") == [] and findings_of(out, "FAULT_REPRODUCED") == []
