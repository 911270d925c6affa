"""nan_guard: non-finite losses and gradients are found at the right step, skipped, and escalated."""
from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from transformers import TrainerCallback

import harness
from conftest import EXAMPLE, FAULTS, REPO, findings_of, harness_cli, read_jsonl, torchrun, write_yaml


def _train(make_trainer: Any, faults: dict[str, Any], **args: Any) -> Any:
    trainer = make_trainer(**{"max_steps": 6, **args})
    ctx = harness.attach(trainer, config={"plugins": ["nan_guard", FAULTS], "fault_injector": faults})
    trainer.train()
    return trainer, ctx


def _all_finite(trainer: Any) -> bool:
    return all(bool(torch.isfinite(p).all()) for p in trainer.model.parameters())


def test_nan_loss_is_found_at_that_step_and_skipped(make_trainer: Any) -> None:
    trainer, ctx = _train(make_trainer, {"nonfinite_loss_at_steps": [3], "snapshot_steps": [3, 4]}, gradient_accumulation_steps=2)
    (finding,) = findings_of(trainer.args.output_dir, "NONFINITE_LOSS")
    assert finding["step"] == 3 and finding["rank"] == 0 and finding["action"] == "skip_step"
    assert finding["evidence"]["micro_batches"] == [0] and finding["plugin"] == "nan_guard"
    assert "logging_nan_inf_filter" in finding["message"]
    assert Path(finding["evidence"]["capture"]).exists()
    snaps = {r["step"]: r for r in read_jsonl(ctx.run_dir / "fault_injector.rank-0.jsonl")}
    assert snaps[3]["skipped"] and snaps[3]["params_changed"] == [] and snaps[3]["optimizer_changed"] == []
    assert snaps[4]["params_changed"]
    assert trainer.state.global_step == 6 and _all_finite(trainer)
    (summary,) = findings_of(trainer.args.output_dir, "SKIPPED_STEPS")
    assert summary["severity"] == "info" and summary["evidence"]["skipped_steps"] == [3]
    assert summary["evidence"]["scheduler_advanced"] == [] and "held still" in summary["message"]
    capture = json.loads(Path(finding["evidence"]["capture"]).read_text())
    assert capture["code"] == "NONFINITE_LOSS" and len(capture["samples"]) == 8  # both micro-batches of the step
    assert [m["micro_batch"] for m in capture["micro_batches"]] == [0, 1] and capture["micro_batches"][0]["trainer_loss"] == "nan"
    # the poison is one forward only: the traced rerun is finite, and says so
    assert finding["evidence"]["reproduced_in_forward"] is False and finding["evidence"]["first_nonfinite_module"] is None
    assert "not reproduced in the forward" in finding["message"]


def test_inf_gradients_are_found_and_skipped(make_trainer: Any) -> None:
    trainer, _ = _train(make_trainer, {"inf_grad_at_steps": [4]})
    (finding,) = findings_of(trainer.args.output_dir, "NONFINITE_GRAD")
    assert finding["step"] == 4 and finding["action"] == "skip_step"
    # the embedding's zero rows times inf are NaN: the clip coefficient is NaN and so is every gradient; the rerun of the
    # step's backward is finite again (the poison is one backward only), and the finding says so
    evidence = finding["evidence"]
    assert evidence["grad_source"].startswith("a rerun") and evidence["reproduced_in_backward"] is False
    assert evidence["first_nonfinite_param"] is None and "not reproduced" in finding["message"]
    # one process: no other rank to have sent the NaN (several ranks: test_nan_guard_ranks.py)
    assert finding["severity"] == "error" and "world_size" not in evidence and "all-reduce" not in finding["message"]
    assert findings_of(trainer.args.output_dir, "NONFINITE_LOSS") == []
    assert trainer.state.global_step == 6 and _all_finite(trainer)


