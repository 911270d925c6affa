"""rerun: a flagged step is recomputed; a one-shot NaN is transient, a NaN batch reproduced, training untouched either way."""
from __future__ import annotations

import math
from typing import Any

import pytest
import torch

import harness
from conftest import FAULTS, findings_of
from harness.lib.rerun_verdict import Outcome, Tolerance, compare, measured_nondeterminism, neighbour_agrees, relative_difference

NAN = math.nan


# -- the verdict's arithmetic (milliseconds) ------------------------------------------------------------


def test_tolerance_is_the_floor_until_calibrated_then_factor_times_measured() -> None:
    tol = Tolerance(1e-3, 10.0)
    assert tol.value == 1e-3
    assert tol.calibrated(1e-5).value == 1e-3 and tol.calibrated(1e-3).value == pytest.approx(1e-2)
    assert tol.calibrated(math.inf).value == 1e-3  # a broken calibration never opens the tolerance


def test_relative_difference_treats_non_finite_values_as_a_kind() -> None:
    assert relative_difference(NAN, math.inf) == 0.0 and relative_difference(NAN, 1.0) == math.inf
    assert relative_difference(0.0, 0.0) == 0.0 and relative_difference(2.0, 1.0) == 0.5
    assert measured_nondeterminism([1.0, NAN], [1.001, NAN], 2.0, 2.0) == pytest.approx(0.001 / 1.001)
    assert measured_nondeterminism([NAN], [NAN], None, None) is None


def test_compare_in_one_process() -> None:
    kw: dict[str, Any] = {"rerun_grads_finite": True, "norms_comparable": True}
    assert compare([NAN, 2.0], [2.5, 2.0], 1e-3, original_norm=NAN, rerun_norm=3.0, **kw).outcome is Outcome.TRANSIENT
    same = compare([NAN], [NAN], 1e-3, original_norm=NAN, rerun_norm=NAN, **{**kw, "rerun_grads_finite": False})
    assert same.outcome is Outcome.REPRODUCED and same.loss_differences == [0.0]
    grad = compare([2.0], [2.0], 1e-3, original_norm=math.inf, rerun_norm=3.0, **kw)
    assert grad.outcome is Outcome.TRANSIENT and "grad norm" in grad.reason
    assert compare([9.0], [9.0 * (1 + 1e-4)], 1e-3, original_norm=5.0, rerun_norm=5.0, **kw).outcome is Outcome.REPRODUCED
    assert compare([2.0], [2.0], 1e-3, original_norm=None, rerun_norm=1.0, **kw).outcome is Outcome.REPRODUCED
    assert compare([2.0, 1.0], [2.0], 1e-3, original_norm=None, rerun_norm=None, **kw).outcome is Outcome.TRANSIENT


def test_compare_with_several_ranks_judges_only_the_finiteness_of_the_reduced_norm() -> None:
    kw: dict[str, Any] = {"norms_comparable": False}
    assert compare([2.0], [2.0], 1e-3, original_norm=NAN, rerun_norm=1.0, rerun_grads_finite=True, **kw).outcome is Outcome.CLEAN_HERE
    assert compare([NAN], [NAN], 1e-3, original_norm=NAN, rerun_norm=NAN, rerun_grads_finite=False, **kw).outcome is Outcome.REPRODUCED
    assert compare([5.0], [5.0], 1e-3, original_norm=9.0, rerun_norm=1.0, rerun_grads_finite=True, **kw).outcome is Outcome.REPRODUCED


def test_the_neighbour_agrees_only_with_the_same_losses_and_gradient_finiteness() -> None:
    assert neighbour_agrees([NAN], [NAN], 1e-3, False, False)
    assert not neighbour_agrees([NAN], [2.0], 1e-3, False, True)
    assert not neighbour_agrees([2.0], [2.0], 1e-3, False, True)
    assert not neighbour_agrees([2.0], [2.0, 1.0], 1e-3, None, None)


# -- real runs: a tiny Llama, a few steps -----------------------------------------------------------------


def _train(make_trainer: Any, faults: dict[str, Any], plugins: tuple[str, ...] = ("nan_guard", "rerun"), rerun: dict[str, Any] | None = None,
           **args: Any) -> tuple[Any, Any]:
    trainer = make_trainer(**{"max_steps": 4, **args})
    ctx = harness.attach(trainer, config={"plugins": [*plugins, FAULTS], "fault_injector": faults, "rerun": rerun or {}})
    trainer.train()
    return trainer, ctx


