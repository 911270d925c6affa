"""grad_sync: data-parallel replicas compared every N steps, under DDP and DeepSpeed ZeRO-2 on 2 CPU processes.

The faults are real: one ulp added to one weight on rank 1 (a replica drifts), a communication hook (DDP) or a
post-reduction scale of rank 1's gradient partition (ZeRO-2) that makes rank 1's reduced gradient 1.5x too large,
a hand-built data loader that feeds every rank the same rows, and a dataset that is slow on rank 1 only.
"""
from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

import harness
from conftest import REPO, RankZeroCtx, findings_of, read_jsonl, torchrun, wrapped_example, write_yaml
from harness.lib.fingerprints import exact_fingerprints
from harness.lib.stops import EXIT_STOPPED

SYNC_CODES = ("GRAD_DESYNC", "PARAM_DESYNC", "RANK_INPUTS_IDENTICAL", "STRAGGLER_RANK", "GRAD_SYNC_UNSUPPORTED")
ZERO2 = ["--deepspeed", str(REPO / "examples" / "ds_zero2.json")]
PERTURBED = "model.layers.0.self_attn.o_proj.weight"


def _sync_findings(out: Path) -> list[dict[str, Any]]:
    return [f for f in findings_of(out) if f["code"] in SYNC_CODES]


def _run(tmp_path: Path, harness_config: dict[str, Any], *extra: str, steps: int = 25, exit_code: int = 0) -> Path:
    out = tmp_path / "run"
    config = write_yaml(tmp_path / "harness.yaml", harness_config)
    result = wrapped_example(out, config, *extra, launcher=torchrun(), steps=steps, save_steps=0)
    assert result.returncode == exit_code, result.stderr[-4000:]
    return out


def test_exact_fingerprints_see_one_ulp_in_one_element() -> None:
    weights = torch.randn(64, 64)
    drifted = weights.clone()
    drifted.view(-1)[1234] = torch.nextafter(drifted.view(-1)[1234], torch.tensor(float("inf")))
    a, b, missing = exact_fingerprints([weights, drifted, None])
    assert a != b and a[0] - b[0] in (1, -1)  # the bit sum moves by exactly one
    assert missing is None and exact_fingerprints([weights.clone()]) == [a]




def test_requires_grad_differences_name_the_tensor_and_where_it_is_frozen() -> None:
    from plugins.grad_sync import requires_grad_differences

    names = ["a.weight", "b.weight", "c.weight"]
    assert requires_grad_differences(names, [[True, False, True]] * 3) == []  # frozen everywhere: no desync
    (frozen,) = requires_grad_differences(names, [[True, True, True], [True, False, True], [True, True, True]])
    assert (frozen["tensor"], frozen["ranks"], frozen["reference_rank"]) == ("b.weight", [1], 0)
    assert frozen["frozen_on_ranks"] == [1] and frozen["trained_on_ranks"] == [0, 2]
    assert frozen["described"] == "b.weight is frozen on rank 1 only (requires_grad False there, True on ranks 0, 2)"
    (trained,) = requires_grad_differences(names, [[True, True, False], [True, True, True], [True, True, False]])
    assert trained["ranks"] == [1] and trained["described"].startswith("c.weight is trained on rank 1 only")


def test_a_tensor_frozen_on_one_rank_is_a_desync_although_the_reduced_gradients_agree(tmp_path: Path) -> None:
    """The comparison of gathered fingerprints: weights and gradients bit-identical, requires_grad not."""
    from plugins.grad_sync import GradSync

    plugin = GradSync()
    plugin.ctx = ctx = RankZeroCtx(tmp_path)
    plugin.mode, plugin._described = "ddp", "DistributedDataParallel"
    plugin._params = [(n, torch.nn.Parameter(torch.ones(2))) for n in ("model.embed.weight", "model.layers.0.mlp.up_proj.weight")]
    same = exact_fingerprints([torch.ones(2), torch.ones(2)])

    def rank(flags: list[bool]) -> dict[str, Any]:
        return {"params": same, "grads": same, "requires_grad": flags, "group": [], "inputs": None, "timing": [0.0, 0.0, 0], "micro_batches": 1}

    plugin._compare(ctx, 15, [rank([True, True]), rank([True, False])])
    (finding,) = ctx.findings
    assert finding["code"] == "GRAD_DESYNC" and finding["step"] == 15
    assert "model.layers.0.mlp.up_proj.weight is frozen on rank 1 only" in finding["message"]
    assert finding["evidence"]["ranks"] == [1] and finding["evidence"]["compared"] == "requires_grad"
    assert finding["evidence"]["tensors"][0]["tensor"] == "model.layers.0.mlp.up_proj.weight"
    (check,) = read_jsonl(tmp_path / "grad_sync.jsonl")
    assert check["in_sync"] is False
    ctx.findings.clear()
    plugin._compare(ctx, 20, [rank([True, True]), rank([True, True])])
    assert ctx.findings == [] and read_jsonl(tmp_path / "grad_sync.jsonl")[-1]["in_sync"] is True


