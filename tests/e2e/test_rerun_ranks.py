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


def test_a_nan_batch_on_rank_1_reproduces_on_its_neighbour_too(tmp_path: Path) -> None:
    out = _run(tmp_path, {"nan_batch_at_steps": [3]})
    reproduced = findings_of(out, "FAULT_REPRODUCED")
    assert reproduced and {f["step"] for f in reproduced} == {3}
    assert all(f["evidence"]["neighbour"]["losses"] == ["nan"] for f in reproduced)  # the data: NaN on the other rank too
    assert findings_of(out, "FAULT_RANK_SUSPECT") == [] and findings_of(out, "FAULT_TRANSIENT") == []


def test_a_one_shot_nan_on_two_ranks_is_transient(tmp_path: Path) -> None:
    out = _run(tmp_path, {"nonfinite_loss_at_steps": [3]})
    transient = findings_of(out, "FAULT_TRANSIENT")
    assert transient and {f["step"] for f in transient} == {3}
    assert findings_of(out, "FAULT_RANK_SUSPECT") == [] and findings_of(out, "FAULT_REPRODUCED") == []