def _verdicts(trainer: Any) -> list[tuple[str, int]]:
    return [(f["code"], f["step"]) for f in findings_of(trainer.args.output_dir) if f["code"].startswith("FAULT_")]


def test_a_one_shot_nan_is_transient(make_trainer: Any) -> None:
    trainer, ctx = _train(make_trainer, {"nonfinite_loss_at_steps": [3]}, gradient_accumulation_steps=2, max_steps=3)
    assert _verdicts(trainer) == [("FAULT_TRANSIENT", 3)]
    (finding,) = findings_of(trainer.args.output_dir, "FAULT_TRANSIENT")
    ev = finding["evidence"]
    assert ev["flagged_by"] == ["NONFINITE_LOSS"] and ev["micro_batches"] == 2 and ev["original_losses"][0] == "nan"
    assert all(isinstance(v, float) for v in ev["rerun_losses"]) and ev["rerun_losses"][1] == ev["original_losses"][1]  # micro-batch 1 exactly
    assert ev["rerun_grads_finite"] is True and ev["calibration"]["step"] == 2 and ev["tolerance"] >= 1e-3
    assert "check the node" in finding["message"] and finding["playbook"] == "rerun#fault_transient"
    assert ctx.manager.plugin("rerun").calibration["measured"] < 1e-3  # CPU fp32: a clean rerun gives (nearly) the same bits


def test_a_nan_batch_is_reproduced(make_trainer: Any) -> None:
    trainer, _ = _train(make_trainer, {"nan_batch_at_steps": [3]}, max_steps=3)
    assert _verdicts(trainer) == [("FAULT_REPRODUCED", 3)]
    (finding,) = findings_of(trainer.args.output_dir, "FAULT_REPRODUCED")
    ev = finding["evidence"]
    assert ev["original_losses"] == ["nan"] and ev["rerun_losses"] == ["nan"] and ev["rerun_grads_finite"] is False
    assert "captures/step-3/" in finding["message"]
    assert trainer.state.global_step == 3 and all(bool(torch.isfinite(p).all()) for p in trainer.model.parameters())


def test_two_flagged_steps_in_one_process_get_a_verdict_each(make_trainer: Any) -> None:
    """One process: the verdict hook is called only after a rerun (idle otherwise); woken twice, it gives both verdicts."""
    trainer, ctx = _train(make_trainer, {"nan_batch_at_steps": [2, 4]}, plugins=("nan_guard", "rerun", "data_hash"), max_steps=4)
    assert _verdicts(trainer) == [("FAULT_REPRODUCED", 2), ("FAULT_REPRODUCED", 4)]
    assert findings_of(trainer.args.output_dir, "DATA_REPEATED") == []  # two marked rows are two samples, not one trained twice
    assert ctx.manager.is_idle("rerun", "on_step_agreed")  # idle again after the last verdict


@pytest.mark.parametrize("world_size", [1, 2])
def test_the_verdict_hook_idles_only_in_one_process(world_size: int) -> None:
    """With several ranks every rank shares and agrees at every step: its verdict hook must run at every step."""
    from types import SimpleNamespace

    from harness.core.manager import HarnessPluginManager, PluginEntry
    from harness.plugins.rerun import Rerun

    manager = HarnessPluginManager()
    plugin = manager.register(PluginEntry("rerun", "object", Rerun))
    ctx = SimpleNamespace(manager=manager, world_size=world_size, rank=0, findings=[], reserve=lambda *args, **kwargs: None)
    plugin.configure(ctx, None)
    plugin.on_run_start(ctx, trainer=None)
    assert manager.is_idle("rerun", "on_step_agreed") is (world_size == 1)


@pytest.mark.slow  # a real run beyond the quick tier's per-test budget
def test_one_shot_infinite_gradients_are_transient(make_trainer: Any) -> None:
    trainer, _ = _train(make_trainer, {"inf_grad_at_steps": [3]})
    assert _verdicts(trainer) == [("FAULT_TRANSIENT", 3)]
    (finding,) = findings_of(trainer.args.output_dir, "FAULT_TRANSIENT")
    assert finding["evidence"]["flagged_by"] == ["NONFINITE_GRAD"] and "grad norm" in finding["evidence"]["reason"]


