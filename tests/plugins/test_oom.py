"""oom: an out-of-memory error raised inside a real forward pass becomes OUT_OF_MEMORY, and the error still reaches the caller."""
from __future__ import annotations

import json
import sys
import time
from pathlib import Path
from typing import Any

import pytest
import torch

import harness
from conftest import EXAMPLE, FAULTS, findings_of, harness_cli, write_yaml


def _run(make_trainer: Any, faults: dict[str, Any], **args: Any) -> tuple[Any, Any]:
    trainer = make_trainer(**{"max_steps": 4, **args})
    ctx = harness.attach(trainer, config={"plugins": ["oom", FAULTS], "fault_injector": faults})
    return trainer, ctx


def test_an_oom_in_a_forward_pass_is_found_with_its_batch_memory_and_causes(make_trainer: Any) -> None:
    trainer, ctx = _run(make_trainer, {"oom_at_step": 2}, gradient_accumulation_steps=2, max_steps=3)
    with pytest.raises(torch.OutOfMemoryError):  # never swallowed: the caller sees the crash
        trainer.train()
    assert trainer.state.global_step == 1
    (finding,) = findings_of(trainer.args.output_dir, "OUT_OF_MEMORY")
    evidence = finding["evidence"]
    assert finding["severity"] == "critical" and finding["step"] == 2 and finding["plugin"] == "oom"
    assert evidence["micro_batch"] == 0 and evidence["phase"] == "forward" and "_pre_forward" in evidence["failed_at"]
    assert evidence["batch"]["shapes"]["input_ids"] == [4, 32] and evidence["batch"]["sequence_lengths"] == [32, 32, 32, 32]
    assert "micro-batch 4x32 tokens" in finding["message"] and "out of memory at step 2, micro-batch 0 (forward)" in finding["message"]
    assert evidence["memory_before_step"]["rss"] > 10 * 2**20 and evidence["memory_previous_step"]["rss"] > 0
    assert evidence["memory_at_oom"]["peak_rss"] >= evidence["memory_at_oom"]["rss"] > 0 and "RSS" in finding["message"]
    assert evidence["steps_completed"] == 1 and evidence["longest_padded_length_before"] == 32
    assert evidence["largest_tensors"][0]["bytes"] > 0 and any((t["name"] or "").startswith("parameter model.") for t in evidence["largest_tensors"])
    causes = [c["cause"] for c in evidence["causes"]]
    assert causes[:1] == ["activations"] and set(causes) >= {"batch_too_large", "sharding", "sequence_length"}
    capture = json.loads(Path(evidence["capture"]).read_text())
    assert capture["code"] == "OUT_OF_MEMORY" and "out of memory: no forward pass" in capture["per_sample_loss"]
    assert len(capture["samples"]) == 4 and capture["step"] == 2
    forensics = json.loads(Path(evidence["forensics"]).read_text())
    assert len(forensics["largest_tensors"]["tensors"]) == 20 and forensics["largest_tensors"]["bytes_by_device"]["cpu"] > 0
    assert sorted(p.name for p in (ctx.run_dir / "oom").iterdir()) == ["oom.rank-0.json"]  # JSON only: no pickle
    report = (ctx.run_dir / "report.md").read_text(encoding="utf-8")
    assert "OUT_OF_MEMORY" in report and "memory.md#out_of_memory" in report and "no playbook section" not in report


def test_the_first_step_points_at_the_static_budget(make_trainer: Any) -> None:
    trainer = make_trainer(max_steps=2)
    harness.attach(trainer, config={"plugins": ["oom", FAULTS], "fault_injector": {"oom_at_step": 1}, "oom": {"scan_tensors": False}})
    with pytest.raises(torch.OutOfMemoryError):
        trainer.train()
    (finding,) = findings_of(trainer.args.output_dir, "OUT_OF_MEMORY")
    top = finding["evidence"]["causes"][0]
    assert top["cause"] == "batch_too_large" and "first step of the run" in top["evidence"][0]
    assert finding["evidence"]["memory_previous_step"] == {} and finding["evidence"]["longest_padded_length_before"] is None