def test_single_process_is_idle(make_trainer: Any) -> None:
    trainer = make_trainer(max_steps=3)
    harness.attach(trainer, config={"grad_sync": {"every": 1}})
    trainer.train()
    out = Path(trainer.args.output_dir)
    assert _sync_findings(out) == [] and not (out / "harness" / "grad_sync.jsonl").exists()


@pytest.mark.slow
def test_ddp_drift_comm_hook_fault_and_straggler_are_found_and_rebroadcast_repairs(tmp_path: Path) -> None:
    out = _run(
        tmp_path,
        {"plugins": ["defaults", "harness.testing:FaultInjector"],
         "grad_sync": {"every": 5, "on_desync": "rebroadcast"},
         "fault_injector": {"perturb_param_at_step": 7, "scale_grad_at_step": 15}},
        "--slow_data_rank", "1", "--slow_data_seconds", "0.03",
    )
    assert (out / "harness" / "perturbed.rank-1.txt").read_text() == PERTURBED
    found = _sync_findings(out)
    params = [f for f in found if f["code"] == "PARAM_DESYNC"]
    # first check after step 7 is step 10; rebroadcast after 10 and after 15 leaves 20 and 25 in sync
    assert [f["step"] for f in params] == [10]
    assert params[0]["evidence"]["ranks"] == [1] and params[0]["evidence"]["diverging_tensors"] == 1
    assert params[0]["evidence"]["tensors"][0]["tensor"] == PERTURBED
    grads = [f for f in found if f["code"] == "GRAD_DESYNC"]
    assert [f["step"] for f in grads] == [15] and grads[0]["evidence"]["ranks"] == [1]
    assert grads[0]["evidence"]["diverging_tensors"] == grads[0]["evidence"]["checked_tensors"]  # the hook scaled every bucket
    stragglers = [f for f in found if f["code"] == "STRAGGLER_RANK"]
    assert stragglers and {f["evidence"]["rank"] for f in stragglers} == {1}
    checks = read_jsonl(out / "harness" / "grad_sync.jsonl")
    assert [c["step"] for c in checks] == [1, 5, 10, 15, 20, 25]
    assert [c["in_sync"] for c in checks] == [True, True, False, False, True, True]
    assert all(c["data_wait_s"][1] > c["data_wait_s"][0] for c in checks[1:])


@pytest.mark.slow
def test_zero2_drift_partition_fault_identical_inputs_and_stop(tmp_path: Path) -> None:
    out = _run(
        tmp_path,
        {"plugins": ["defaults", "harness.testing:FaultInjector"],
         "grad_sync": {"every": 5}, "policy": {"GRAD_DESYNC": "stop"},
         "fault_injector": {"perturb_param_at_step": 9, "scale_grad_at_step": 15}},
        *ZERO2, "--own_dataloader", exit_code=EXIT_STOPPED,  # the harness stopped the run: wrap says so
    )
    found = _sync_findings(out)
    params = [f for f in found if f["code"] == "PARAM_DESYNC"]
    # under ZeRO-2 each step's all-gather rewrites the replicas, so a drift after step 9 is seen at step 10 only
    assert [f["step"] for f in params] == [10] and params[0]["evidence"]["tensors"][0]["tensor"] == PERTURBED
    assert params[0]["evidence"]["parallelism"] == "DeepSpeed ZeRO-2"
    grads = [f for f in found if f["code"] == "GRAD_DESYNC"]
    assert [f["step"] for f in grads] == [15] and grads[0]["evidence"]["ranks"] == [1] and grads[0]["action"] == "stop"
    slices = grads[0]["evidence"]["tensors"]
    assert all(abs(s["owner_sum"] - 1.5 * s["expected_sum"]) <= 1e-4 * abs(s["expected_sum"]) + 1e-9 for s in slices)
    assert [f["step"] for f in found if f["code"] == "RANK_INPUTS_IDENTICAL"] == [1, 5, 10, 15]
    losses = [r for r in read_jsonl(out / "harness" / "metrics.jsonl") if "loss" in r]
    assert losses[-1]["step"] == 15  # stopped before step 15's update


@pytest.mark.slow
@pytest.mark.parametrize("engine", ["ddp", "zero2"])
def test_clean_two_process_run_of_200_steps_is_silent(tmp_path: Path, engine: str) -> None:
    out = _run(tmp_path, {"grad_sync": {"every": 5}}, *(ZERO2 if engine == "zero2" else []), steps=200)
    checks = read_jsonl(out / "harness" / "grad_sync.jsonl")
    assert len(checks) == 41 and all(c["in_sync"] for c in checks)  # step 1 and every 5th
    assert all(c["params_compared"] == 21 for c in checks)
    assert all((c["slices_compared"] if engine == "zero2" else c["grads_compared"]) > 0 for c in checks)
    # also data_hash's sharded case: ranks on the Trainer's sharded loader share no sample (RANK_DATA_OVERLAP is an error)
    assert [f for f in findings_of(out) if f["severity"] in ("warning", "error", "critical")] == []
