"""preemption: a signal in the middle of a step becomes a complete checkpoint of that step and a stop; the resume is silent.

Real Trainer, real signal: a callback sends ``os.kill(os.getpid(), SIGUSR1)``
at the start of step 4, while the step's forward and backward are still to
come; the guard of step 4 shares it, and every rank finishes the step (its
update applied), saves and stops.
"""
from __future__ import annotations

import json
import os
import signal
from pathlib import Path
from typing import Any

import pytest
import torch
from transformers import TrainerCallback

import harness
from conftest import findings_of
from harness.core.config import Catalog, load_config
from harness.core.errors import HarnessError

STEP = 4
CHECKPOINT_FILES = ("model.safetensors", "optimizer.pt", "scheduler.pt", "rng_state.pth", "trainer_state.json",
                    "training_args.bin", "harness_state/rank-0.json")


class SignalAt(TrainerCallback):
    """Sends ``signum`` to this process when step ``step`` begins (its batches not yet computed)."""

    def __init__(self, step: int, signum: int) -> None:
        self.step, self.signum = step, signum

    def on_step_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        if state.global_step + 1 == self.step:
            os.kill(os.getpid(), self.signum)


def _loud(out: Path) -> list[tuple[str, str, int]]:
    return [(f["code"], f["severity"], f["step"]) for f in findings_of(out) if f["severity"] not in ("info", "debug")]


def test_a_signal_mid_step_saves_that_step_on_every_part_and_stops(make_trainer: Any, tmp_path: Path) -> None:
    out = tmp_path / "run"
    calls: list[int] = []
    user_handler = lambda signum, frame: calls.append(signum)  # noqa: E731 - the script's own handler
    before = {signal.SIGUSR1: signal.signal(signal.SIGUSR1, user_handler), signal.SIGTERM: signal.getsignal(signal.SIGTERM)}
    try:
        trainer = make_trainer(output_dir=out, max_steps=8, callbacks=[SignalAt(STEP, signal.SIGUSR1)])
        harness.attach(trainer)
        trainer.train()
        # the user's handler was chained to, and both handlers are the script's again
        assert calls == [signal.SIGUSR1]
        assert signal.getsignal(signal.SIGUSR1) is user_handler and signal.getsignal(signal.SIGTERM) == before[signal.SIGTERM]
    finally:
        signal.signal(signal.SIGUSR1, before[signal.SIGUSR1])

    assert trainer.state.global_step == STEP
    checkpoint = out / f"checkpoint-{STEP}"
    assert sorted(p.name for p in out.glob("checkpoint-*")) == [checkpoint.name]
    for name in CHECKPOINT_FILES:
        assert (checkpoint / name).stat().st_size > 0, name
    assert json.loads((checkpoint / "trainer_state.json").read_text())["global_step"] == STEP
    assert "resume_check" in json.loads((checkpoint / "harness_state" / "rank-0.json").read_text())

    (finding,) = findings_of(out, "PREEMPTED")
    assert finding["severity"] == "info" and finding["step"] == STEP and finding["rank"] == 0 and finding["action"] == "continue"
    evidence = finding["evidence"]
    assert evidence["signal"] == "SIGUSR1" and evidence["rank"] == 0 and evidence["checkpoint"] == str(checkpoint)
    assert str(checkpoint) in finding["message"]
    (taken,) = findings_of(out, "ACTION_TAKEN")
    assert taken["evidence"]["action"] == "save_and_stop" and "PREEMPTED" in taken["message"]
    assert taken["evidence"]["update_applied"] is True and "applied the update" in taken["message"]
    # the step the signal interrupted is in the checkpoint: Adam counted 4 updates and the schedule moved 4 times
    optimizer = torch.load(checkpoint / "optimizer.pt", weights_only=True)
    assert {int(state["step"]) for state in optimizer["state"].values()} == {STEP}
    assert torch.load(checkpoint / "scheduler.pt", weights_only=True)["last_epoch"] == STEP
    assert _loud(out) == []

    resumed = make_trainer(output_dir=out, max_steps=8)
    harness.attach(resumed)
    resumed.train(resume_from_checkpoint=str(checkpoint))
    assert resumed.state.global_step == 8
    assert _loud(out) == []  # resume_check, data_hash, lr_schedule: nothing to say about a preemption checkpoint
    assert [f["code"] for f in findings_of(out) if f["code"].startswith(("RESUME_", "DATA_"))] == []