def test_three_in_a_row_save_and_stop(make_trainer: Any) -> None:
    trainer, _ = _train(make_trainer, {"nonfinite_loss_at_steps": [2, 3, 4]}, max_steps=8)
    findings = findings_of(trainer.args.output_dir, "NONFINITE_LOSS")
    assert [(f["step"], f["action"]) for f in findings] == [(2, "skip_step"), (3, "skip_step"), (4, "save_and_stop")]
    assert trainer.state.global_step == 4
    assert (Path(trainer.args.output_dir) / "checkpoint-4").exists() and _all_finite(trainer)


def test_a_clean_step_resets_the_ladder(make_trainer: Any) -> None:
    trainer = make_trainer(max_steps=8)
    config = {"plugins": ["nan_guard", FAULTS], "nan_guard": {"locate": False}, "fault_injector": {"nonfinite_loss_at_steps": [2, 3, 5, 6]}}
    harness.attach(trainer, config=config)
    trainer.train()
    findings = findings_of(trainer.args.output_dir, "NONFINITE_LOSS")
    assert [f["action"] for f in findings] == ["skip_step"] * 4 and trainer.state.global_step == 8
    assert {f["evidence"]["locate"] for f in findings} == {"off"}  # locate: false, no rerun


def test_an_overflow_in_layer_1_names_that_module(make_trainer: Any) -> None:
    """A module that overflows on purpose in layer 1 of 2: the traced rerun names it, with its finite input."""
    trainer, ctx = _train(make_trainer, {"overflow_module": "model.layers.1.mlp", "overflow_at_step": 3}, max_steps=4)
    (finding,) = findings_of(trainer.args.output_dir, "NONFINITE_LOSS")
    evidence = finding["evidence"]
    assert finding["step"] == 3 and evidence["reproduced_in_forward"] is True
    assert evidence["first_nonfinite_module"] == "model.layers.1.mlp" and evidence["first_nonfinite"]["class"] == "LlamaMLP"
    assert all(isinstance(v, float) for v in evidence["first_nonfinite"]["input"].values())  # finite: numbers, not "nan"/"inf"
    assert evidence["first_nonfinite"]["output"]["abs_max"] in ("inf", "nan")
    assert evidence["last_finite_module"] == "model.layers.1.mlp.down_proj"
    assert "model.layers.1.mlp (LlamaMLP; input min" in finding["message"]
    assert "model.layers.1.mlp (LlamaMLP" in (ctx.run_dir / "report.md").read_text()  # the report renders the name
    assert trainer.state.global_step == 4 and _all_finite(trainer)


def test_a_gradient_born_nonfinite_in_layer_1_names_the_first_parameter(make_trainer: Any) -> None:
    """The gradient arriving at layer 1's MLP output made infinite: every parameter upstream is named, in module order."""
    trainer, _ = _train(make_trainer, {"inf_grad_at_steps": [3], "inf_grad_target": "model.layers.1.mlp"}, max_steps=4)
    (finding,) = findings_of(trainer.args.output_dir, "NONFINITE_GRAD")
    evidence = finding["evidence"]
    assert evidence["first_nonfinite_param"] == "model.layers.1.mlp.down_proj.weight"  # backward reaches it first
    assert evidence["reproduced_in_backward"] is True  # NaN norm: found by a rerun of the step's backward
    names = evidence["nonfinite_params"]
    assert names[0] == "model.embed_tokens.weight" and evidence["nonfinite_param_count"] == len(names) == 19
    layers = [int(n.split(".")[2]) for n in names[1:]]
    assert layers == sorted(layers) and set(layers) == {0, 1}  # ordered by layer
    assert "model.norm.weight" not in names and "lm_head.weight" not in names  # downstream of the fault: finite
    assert evidence["grad_scope"] == "whole model" and "model.layers.1.mlp.down_proj.weight" in finding["message"]
    assert trainer.state.global_step == 4 and _all_finite(trainer)


