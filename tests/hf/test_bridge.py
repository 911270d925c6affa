"""The Trainer bridge on a real tiny Llama and a real HF Trainer: hooks, isolation, actions, checkpoints."""
from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import pytest
import torch
from transformers import TrainerCallback

import harness
from conftest import FAULTS, findings_of, read_jsonl
from harness import FindingCode, Severity, hookimpl
from harness.testing import FaultInjector


class Recorder:
    """Counts every hook call, with the step numbers it saw."""

    name = "recorder"

    def __init__(self) -> None:
        self.calls: dict[str, list[Any]] = {}
        self.resume_state: Any = "never called"

    def _note(self, hook: str, value: Any = None) -> None:
        self.calls.setdefault(hook, []).append(value)

    @hookimpl
    def configure(self, ctx: Any) -> None:
        self._note("configure")

    @hookimpl
    def on_run_start(self, ctx: Any, trainer: Any) -> None:
        self._note("on_run_start", trainer.optimizer is not None)

    @hookimpl
    def inspect_dataset(self, split: str, dataset: Any) -> None:
        self._note("inspect_dataset", (split, len(dataset)))

    @hookimpl
    def inspect_batch(self, step: int, micro_step: int, batch: dict[str, Any]) -> None:
        self._note("inspect_batch", (step, micro_step, tuple(batch["input_ids"].shape)))

    @hookimpl
    def on_loss(self, loss: Any, step: int, micro_step: int) -> None:
        self._note("on_loss", (step, micro_step, loss.requires_grad))

    @hookimpl
    def on_before_optimizer_step(self, step: int, grad_norm: Any, model: Any) -> None:
        grads = [p.grad for p in model.parameters() if p.grad is not None]
        self._note("on_before_optimizer_step", (step, grad_norm is not None, len(grads) > 0))

    @hookimpl
    def on_step_end(self, step: int, metrics: dict[str, Any]) -> None:
        self._note("on_step_end", (step, metrics["skipped"], metrics["micro_batches"], metrics["lr"]))

    @hookimpl
    def on_log(self, step: int, logs: dict[str, float]) -> None:
        self._note("on_log", step)

    @hookimpl
    def checkpoint_state(self, step: int) -> dict[str, Any]:
        return {"saved_at": step}

    @hookimpl
    def on_checkpoint_save(self, step: int, checkpoint_dir: Path) -> None:
        self._note("on_checkpoint_save", (step, checkpoint_dir.name, checkpoint_dir.exists()))

    @hookimpl
    def on_resume(self, checkpoint_dir: Path, state: Any) -> None:
        self.resume_state = (checkpoint_dir.name, state)

    @hookimpl
    def on_run_end(self, status: str, error: Any) -> None:
        self._note("on_run_end", (status, type(error).__name__ if error else None))


def test_hooks_fire_with_consistent_steps(make_trainer: Any) -> None:
    recorder = Recorder()
    trainer = make_trainer(max_steps=3, gradient_accumulation_steps=2)
    ctx = harness.attach(trainer, plugins=[recorder])
    trainer.train()
    calls = recorder.calls
    assert calls["configure"] == [None] and calls["on_run_start"] == [True]
    assert calls["inspect_dataset"] == [("train", 96)]
    assert [c[:2] for c in calls["inspect_batch"]] == [(s, m) for s in (1, 2, 3) for m in (0, 1)]
    assert calls["inspect_batch"][0][2] == (4, 32)
    assert calls["on_loss"] == [(s, m, False) for s in (1, 2, 3) for m in (0, 1)]
    assert calls["on_before_optimizer_step"] == [(s, True, True) for s in (1, 2, 3)]
    assert [c[:3] for c in calls["on_step_end"]] == [(s, False, 2) for s in (1, 2, 3)]
    assert calls["on_run_end"] == [("completed", None)]
    assert (Path(trainer.args.output_dir) / "harness" / "config.yaml").exists()
    assert len(read_jsonl(ctx.run_dir / "metrics.jsonl")) >= 3  # the default metrics_log plugin
    assert findings_of(trainer.args.output_dir) == []  # a clean run makes no findings


