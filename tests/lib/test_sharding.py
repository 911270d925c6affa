"""harness.lib.sharding and the fingerprints on real FSDP2 and FSDP1 models: 2 gloo processes, a 66-parameter MLP.

Summed over the ranks, every rank's fingerprints of its own shards equal the unsharded model's: no collective, no
double counting, padding ignored. The full parameter count is the model's on every rank, whichever FSDP.
"""
from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest
import torch

from conftest import REPO, torchrun
from harness.lib.sharding import Sharding, is_dtensor, local_tensor, model_is_sharded, model_sharding, replicated_local

PROBE = Path(__file__).with_name("sharding_probe.py")


def _unsharded() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(5, 7), torch.nn.ReLU(), torch.nn.Linear(7, 3))


def test_plain_tensors_and_models_are_not_sharded() -> None:
    model = _unsharded()
    weight = model[0].weight
    assert not is_dtensor(weight) and local_tensor(weight) is weight and replicated_local(weight) is weight
    assert local_tensor(None) is None
    assert model_sharding(model) == Sharding() and model_sharding(model).describe() == "no FSDP"


def test_only_sharded_state_counts_as_sharded_for_a_resume_with_another_world_size() -> None:
    class Holder:  # what resume_check reads of a Trainer: its model and wrapped model
        def __init__(self, model: torch.nn.Module) -> None:
            self.model = self.model_wrapped = model

    model = _unsharded()
    assert not model_is_sharded(Holder(model))
    model[0].weight.ds_numel = model[0].weight.numel()  # what DeepSpeed ZeRO-3 puts on its partitioned parameters
    assert model_is_sharded(Holder(model))


def _json_objects(text: str) -> list[dict]:
    """Every JSON object printed by either rank: two ranks writing to one pipe may share a line."""
    decoder, rows, at = json.JSONDecoder(), [], text.find("{")
    while at != -1:
        try:
            row, end = decoder.raw_decode(text, at)
        except json.JSONDecodeError:
            at = text.find("{", at + 1)
            continue
        rows.append(row)
        at = text.find("{", end)
    return rows


@pytest.mark.slow
def test_fsdp2_and_fsdp1_shards_add_up_to_the_model_on_two_ranks() -> None:
    result = subprocess.run([*torchrun(), str(PROBE)], cwd=REPO, capture_output=True, text=True, timeout=120,
                            env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert result.returncode == 0, result.stderr[-3000:]
    rows = _json_objects(result.stdout)
    full = [p.detach() for p in _unsharded().parameters()]
    full_sum = sum(float(p.double().sum()) for p in full)
    full_squares = sum(float(p.double().square().sum()) for p in full)
    for layout, kind in (("fsdp2", "fsdp2"), ("fsdp1", "fsdp1"), ("fsdp1_orig", "fsdp1")):
        ranks = sorted((r for r in rows if r["layout"] == layout), key=lambda r: r["rank"])
        assert [r["rank"] for r in ranks] == [0, 1], layout
        assert {r["kind"] for r in ranks} == {kind} and {r["shard_size"] for r in ranks} == {2}
        assert {(r["total"], r["trainable"]) for r in ranks} == {(66, 66)}, layout  # the model's, not the shard's
        assert sum(r["sum"] for r in ranks) == pytest.approx(full_sum, abs=1e-9), layout
        assert sum(r["squares"] for r in ranks) == pytest.approx(full_squares, rel=1e-12), layout
    fsdp2 = [r for r in rows if r["layout"] == "fsdp2"]
    assert [r["local_numel"] for r in sorted(fsdp2, key=lambda r: r["rank"])] == [40, 26]  # 7 rows split 4 + 3, 3 rows 2 + 1
    assert {r["norm_plain"] for r in fsdp2} == {"Tensor"} and len({r["norm"] for r in fsdp2}) == 1  # the replicated global norm