def test_one_infinite_parameter_gradient_is_named_from_the_step_itself(make_trainer: Any) -> None:
    """One layer-1 weight's gradient times inf: an infinite norm, so the step's own gradients still tell which one."""
    target = "model.layers.1.mlp.up_proj.weight"
    trainer, _ = _train(make_trainer, {"inf_grad_at_steps": [2], "inf_grad_target": target}, max_steps=3)
    (finding,) = findings_of(trainer.args.output_dir, "NONFINITE_GRAD")
    evidence = finding["evidence"]
    assert evidence["nonfinite_params"] == [target] and evidence["first_nonfinite_param"] == target
    assert evidence["grad_source"] == "the step's gradients" and evidence["grad_tensors_checked"] == 21


class PoisonWeight(TrainerCallback):
    """Writes NaN into three elements of one weight at the start of ``step`` (as an update with an infinite gradient would)."""

    def __init__(self, name: str, step: int) -> None:
        self.name, self.step = name, step

    def on_step_begin(self, args: Any, state: Any, control: Any, model: Any = None, **kwargs: Any) -> None:
        if state.global_step + 1 == self.step:
            with torch.no_grad():
                dict(model.named_parameters())[self.name][0, :3] = float("nan")


def test_a_nonfinite_weight_of_the_first_bad_module_is_named_with_its_rank(make_trainer: Any) -> None:
    """The located module's input is finite and its own weight holds NaN: the finding says so (the model state, not the device)."""
    target = "model.layers.0.mlp.down_proj"
    trainer = make_trainer(max_steps=3, callbacks=[PoisonWeight(f"{target}.weight", 3)])
    harness.attach(trainer, config={"plugins": ["nan_guard"]})
    trainer.train()
    (finding,) = findings_of(trainer.args.output_dir, "NONFINITE_LOSS")
    evidence = finding["evidence"]
    assert finding["step"] == 3 and evidence["first_nonfinite_module"] == target and evidence["reproduced_in_forward"] is True
    assert all(isinstance(v, float) for v in evidence["first_nonfinite"]["input"].values())  # finite input
    elements = trainer.model.get_submodule(target).weight.numel()
    assert evidence["nonfinite_params_of_module"] == [
        {"param": f"{target}.weight", "rank": 0, "nonfinite_elements": 3, "elements": elements}]
    assert evidence["params_of_module_checked"] == 1  # that module's own parameters only (a Linear without bias)
    assert f"its weight holds NaN/Inf on rank 0 (3 of {elements} elements)" in finding["message"]
    assert "not the device" in finding["message"]


def test_an_overflow_with_finite_weights_names_no_parameter(make_trainer: Any) -> None:
    """The located module's own parameters are checked and finite: an empty list, nothing said about weights."""
    trainer, _ = _train(make_trainer, {"overflow_module": "model.layers.1.mlp.down_proj", "overflow_at_step": 2}, max_steps=2)
    (finding,) = findings_of(trainer.args.output_dir, "NONFINITE_LOSS")
    assert finding["evidence"]["first_nonfinite_module"] == "model.layers.1.mlp.down_proj"
    assert finding["evidence"]["nonfinite_params_of_module"] == [] and finding["evidence"]["params_of_module_checked"] == 1
    assert "holds NaN/Inf" not in finding["message"]


@pytest.mark.slow  # two processes
def test_the_first_bad_tensor_under_ddp(tmp_path: Path) -> None:
    """Two DDP ranks: the traced forward and the backward rerun run on each rank alone (no collective, no hang) and agree."""
    out = tmp_path / "run"
    faults = {"overflow_module": "model.layers.1.mlp", "overflow_at_step": 2, "inf_grad_at_steps": [3], "inf_grad_target": "model.layers.1.mlp"}
    config = write_yaml(tmp_path / "h.yaml", {"plugins": ["nan_guard", FAULTS], "fault_injector": faults})
    script = [str(EXAMPLE), "--output_dir", str(out), "--max_steps", "4"]
    result = harness_cli("wrap", "--config", str(config), "--", *torchrun(), *script)
    assert result.returncode == 0, result.stderr[-4000:]
    losses, grads = findings_of(out, "NONFINITE_LOSS"), findings_of(out, "NONFINITE_GRAD")
    assert sorted((f["rank"], f["step"]) for f in losses) == [(0, 2), (1, 2)]
    assert {f["evidence"]["first_nonfinite_module"] for f in losses} == {"model.layers.1.mlp"}
    assert sorted((f["rank"], f["step"]) for f in grads) == [(0, 3), (1, 3)]
    assert {f["evidence"]["first_nonfinite_param"] for f in grads} == {"model.layers.1.mlp.down_proj.weight"}
    # both ranks skipped steps 2 and 3 (a skip is agreed): the run-end summary is made once, by rank 0, not once per rank
    (summary,) = findings_of(out, "SKIPPED_STEPS")
    assert summary["rank"] == 0 and summary["evidence"]["skipped_steps"] == [2, 3], summary
    assert "SKIPPED_STEPS x2" not in result.stdout + result.stderr