@pytest.mark.slow  # a real run beyond the quick tier's per-test budget
def test_a_rerun_leaves_the_update_as_it_was(make_trainer: Any, tokenizer: Any, tmp_path: Any) -> None:
    """A flagged step that is still applied: the recomputation must not touch param.grad, the RNG streams or the weights."""
    from harness.lib.tiny import build_tiny_llama

    flag = {"report_at_step": 3}  # a TEST_FAULT (warning, action continue) at step 3: flagged, and updated as usual
    runs = []
    for name, plugins in (("rerun", ("nan_guard", "rerun")), ("plain", ("nan_guard",))):
        model = build_tiny_llama(tokenizer, seed=0, attention_dropout=0.2)  # dropout: training draws from the RNG every step
        runs.append(_train(make_trainer, flag, plugins=plugins, rerun={"trigger_codes": ["TEST_FAULT"]} if name == "rerun" else None,
                           output_dir=tmp_path / name, model=model, max_steps=5)[0])
    checked, plain = runs
    assert _verdicts(checked) == [("FAULT_REPRODUCED", 3)]  # the same RNG state, the same dropout masks: reproduced
    for (name, a), (_, b) in zip(checked.model.named_parameters(), plain.model.named_parameters()):
        assert torch.equal(a, b), name


@pytest.mark.slow  # a real run beyond the quick tier's per-test budget
def test_a_clean_run_is_silent_and_calibrated_once(make_trainer: Any) -> None:
    trainer, ctx = _train(make_trainer, {})
    assert _verdicts(trainer) == [] and ctx.manager.plugin("rerun").calibration["step"] == 2
    assert [f for f in findings_of(trainer.args.output_dir) if f["severity"] != "info"] == []


def test_refusals_name_why(make_trainer: Any) -> None:
    from harness.lib.recompute import why_not

    trainer = make_trainer(max_steps=1)
    assert why_not(trainer) is None
    trainer.is_deepspeed_enabled = True  # the guard would run inside the engine's step: no rerun
    assert "DeepSpeed" in (why_not(trainer) or "")


@pytest.mark.slow  # 320 steps
def test_a_long_clean_run_gives_no_verdict_and_no_warning(make_trainer: Any) -> None:
    """Also nan_guard's long clean run (and every other default plugin's): one 320-step run, no non-info finding."""
    trainer = make_trainer(max_steps=320, logging_steps=50, per_device_train_batch_size=2)
    ctx = harness.attach(trainer)  # the default plugins, rerun and nan_guard among them
    trainer.train()
    assert trainer.state.global_step == 320 and ctx.manager.plugin("rerun").calibration["step"] == 2
    assert _verdicts(trainer) == []
    assert [f for f in findings_of(trainer.args.output_dir) if f["severity"] != "info"] == []


@pytest.mark.slow  # two TRL runs
def test_a_rerun_under_trl_sft_leaves_its_logged_metrics_as_they_were(tmp_path: Any, tokenizer: Any) -> None:
    """TRL's compute_loss adds to its own metrics (token count, accuracy): the recomputation's additions are taken back."""
    from datasets import Dataset
    from trl import SFTConfig, SFTTrainer

    from harness.lib.tiny import build_tiny_llama, corpus_lines

    lines = [line for line in corpus_lines() if line.count(".") >= 2][:24]
    data = Dataset.from_list([{"prompt": f"Continue: {a.split('.')[0]}.", "completion": " " + a.split(".")[1].strip() + "."} for a in lines])
    logs = []
    for name, plugins in (("rerun", ["rerun", FAULTS]), ("plain", [FAULTS])):
        args = SFTConfig(output_dir=str(tmp_path / name), max_length=48, max_steps=4, per_device_train_batch_size=2, learning_rate=1e-3,
                         report_to="none", logging_steps=1, use_cpu=True, save_strategy="no", disable_tqdm=True, dataloader_num_workers=0, seed=0)
        trainer = SFTTrainer(model=build_tiny_llama(tokenizer), args=args, train_dataset=data, processing_class=tokenizer)
        harness.attach(trainer, config={"plugins": plugins, "fault_injector": {"report_at_step": 3}, "rerun": {"trigger_codes": ["TEST_FAULT"]}})
        trainer.train()
        logs.append([{k: v for k, v in row.items() if k in ("num_tokens", "mean_token_accuracy", "loss")} for row in trainer.state.log_history])
        if name == "rerun":
            assert _verdicts(trainer) == [("FAULT_REPRODUCED", 3)]
    assert logs[0] == logs[1] and any("num_tokens" in row for row in logs[0])