class SignalIn(TrainerCallback):
    """Sends SIGTERM from inside the Trainer's evaluation or save of step 2 (``on_evaluate``/``on_save`` run within them)."""

    def __init__(self, phase: str) -> None:
        self.phase = phase

    def on_evaluate(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        if self.phase == "evaluate" and state.global_step == 2:
            os.kill(os.getpid(), signal.SIGTERM)

    def on_save(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        if self.phase == "save" and state.global_step == 2:
            os.kill(os.getpid(), signal.SIGTERM)


@pytest.mark.parametrize("phase", ["evaluate", "save"])
def test_a_signal_during_an_evaluation_or_a_save_stops_at_the_next_step(make_trainer: Any, lm_rows: Any, tmp_path: Path, phase: str) -> None:
    out = tmp_path / "run"
    extra: dict[str, Any] = {"eval_strategy": "steps", "eval_steps": 2, "eval_dataset": lm_rows.select(range(8))} if phase == "evaluate" \
        else {"save_strategy": "steps", "save_steps": 2}
    trainer = make_trainer(output_dir=out, max_steps=6, callbacks=[SignalIn(phase)], **extra)
    harness.attach(trainer, config={"disable": ["contamination"]})  # the eval rows come from the training corpus on purpose
    trainer.train()
    assert trainer.state.global_step == 3
    (finding,) = findings_of(out, "PREEMPTED")
    assert finding["step"] == 3 and finding["evidence"]["signal"] == "SIGTERM" and finding["evidence"]["received_at_step"] == 2
    assert (out / "checkpoint-3" / "optimizer.pt").exists() and not (out / "checkpoint-4").exists()
    assert _loud(out) == []


def test_a_clean_run_is_silent_and_leaves_the_handlers_as_they_were(make_trainer: Any, tmp_path: Path) -> None:
    out = tmp_path / "run"
    before = {s: signal.getsignal(s) for s in (signal.SIGTERM, signal.SIGUSR1)}
    trainer = make_trainer(output_dir=out, max_steps=3)
    harness.attach(trainer)
    trainer.train()
    assert trainer.state.global_step == 3
    assert {s: signal.getsignal(s) for s in before} == before
    assert findings_of(out, "PREEMPTED") == [] and _loud(out) == []


def test_a_signal_not_configured_is_not_watched(make_trainer: Any, tmp_path: Path) -> None:
    """`signals: [SIGUSR2]`: SIGUSR1 goes to the script's own handler alone and training runs to its end."""
    out = tmp_path / "run"
    calls: list[int] = []
    previous = signal.signal(signal.SIGUSR1, lambda signum, frame: calls.append(signum))
    try:
        trainer = make_trainer(output_dir=out, max_steps=3, callbacks=[SignalAt(2, signal.SIGUSR1)])
        harness.attach(trainer, config={"preemption": {"signals": ["USR2"]}})
        trainer.train()
    finally:
        signal.signal(signal.SIGUSR1, previous)
    assert calls == [signal.SIGUSR1] and trainer.state.global_step == 3 and findings_of(out, "PREEMPTED") == []


@pytest.mark.parametrize("name, says", [("SIGKILL", "cannot be caught"), ("SIGTREM", "valid names: ")])
def test_a_bad_signal_name_is_a_clear_config_error(name: str, says: str) -> None:
    with pytest.raises(HarnessError) as error:
        load_config({"preemption": {"signals": [name]}}, Catalog.build())
    assert "preemption" in str(error.value) and says in str(error.value) and name in str(error.value)