@pytest.mark.parametrize("hook", ["inspect_batch", "on_loss", "on_before_optimizer_step", "on_step_end"])
def test_plugin_exception_becomes_finding_and_training_goes_on(make_trainer: Any, hook: str) -> None:
    trainer = make_trainer(max_steps=4)
    harness.attach(trainer, config={"plugins": [FAULTS], "fault_injector": {"raise_in": hook, "raise_at_step": 2}})
    trainer.train()
    assert trainer.state.global_step == 4
    (finding,) = findings_of(trainer.args.output_dir, "INTERNAL_PLUGIN_ERROR")
    assert finding["plugin"] == "fault_injector" and finding["step"] == 2
    assert finding["evidence"]["hook"] == hook
    assert "injected fault in" in finding["evidence"]["traceback"] and "Traceback" in finding["evidence"]["traceback"]


def test_plugin_switched_off_after_too_many_errors(make_trainer: Any) -> None:
    trainer = make_trainer(max_steps=6)
    harness.attach(trainer, config={"plugins": [FAULTS], "max_plugin_errors": 3, "fault_injector": {"raise_in": "on_loss"}})
    trainer.train()
    assert trainer.state.global_step == 6
    assert len(findings_of(trainer.args.output_dir, "INTERNAL_PLUGIN_ERROR")) == 3
    (off,) = findings_of(trainer.args.output_dir, "PLUGIN_DISABLED")
    assert off["step"] == 3


def _snapshots(ctx: Any) -> dict[int, dict[str, Any]]:
    return {r["step"]: r for r in read_jsonl(ctx.run_dir / f"fault_injector.rank-{ctx.rank}.jsonl")}


@pytest.mark.parametrize("optim", ["adamw_torch", "sgd"])
def test_skip_step_leaves_params_and_optimizer_state_bit_identical(make_trainer: Any, optim: str) -> None:
    trainer = make_trainer(max_steps=5, optim=optim, lr_scheduler_type="linear", gradient_accumulation_steps=2)
    ctx = harness.attach(
        trainer,
        config={
            "plugins": [FAULTS],
            "fault_injector": {"report_at_step": 3, "action": "skip_step", "snapshot_steps": [2, 3, 4]},
        },
    )
    trainer.train()
    snaps = _snapshots(ctx)
    assert snaps[3]["skipped"] and not snaps[2]["skipped"] and not snaps[4]["skipped"]
    assert snaps[3]["params_changed"] == [] and snaps[3]["optimizer_changed"] == []
    # the same measurement sees a normal step change things, so it can fail
    assert len(snaps[4]["params_changed"]) > 10
    if optim == "adamw_torch":
        assert snaps[3]["optimizer_tensors"] > 0 and len(snaps[4]["optimizer_changed"]) > 10
    assert snaps[2]["lr"] != snaps[3]["lr"] == snaps[4]["lr"]  # the schedule held still on the skipped step
    (taken,) = findings_of(trainer.args.output_dir, "ACTION_TAKEN")
    assert taken["step"] == 3 and "TEST_FAULT" in taken["message"]
    (fault,) = findings_of(trainer.args.output_dir, "TEST_FAULT")
    assert fault["action"] == "skip_step" and fault["step"] == 3
    assert trainer.state.global_step == 5


def test_stop_ends_training_at_that_step(make_trainer: Any) -> None:
    trainer = make_trainer(max_steps=8)
    harness.attach(trainer, config={"plugins": [FAULTS], "policy": {"TEST_FAULT": "stop"}, "fault_injector": {"report_at_step": 3}})
    trainer.train()
    assert trainer.state.global_step == 3
    assert not list(Path(trainer.args.output_dir).glob("checkpoint-*"))
    assert findings_of(trainer.args.output_dir, "TEST_FAULT")[0]["action"] == "stop"


def test_save_and_stop_writes_a_checkpoint_of_the_state_before_the_bad_step(make_trainer: Any) -> None:
    recorder = Recorder()
    trainer = make_trainer(max_steps=8)
    harness.attach(trainer, plugins=[recorder], config={"plugins": [FAULTS], "fault_injector": {"report_at_step": 4, "action": "save_and_stop"}})
    trainer.train()
    assert trainer.state.global_step == 4
    assert (Path(trainer.args.output_dir) / "checkpoint-4" / "model.safetensors").exists()
    assert recorder.calls["on_checkpoint_save"] == [(4, "checkpoint-4", True)]
    assert recorder.calls["on_run_end"] == [("stopped", None)]


