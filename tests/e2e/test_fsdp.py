"""FSDP2 (``fully_shard``) on 2 gloo processes: grad_sync, nan_guard, resume_check and run_card on sharded DTensor state.

accelerate refuses FSDP on CPU, so ``fsdp_driver.py`` runs a tiny Llama whose decoder layers and root are
``fully_shard``-ed in a loop shaped like the Trainer's, with ``harness.attach`` wrapping it as it wraps a Trainer.
The faults are real and on one rank: a reduced gradient shard scaled by 1.5 after the reduce-scatter, a NaN loss, one
ulp added to a weight shard (HSDP), a weight shard changed after a checkpoint was loaded.
"""
from __future__ import annotations

import json
import os
import shutil
import subprocess
from pathlib import Path
from typing import Any

import pytest

from conftest import REPO, findings_of, read_jsonl, torchrun, write_yaml
from fsdp_driver import PERTURBED, VOCAB

DRIVER = Path(__file__).with_name("fsdp_driver.py")
ENV = {"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false", "OMP_NUM_THREADS": "1"}
CORE = ["grad_sync", "nan_guard", "run_card", "metrics_log"]


def _drive(out: Path, config: dict[str, Any], *extra: str) -> None:
    path = write_yaml(out.parent / f"{out.name}.harness.yaml", config)
    result = subprocess.run(
        [*torchrun(), str(DRIVER), "--out", str(out), "--config", str(path), *extra],
        cwd=REPO, env={**os.environ, **ENV}, capture_output=True, text=True, timeout=300,
    )
    assert result.returncode == 0, result.stderr[-4000:]


def _loud(out: Path) -> list[tuple[str, int | None, int | None]]:
    return [(f["code"], f["rank"], f["step"]) for f in findings_of(out) if f["severity"] in ("warning", "error", "critical")]


def _full_parameter_count() -> int:
    from transformers import LlamaForCausalLM

    from harness.lib.tiny import tiny_llama_config

    return sum(p.numel() for p in LlamaForCausalLM(tiny_llama_config(VOCAB, hidden_size=32, num_layers=2)).parameters())


@pytest.fixture(scope="module")
def clean_run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """6 clean steps under the default plugins (grad_sync at every step), a checkpoint at step 4."""
    out = tmp_path_factory.mktemp("fsdp2") / "clean"
    _drive(out, {"plugins": ["defaults"], "grad_sync": {"every": 1}}, "--steps", "6", "--save_steps", "4")
    return out


@pytest.mark.slow
def test_clean_fsdp2_run_is_silent_counts_full_parameters_and_resumes_clean(clean_run: Path, tmp_path: Path) -> None:
    out = clean_run
    assert _loud(out) == []
    (refusal,) = findings_of(out, "GRAD_SYNC_UNSUPPORTED")  # weights are not compared, and it says so once
    assert refusal["severity"] == "info" and refusal["evidence"]["parallelism"] == "FSDP2 (fully_shard), 2 shards"
    assert refusal["evidence"]["compared"] == ["gradient shards"]
    checks = read_jsonl(out / "harness" / "grad_sync.jsonl")
    assert [c["step"] for c in checks] == [1, 2, 3, 4, 5, 6] and all(c["in_sync"] for c in checks)
    assert checks[0]["slices_compared"] == 0 and all(c["slices_compared"] > 20 for c in checks[1:])  # shards exist after step 1
    assert all(c["params_compared"] == 0 for c in checks)
    card = json.loads((out / "harness" / "run_card.json").read_text())
    assert card["parameters"] == card["trainable_parameters"] == _full_parameter_count()  # the model's, not a shard's
    assert card["sharding"] == "FSDP2 (fully_shard), 2 shards" and card["zero_stage"] == 3

    resumed = tmp_path / "resumed"
    shutil.copytree(out, resumed)
    _drive(resumed, {"plugins": ["defaults"], "grad_sync": {"every": 1}}, "--steps", "6", "--resume", str(resumed / "checkpoint-4"))
    assert _loud(resumed) == []  # sharded weights and Adam moments fingerprinted per rank: they came back as saved
    assert not [f for f in findings_of(resumed) if f["code"].startswith("RESUME_")]
    assert [r["step"] for r in read_jsonl(resumed / "driver.rank-1.jsonl")][-2:] == [5, 6]


