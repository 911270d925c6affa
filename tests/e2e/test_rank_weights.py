"""Two processes on CPU (gloo): what one rank does to its own weights after DDP wrapped the model is seen by grad_sync.

A parameter frozen on rank 1 only (``requires_grad_(False)`` after wrapping) keeps the reduced gradients bit-identical:
DDP still all-reduces it, rank 1 adding zeros. Only the ranks' ``requires_grad`` flags tell, and grad_sync compares them.
"""
from __future__ import annotations

from pathlib import Path

import pytest

from conftest import findings_of, read_jsonl, torchrun, wrapped_example, write_yaml

pytestmark = pytest.mark.slow
FROZEN = "model.layers.0.mlp.up_proj.weight"


def test_a_parameter_frozen_on_one_rank_after_wrapping_is_a_grad_desync(tmp_path: Path) -> None:
    out = tmp_path / "run"
    config = write_yaml(tmp_path / "h.yaml", {"plugins": ["grad_sync"], "grad_sync": {"every": 5}})
    freeze = ["--freeze_rank", "1", "--freeze_step", "12", "--freeze_param", FROZEN]
    result = wrapped_example(out, config, *freeze, launcher=torchrun(), steps=20, save_steps=0)
    assert result.returncode == 0, result.stderr[-4000:]
    checks = read_jsonl(out / "harness" / "grad_sync.jsonl")
    assert [(c["step"], c["in_sync"]) for c in checks] == [(1, True), (5, True), (10, True), (15, False), (20, False)]
    found = findings_of(out, "GRAD_DESYNC")
    assert [f["step"] for f in found] == [15, 20] and {f["rank"] for f in found} == {0}
    first = found[0]
    assert f"{FROZEN} is frozen on rank 1 only (requires_grad False there, True on rank 0)" in first["message"]
    evidence = first["evidence"]
    assert evidence["ranks"] == [1] and evidence["compared"] == "requires_grad" and evidence["diverging_tensors"] == 1
    (tensor,) = evidence["tensors"]
    assert (tensor["tensor"], tensor["frozen_on_ranks"], tensor["trained_on_ranks"]) == (FROZEN, [1], [0])
    assert "GRAD_DESYNC" in result.stderr  # the console line, and the closing summary


def test_a_rank_whose_weight_went_nan_is_blamed_on_its_weights_not_its_device(tmp_path: Path) -> None:
    """A NaN written into rank 1's o_proj weight (after DDP wrapped the model: rank 0's stays finite). From the next step
    rank 1's forward is NaN; nan_guard names the weight, and rerun's neighbour (rank 0, with its own finite weights)
    computes the batch clean. That said 'rank 1's device is suspect' (FAULT_RANK_SUSPECT): it is rank 1's model state."""
    out = tmp_path / "run"
    config = write_yaml(tmp_path / "h.yaml", {
        "plugins": ["defaults", "harness.testing:FaultInjector"],
        "fault_injector": {"nan_param_at_step": 3, "nan_param_on_rank": 1},
    })
    result = wrapped_example(out, config, launcher=torchrun(), steps=5, save_steps=0)
    assert result.returncode in (0, 75), result.stderr[-4000:]
    losses = [f for f in findings_of(out, "NONFINITE_LOSS") if f["rank"] == 1]
    assert losses and losses[0]["step"] == 4, [(f["rank"], f["step"]) for f in findings_of(out, "NONFINITE_LOSS")]
    named = losses[0]["evidence"]["nonfinite_params_of_module"]
    assert named and named[0]["rank"] == 1 and named[0]["param"].endswith("o_proj.weight"), named
    assert findings_of(out, "FAULT_RANK_SUSPECT") == []
    reproduced = [f for f in findings_of(out, "FAULT_REPRODUCED") if f["step"] == 4 and f["rank"] == 1]
    assert reproduced and "weights already hold NaN/Inf" in reproduced[0]["message"], [f["message"] for f in findings_of(out)]