def test_checkpoint_state_comes_back_on_resume(make_trainer: Any, tmp_path: Path) -> None:
    out = tmp_path / "resume"
    first = make_trainer(output_dir=out, max_steps=4, save_strategy="steps", save_steps=2)
    harness.attach(first, plugins=[Recorder()])
    first.train()
    assert (out / "checkpoint-2" / "harness_state" / "rank-0.json").exists()
    recorder = Recorder()
    second = make_trainer(output_dir=out, max_steps=6, save_strategy="steps", save_steps=2)
    harness.attach(second, plugins=[recorder])
    second.train(resume_from_checkpoint=str(out / "checkpoint-4"))
    assert recorder.resume_state == ("checkpoint-4", {"saved_at": 4})
    assert [c[0] for c in recorder.calls["inspect_batch"]] == [5, 6]


class _Crash(TrainerCallback):
    def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        if state.global_step == 2:
            raise RuntimeError("the training loop itself failed")


def test_run_end_fires_after_a_crash_and_findings_survive(make_trainer: Any) -> None:
    recorder = Recorder()
    trainer = make_trainer(max_steps=5, callbacks=[_Crash()])
    harness.attach(trainer, plugins=[recorder], config={"plugins": [FAULTS], "fault_injector": {"report_at_step": 1}})
    with pytest.raises(RuntimeError, match="training loop itself"):
        trainer.train()
    assert recorder.calls["on_run_end"] == [("crashed", "RuntimeError")]
    assert len(findings_of(trainer.args.output_dir, "TEST_FAULT")) == 1
    report = (Path(trainer.args.output_dir) / "harness" / "report.md").read_text(encoding="utf-8")  # written after the crash too
    assert "**Verdict: failed.** training crashed after step 2 with RuntimeError: the training loop itself failed" in report
    assert "| [TEST_FAULT](report/playbooks/harness-core.md#test_fault) | 1 | 1 |" in report


def test_severity_override_and_attach_is_idempotent(make_trainer: Any) -> None:
    trainer = make_trainer(max_steps=2)
    config = {"plugins": [FAULTS], "severity": {"TEST_FAULT": "critical"}, "fault_injector": {"report_at_step": 1}}
    ctx = harness.attach(trainer, config=config)
    assert harness.attach(trainer, config=config) is ctx
    trainer.train()
    (finding,) = findings_of(trainer.args.output_dir, "TEST_FAULT")
    assert finding["severity"] == "critical" and finding["playbook"] == "harness-core#test_fault"


def test_a_plugin_object_works_without_any_config(make_trainer: Any) -> None:
    injector = FaultInjector()
    trainer = make_trainer(max_steps=2)
    harness.attach(trainer, plugins=[injector])
    trainer.train()
    assert injector.snapshots == []


def test_a_second_train_call_guards_each_step_once(make_trainer: Any) -> None:
    recorder = Recorder()
    trainer = make_trainer(max_steps=2)
    harness.attach(trainer, plugins=[recorder])
    trainer.train()
    trainer.train()
    assert [c[0] for c in recorder.calls["on_before_optimizer_step"]] == [1, 2, 1, 2]
    assert recorder.calls["on_run_end"] == [("completed", None), ("completed", None)]


def test_a_skip_asked_after_the_guard_does_not_skip_the_next_step(make_trainer: Any) -> None:
    trainer = make_trainer(max_steps=4)
    ctx = harness.attach(
        trainer,
        config={"plugins": [FAULTS], "fault_injector": {"report_at_step": 2, "report_in": "on_log", "action": "skip_step", "snapshot_steps": [3]}},
    )
    trainer.train()
    (fault,) = findings_of(trainer.args.output_dir, "TEST_FAULT")
    assert fault["step"] == 2 and fault["action"] == "skip_step"
    assert not _snapshots(ctx)[3]["skipped"] and _snapshots(ctx)[3]["params_changed"]
    assert findings_of(trainer.args.output_dir, "ACTION_TAKEN") == []