@pytest.mark.slow  # a subprocess through `harness wrap` (tests/launch/test_wrap.py keeps the wrap path in the quick tier)
def test_through_wrap_on_an_unmodified_script(tmp_path: Path) -> None:
    """A non-finite loss at step 2 and an infinite gradient at step 4 (a clean step between): one run, each skipped."""
    out = tmp_path / "run"
    faults = {"nonfinite_loss_at_steps": [2], "inf_grad_at_steps": [4]}
    config = write_yaml(tmp_path / "h.yaml", {"plugins": ["nan_guard", FAULTS], "fault_injector": faults})
    result = harness_cli("wrap", "--config", str(config), "--", sys.executable, str(EXAMPLE), "--output_dir", str(out), "--max_steps", "5")
    assert result.returncode == 0, result.stderr[-3000:]
    for code, step in (("NONFINITE_LOSS", 2), ("NONFINITE_GRAD", 4)):
        found = [(f["step"], f["action"]) for f in findings_of(out, code)]
        assert found == [(step, "skip_step")], (code, found)
    assert [f["step"] for f in findings_of(out, "ACTION_TAKEN")] == [2, 4]


@pytest.mark.slow  # a run through `harness wrap` (a subprocess): CI runs it, the quick tier does not
def test_three_in_a_row_save_and_stop_through_wrap(tmp_path: Path) -> None:
    out = tmp_path / "run"
    config = write_yaml(tmp_path / "h.yaml", {"plugins": ["nan_guard", FAULTS], "fault_injector": {"nonfinite_loss_at_steps": [2, 3, 4]}})
    result = harness_cli("wrap", "--config", str(config), "--", sys.executable, str(EXAMPLE), "--output_dir", str(out), "--max_steps", "8")
    from harness.lib.stops import EXIT_STOPPED

    assert result.returncode == EXIT_STOPPED, result.stderr[-3000:]  # the harness stopped the run: wrap says so (issue 18)
    assert [(f["step"], f["action"]) for f in findings_of(out, "NONFINITE_LOSS")] == [(2, "skip_step"), (3, "skip_step"), (4, "save_and_stop")]
    assert (out / "checkpoint-4").is_dir() and not (out / "checkpoint-8").exists()


# A long clean run with the default plugins, nan_guard among them, stays silent: that is the same 320-step run as
# tests/plugins/test_rerun.py::test_a_long_clean_run_gives_no_verdict_and_no_warning (no non-info finding from any plugin).


class SchedulerStepsOnSkips(TrainerCallback):
    """A training loop that steps its LR scheduler even when the update was skipped (a common hand-written bug)."""

    def __init__(self) -> None:
        self.trainer: Any = None

    def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> Any:
        if getattr(self.trainer.optimizer, "step_was_skipped", False):
            self.trainer.lr_scheduler.step()
        return control


