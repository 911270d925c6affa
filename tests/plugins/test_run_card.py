"""run_card: the card's parameter count is the model's; planned tokens, 6ND, memory, measured throughput, shown in the report."""
from __future__ import annotations

import json
from typing import Any

import pytest

import harness
from conftest import findings_of
from harness.tools.estimate import memory_per_device


def test_the_card_holds_the_plan_and_the_measured_estimate(make_trainer: Any) -> None:
    trainer = make_trainer(max_steps=12)
    ctx = harness.attach(trainer, config={
        "plugins": ["metrics_log", "run_card"],
        "run_card": {"acceptance": "eval_loss below 4.0", "data_sources": {"corpus.txt": 1.0}, "measure_after": 5},
    })
    trainer.train()
    card = json.loads((ctx.run_dir / "run_card.json").read_text(encoding="utf-8"))
    params = sum(p.numel() for p in trainer.model.parameters())
    assert card["parameters"] == card["trainable_parameters"] == params
    assert card["sequence_length"] == 32 and card["planned_tokens"] == 12 * 4 * 32
    assert card["compute_flops"] == pytest.approx(6 * params * 12 * 4 * 32)
    assert card["memory_per_device_bytes"]["total"] == memory_per_device(params, "fp32", 0, 1).total == 16 * params
    measured = card["measured"]
    assert measured["after_step"] == 5 and measured["tokens_per_s"] > 0 and measured["mfu"] is None  # no peak known on CPU
    assert measured["estimated_total_s"] == pytest.approx(measured["median_step_s"] * 12)
    assert card["acceptance"] == "eval_loss below 4.0" and card["data_sources"] == {"corpus.txt": 1.0}
    report = (ctx.run_dir / "report.md").read_text(encoding="utf-8")
    assert "## Plan and estimates (run_card)" in report and f"| parameters | {params:,} |" in report
    assert "| acceptance | eval_loss below 4.0 |" in report and "[run_card.json](run_card.json)" in report
    assert findings_of(trainer.args.output_dir) == []


def test_an_estimate_that_cannot_be_written_costs_the_card_only(make_trainer: Any, caplog: pytest.LogCaptureFixture) -> None:
    """The measured card is written by a thread the step does not wait for; its failure is a warning, and the run end
    does not wait for a file that will never come."""
    import time

    from transformers import TrainerCallback

    class BlockTheCard(TrainerCallback):
        def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
            if state.global_step == 2:
                (ctx.run_dir / ".run_card.json.tmp").mkdir()  # the card's temporary file cannot be created any more

    trainer = make_trainer(max_steps=8, callbacks=[BlockTheCard()])
    ctx = harness.attach(trainer, config={"plugins": ["metrics_log", "run_card"], "run_card": {"measure_after": 4}})
    began = time.monotonic()
    trainer.train()
    assert time.monotonic() - began < 25  # the run end's wait is for a thread that ended, not its 30 s timeout
    assert trainer.state.global_step == 8
    assert "run_card: could not write" in caplog.text
    assert json.loads((ctx.run_dir / "run_card.json").read_text(encoding="utf-8"))["measured"] is None  # the card before it


def test_a_writer_thread_that_cannot_start_is_not_waited_for(make_trainer: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    import time

    import harness.plugins.run_card as run_card

    def no_threads(*args: Any) -> None:
        raise RuntimeError("can't start new thread")

    monkeypatch.setattr(run_card._thread, "start_new_thread", no_threads)
    trainer = make_trainer(max_steps=6)
    harness.attach(trainer, config={"plugins": ["metrics_log", "run_card"], "run_card": {"measure_after": 3}})
    began = time.monotonic()
    trainer.train()
    assert time.monotonic() - began < 25 and trainer.state.global_step == 6  # not the run end's 30 s wait
    assert any("can't start new thread" in f["message"] for f in findings_of(trainer.args.output_dir, "INTERNAL_PLUGIN_ERROR"))