@pytest.mark.slow
def test_a_weight_shard_changed_after_loading_stops_the_resume_on_that_rank(clean_run: Path, tmp_path: Path) -> None:
    resumed = tmp_path / "resumed"
    shutil.copytree(clean_run, resumed)
    _drive(resumed, {"plugins": CORE + ["resume_check", "data_hash"]}, "--steps", "6", "--resume",
           str(resumed / "checkpoint-4"), "--perturb_after_load", "--fault_rank", "1")
    (mismatch,) = findings_of(resumed, "RESUME_MODEL_MISMATCH")
    assert mismatch["rank"] == 1 and mismatch["step"] == 4 and mismatch["evidence"]["tensors"] == [PERTURBED]
    assert mismatch["action"] == "stop"
    assert not findings_of(resumed, "RESUME_OPTIMIZER_NOT_RESTORED")
    for rank in (0, 1):  # stopped before its first update, on every rank
        assert [r["step"] for r in read_jsonl(resumed / f"driver.rank-{rank}.jsonl")][-1] == 5
        assert read_jsonl(resumed / f"driver.rank-{rank}.jsonl")[-1]["params_changed"] is False


@pytest.mark.slow
def test_fsdp2_reduce_scatter_fault_is_found_on_its_shard_and_a_nan_step_is_skipped_on_every_rank(tmp_path: Path) -> None:
    out = tmp_path / "faults"
    _drive(out, {"plugins": CORE, "grad_sync": {"every": 1}}, "--steps", "5", "--scale_grad_step", "3", "--nan_step", "4")
    (desync,) = findings_of(out, "GRAD_DESYNC")
    assert desync["step"] == 3 and desync["evidence"]["ranks"] == [1] and desync["evidence"]["diverging_tensors"] == 1
    (slice_,) = desync["evidence"]["tensors"]
    assert slice_["tensor"] == PERTURBED and slice_["slice"] == [512, 1024]  # rank 1's rows 16..31 of a 32 x 32 weight
    assert abs(slice_["owner_sum"] / slice_["expected_sum"] - 1.5) < 1e-3
    assert [c["in_sync"] for c in read_jsonl(out / "harness" / "grad_sync.jsonl")] == [True, True, False, True, True]
    (loss,) = findings_of(out, "NONFINITE_LOSS")
    assert (loss["rank"], loss["step"], loss["action"]) == (1, 4, "skip_step")
    assert [(f["rank"], f["step"]) for f in findings_of(out, "NONFINITE_GRAD")] == [(0, 4)]  # the NaN reached rank 0's shard
    for rank in (0, 1):
        steps = {r["step"]: r for r in read_jsonl(out / f"driver.rank-{rank}.jsonl")}
        assert steps[4]["skipped"] and not steps[4]["params_changed"] and not steps[4]["optimizer_changed"]
        assert steps[3]["params_changed"] and steps[5]["params_changed"] and steps[5]["optimizer_changed"]
        assert steps[3]["lr"] == steps[4]["lr"] != steps[5]["lr"]  # the schedule held still on the skipped step


@pytest.mark.slow
def test_hsdp_replicas_of_a_shard_are_compared_bit_for_bit(tmp_path: Path) -> None:
    out = tmp_path / "hsdp"
    _drive(out, {"plugins": CORE, "grad_sync": {"every": 1}}, "--mesh", "hsdp", "--steps", "5", "--perturb_step", "2",
           "--scale_grad_step", "4")
    assert not findings_of(out, "GRAD_SYNC_UNSUPPORTED")
    params = findings_of(out, "PARAM_DESYNC")
    assert [f["step"] for f in params] == [2, 3, 4, 5] and {tuple(f["evidence"]["ranks"]) for f in params} == {(1,)}
    assert params[0]["evidence"]["tensors"][0]["tensor"] == PERTURBED and params[0]["evidence"]["replica_groups"] == [[0, 1]]
    (grads,) = findings_of(out, "GRAD_DESYNC")
    assert grads["step"] == 4 and grads["evidence"]["ranks"] == [1] and grads["evidence"]["diverging_tensors"] == 1
    checks = read_jsonl(out / "harness" / "grad_sync.jsonl")
    assert checks[0]["in_sync"] and checks[0]["params_compared"] == checks[0]["grads_compared"] == 21