def test_skipped_steps_say_whether_the_scheduler_kept_advancing(make_trainer: Any) -> None:
    leaky = SchedulerStepsOnSkips()
    trainer = make_trainer(max_steps=6, callbacks=[leaky])
    leaky.trainer = trainer
    harness.attach(trainer, config={"plugins": ["nan_guard", FAULTS], "fault_injector": {"nonfinite_loss_at_steps": [2, 4]}})
    trainer.train()
    (summary,) = findings_of(trainer.args.output_dir, "SKIPPED_STEPS")
    assert summary["severity"] == "warning" and summary["evidence"]["scheduler_advanced"] == [2, 4]
    assert "kept advancing during 2" in summary["message"]


@pytest.mark.slow
def test_deepspeed_skipping_an_update_on_its_own_is_reported(tmp_path: Path) -> None:
    """ZeRO-2 in fp32 drops a step whose gradient norm is not finite, silently; nan_guard names that step."""
    out = tmp_path / "run"
    config = write_yaml(
        tmp_path / "h.yaml",
        {"plugins": ["nan_guard", FAULTS], "fault_injector": {"inf_grad_at_steps": [3], "snapshot_steps": [3, 4]}},
    )
    script = [str(EXAMPLE), "--output_dir", str(out), "--max_steps", "5", "--deepspeed", str(REPO / "examples" / "ds_zero2.json")]
    result = harness_cli("wrap", "--config", str(config), "--", *torchrun(), *script, env={"DS_ACCELERATOR": "cpu"})
    assert result.returncode == 0, result.stderr[-4000:]
    skips = findings_of(out, "OPTIMIZER_SKIPPED_STEP")
    assert sorted((f["rank"], f["step"]) for f in skips) == [(0, 3), (1, 3)]
    assert "DeepSpeed engine" in skips[0]["message"]
    for rank in (0, 1):
        snaps = {r["step"]: r for r in read_jsonl(out / "harness" / f"fault_injector.rank-{rank}.jsonl")}
        assert snaps[3]["params_changed"] == [] and snaps[4]["params_changed"]  # the engine really skipped step 3
    (summary,) = [f for f in findings_of(out, "SKIPPED_STEPS") if f["rank"] == 0]
    assert summary["evidence"]["optimizer_skips"] == [3] and summary["evidence"]["scheduler_advanced"] == []


def test_nonfinite_parameters_stop_the_run_and_name_the_tensor(make_trainer: Any) -> None:
    trainer = make_trainer(max_steps=8)
    config = {"plugins": ["nan_guard", FAULTS], "nan_guard": {"check_params_every": 1}, "fault_injector": {"nan_param_at_step": 3}}
    ctx = harness.attach(trainer, config=config)
    trainer.train()
    (finding,) = findings_of(trainer.args.output_dir, "NONFINITE_PARAMS")
    poisoned = (ctx.run_dir / "nan_param.txt").read_text()
    assert finding["step"] == 3 and finding["severity"] == "critical" and finding["action"] == "stop"
    assert finding["evidence"]["parameters"] == [poisoned] and poisoned in finding["message"]
    assert trainer.state.global_step == 3


class _RankCtx:
    """Just enough of a run context for ``on_run_end``: its rank, and the findings it was handed."""

    def __init__(self, rank: int, world_size: int = 2) -> None:
        self.rank, self.world_size, self.is_main, self.step = rank, world_size, rank == 0, 6
        self.reported: list[tuple[str, str, dict[str, Any]]] = []

    def report(self, code: str, message: str, **kwargs: Any) -> None:
        self.reported.append((code, message, kwargs))


def test_skipped_steps_is_summed_up_once_by_rank_0_not_once_per_rank() -> None:
    """A skip is agreed on every rank, so every rank holds the same skipped steps: only rank 0 makes the run's summary
    (else a 2-rank run with one skipped step shows SKIPPED_STEPS x2)."""
    from plugins.nan_guard import NanGuard

    summaries = {}
    for rank in (0, 1):
        guard, ctx = NanGuard(), _RankCtx(rank)
        guard.ctx = ctx
        guard.skipped_steps = [3]
        guard.on_run_end(ctx)
        summaries[rank] = [code for code, _, _ in ctx.reported]
    assert summaries == {0: ["SKIPPED_STEPS"], 1: []}, summaries