def test_a_stop_asked_after_the_guard_stops_at_that_step(make_trainer: Any) -> None:
    trainer = make_trainer(max_steps=6)
    harness.attach(trainer, config={"plugins": [FAULTS], "policy": {"TEST_FAULT": "stop"}, "fault_injector": {"report_at_step": 2, "report_in": "on_step_end"}})
    trainer.train()
    assert trainer.state.global_step == 2


def test_harness_stop_from_a_plugin_stops_cleanly(make_trainer: Any) -> None:
    recorder = Recorder()
    trainer = make_trainer(max_steps=6)
    harness.attach(trainer, plugins=[recorder], config={"plugins": [FAULTS], "fault_injector": {"stop_at_step": 3}})
    trainer.train()
    assert trainer.state.global_step == 3
    (stop,) = findings_of(trainer.args.output_dir, "PLUGIN_STOP")
    assert stop["step"] == 3 and "injected stop" in stop["message"]
    assert recorder.calls["on_run_end"] == [("stopped", None)]


def test_an_invalid_action_from_a_plugin_is_a_plugin_error(make_trainer: Any) -> None:
    trainer = make_trainer(max_steps=3)
    harness.attach(trainer, config={"plugins": [FAULTS], "fault_injector": {"report_at_step": 2, "action": "halt"}})
    trainer.train()
    assert trainer.state.global_step == 3
    (error,) = findings_of(trainer.args.output_dir, "INTERNAL_PLUGIN_ERROR")
    assert error["evidence"]["hook"] == "decide_action" and "'halt'" in error["message"]
    assert findings_of(trainer.args.output_dir, "TEST_FAULT")[0]["action"] == "continue"


class _BadState:
    name = "bad_state"

    @hookimpl
    def checkpoint_state(self, step: int) -> dict[str, Any]:
        return {"handle": object()}


def test_unserialisable_plugin_state_does_not_break_the_checkpoint(make_trainer: Any, tmp_path: Path) -> None:
    out = tmp_path / "ckpt"
    trainer = make_trainer(output_dir=out, max_steps=2, save_strategy="steps", save_steps=2)
    harness.attach(trainer, config={"plugins": []}, plugins=[_BadState(), Recorder()])
    trainer.train()
    assert (out / "checkpoint-2" / "model.safetensors").exists()
    import json

    assert json.loads((out / "checkpoint-2" / "harness_state" / "rank-0.json").read_text()) == {"recorder": {"saved_at": 2}}
    (error,) = findings_of(out, "INTERNAL_PLUGIN_ERROR")
    assert error["plugin"] == "bad_state" and error["evidence"]["hook"] == "checkpoint_state"


class _OverflowAwareSGD(torch.optim.SGD):
    """An engine-style optimizer (like DeepSpeed's) that consults its overflow check before updating."""

    overflow = False

    def check_overflow(self) -> bool:
        self.overflow = False
        return False

    def _update_scale(self, overflow: bool) -> None:
        pass

    def step(self, closure: Any = None) -> Any:
        self.check_overflow()
        if self.overflow:
            self.zero_grad(set_to_none=True)
            return None
        return super().step(closure)


class _StubbornSGD(_OverflowAwareSGD):
    """Declares an overflow check but never consults it: a skip cannot hold it."""

    def step(self, closure: Any = None) -> Any:
        return torch.optim.SGD.step(self, closure)


@pytest.mark.parametrize(("optimizer_cls", "held"), [(_OverflowAwareSGD, True), (_StubbornSGD, False)])
def test_engine_optimizer_skip_is_verified(make_trainer: Any, optimizer_cls: type, held: bool) -> None:
    from harness.core.actions import Action
    from harness.hf.optimizers.deepspeed import guard_deepspeed_optimizer

    trainer = make_trainer(max_steps=1)
    ctx = harness.attach(trainer, config={"plugins": []})
    layer = torch.nn.Linear(3, 3)
    before = layer.weight.detach().clone()
    optimizer = optimizer_cls(layer.parameters(), lr=0.5)
    guard_deepspeed_optimizer(optimizer, trainer._harness_bridge.guard, layer)
    layer(torch.ones(2, 3)).sum().backward()
    ctx.pending_action = Action.SKIP_STEP
    optimizer.step()
    assert torch.equal(layer.weight, before) is held
    not_applied = findings_of(trainer.args.output_dir, "SKIP_NOT_APPLIED")
    assert (not_applied == []) is held
    if not held:
        assert not_applied[0]["severity"] == "critical" and "_StubbornSGD" in not_applied[0]["message"]