def test_a_clean_run_reports_nothing_and_writes_no_oom_files(make_trainer: Any) -> None:
    trainer, ctx = _run(make_trainer, {}, max_steps=2)
    trainer.train()
    assert [f for f in findings_of(trainer.args.output_dir) if f["code"] == "OUT_OF_MEMORY" or f["severity"] in ("warning", "error", "critical")] == []
    assert not (ctx.run_dir / "oom").exists()
    plugin = ctx.manager.plugin("oom")
    assert plugin._steps_done == 2 and plugin._longest == 32 and not plugin._recording


def test_a_crash_that_is_not_an_oom_is_left_alone_and_broken_forensics_still_report(make_trainer: Any) -> None:
    trainer = make_trainer(max_steps=3)
    ctx = harness.attach(trainer, config={"plugins": ["oom"], "oom": {"scan_tensors": False}})
    plugin = ctx.manager.plugin("oom")
    plugin.on_run_start(ctx=ctx, trainer=trainer)
    plugin.on_run_end(ctx=ctx, status="crashed", error=ValueError("a bug, not memory"))
    assert findings_of(trainer.args.output_dir, "OUT_OF_MEMORY") == [] and not (ctx.run_dir / "oom").exists()

    def broken(*args: Any, **kwargs: Any) -> str:
        raise KeyError("a bug in the forensics")

    plugin._message = broken  # our own failure, injected: the finding must not be lost with it
    plugin.on_run_end(ctx=ctx, status="crashed", error=RuntimeError("CUDA error: out of memory"))
    (finding,) = findings_of(trainer.args.output_dir, "OUT_OF_MEMORY")
    assert "the forensics failed (KeyError" in finding["message"] and finding["severity"] == "critical"


def test_the_per_step_hooks_cost_microseconds(make_trainer: Any) -> None:
    trainer = make_trainer(max_steps=1)
    ctx = harness.attach(trainer, config={"plugins": ["oom"]})
    plugin = ctx.manager.plugin("oom")
    plugin.on_run_start(ctx=ctx, trainer=trainer)
    batch = {"input_ids": torch.zeros(4, 32, dtype=torch.long), "attention_mask": torch.ones(4, 32, dtype=torch.long)}
    rounds = 2000
    started = time.perf_counter()
    for step in range(1, rounds + 1):
        plugin.inspect_batch(batch=batch, step=step, micro_step=0)
        plugin.inspect_batch(batch=batch, step=step, micro_step=1)
        plugin.on_step_end(step=step)
    per_step_us = (time.perf_counter() - started) / rounds * 1e6
    assert per_step_us < 50, f"{per_step_us:.1f} us per step (two micro-batches)"
    assert plugin._longest == 32 and len(plugin._lengths) == plugin._lengths.maxlen and plugin._step_length == 32


@pytest.mark.slow  # a long end-to-end run (subprocesses or hundreds of steps): CI runs it, the quick subset does not
def test_through_wrap_the_script_fails_and_the_findings_and_report_survive(tmp_path: Path) -> None:
    out = tmp_path / "run"
    config = write_yaml(tmp_path / "h.yaml", {"plugins": ["oom", "nan_guard", FAULTS], "fault_injector": {"oom_at_step": 2}})
    result = harness_cli("wrap", "--config", str(config), "--", sys.executable, str(EXAMPLE), "--output_dir", str(out), "--max_steps", "4")
    assert result.returncode != 0 and "OutOfMemoryError" in result.stderr, result.stderr[-3000:]
    (finding,) = findings_of(out, "OUT_OF_MEMORY")
    assert finding["step"] == 2 and finding["evidence"]["phase"] == "forward" and finding["evidence"]["memory_before_step"]["rss"] > 0
    assert Path(finding["evidence"]["capture"]).exists()
    assert "OUT_OF_MEMORY" in (out / "harness" / "report.md").read_text(encoding="utf-8")