class _HookRecorder:
    """Implements the hooks no detector in this suite leans on, and records what they got."""

    name = "hook_recorder"

    def __init__(self) -> None:
        from pydantic import BaseModel, ConfigDict, Field

        class Options(BaseModel):
            model_config = ConfigDict(extra="forbid")
            label: str = Field("x", description="a label")

        self.model = Options
        self.options: Any = None
        self.metrics: list[tuple[int, dict[str, Any]]] = []
        self.evaluations: list[tuple[int, dict[str, float]]] = []
        self.findings: list[Any] = []

    @hookimpl
    def add_config(self) -> Any:
        return self.model

    @hookimpl
    def configure(self, options: Any) -> None:
        self.options = options

    @hookimpl
    def declare_codes(self) -> list[FindingCode]:
        return [FindingCode("RECORDER_SAW_EVAL", Severity.INFO, "an evaluation happened", "harness-core#test_fault")]

    @hookimpl
    def on_step_end(self, ctx: Any, step: int) -> None:
        ctx.log_metrics({"recorder/step": step})

    @hookimpl
    def on_metrics(self, step: int, metrics: dict[str, Any]) -> None:
        self.metrics.append((step, dict(metrics)))

    @hookimpl
    def on_evaluate(self, ctx: Any, step: int, metrics: dict[str, float]) -> None:
        self.evaluations.append((step, dict(metrics)))
        ctx.report("RECORDER_SAW_EVAL", f"eval loss {metrics.get('eval_loss')}", step=step)

    @hookimpl
    def on_finding(self, finding: Any) -> None:
        self.findings.append(finding)


def test_config_metrics_evaluate_and_finding_hooks_fire_with_what_they_promise(make_trainer: Any, lm_rows: Any) -> None:
    recorder = _HookRecorder()
    trainer = make_trainer(max_steps=4, eval_strategy="steps", eval_steps=2, eval_dataset=lm_rows.select(range(8)))
    harness.attach(trainer, config={"plugins": ["metrics_log"], "hook_recorder": {"label": "y"}}, plugins=[recorder])
    trainer.train()
    assert recorder.options.label == "y"  # add_config's model validated the YAML section, configure got the instance
    assert recorder.metrics == [(s, {"recorder/step": s}) for s in (1, 2, 3, 4)]
    assert [s for s, _ in recorder.evaluations] == [2, 4] and all("eval_loss" in m for _, m in recorder.evaluations)
    assert [(f.code, f.step, f.plugin) for f in recorder.findings] == [("RECORDER_SAW_EVAL", 2, "hook_recorder"), ("RECORDER_SAW_EVAL", 4, "hook_recorder")]


def test_the_top_level_attach_takes_only_as_the_readme_shows(make_trainer: Any) -> None:
    """``harness.attach(trainer, only=[...])`` runs exactly those plugins (it raised TypeError: the re-export lacked it)."""
    trainer = make_trainer(max_steps=1)
    ctx = harness.attach(trainer, only=["nan_guard", "metrics_log"])
    assert ctx.manager.names == ["nan_guard", "metrics_log"]


@pytest.mark.parametrize("show_notes", [True, False])
def test_attach_says_the_config_notes_unless_its_caller_did(make_trainer: Any, caplog: Any, show_notes: bool) -> None:
    """A section of a plugin that is not enabled takes no effect: attach says so on rank 0; under ``harness wrap``
    (``show_notes=False``, which wrap's auto-attach passes) wrap's own check said it already, so it is not said twice."""
    caplog.set_level(logging.WARNING, logger="harness.bridge")
    harness.attach(make_trainer(max_steps=1), config={"layer_stats": {"interval": 5}}, show_notes=show_notes)
    noted = [r.getMessage() for r in caplog.records if "note:" in r.getMessage()]
    if show_notes:
        assert len(noted) == 1 and "'layer_stats' section is set but the plugin 'layer_stats' is not enabled" in noted[0], noted
    else:
        assert noted == []
