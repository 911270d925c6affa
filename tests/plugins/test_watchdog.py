"""watchdog: a data loader that blocks at step 5 of a real Trainer run is RANK_HANG at step 5, named; a clean run is silent."""
from __future__ import annotations

import logging
import time
from pathlib import Path
from typing import Any

import harness
from conftest import FAULTS, findings_of
from harness.cli import main as harness_main

FAST = {"floor_s": 2.0, "factor": 3}  # short enough for a test, long enough for a loaded 2-core machine


def test_a_blocked_data_loader_is_found_at_its_step_and_named(make_trainer: Any, capsys: Any, caplog: Any) -> None:
    caplog.set_level(logging.INFO, logger="harness.watchdog")
    trainer = make_trainer(max_steps=7)
    ctx = harness.attach(trainer, config={"plugins": ["watchdog", "metrics_log", FAULTS], "watchdog": FAST,
                                          "fault_injector": {"hang_data_at_step": 5, "hang_data_s": 6.0}})
    started = time.monotonic()
    trainer.train()
    assert trainer.state.global_step == 7 and time.monotonic() - started >= 6.0  # it blocked, then recovered (hang_action: report)
    hangs = findings_of(trainer.args.output_dir, "RANK_HANG")
    assert len(hangs) == 1, [(f["step"], f["message"]) for f in hangs]  # once per hang
    finding = hangs[0]
    evidence = finding["evidence"]
    assert finding["severity"] == "critical" and finding["step"] == 5 and finding["rank"] == 0 and finding["plugin"] == "watchdog"
    assert evidence["phase"] == "data" and evidence["last_progress"] == "step 4 ended" and evidence["progress"] == [4, 0]
    assert evidence["where_kind"] == "data" and evidence["where"].startswith("in the data loader's __next__ (in the dataset's __getitem")
    assert "hang_fault.py" in evidence["where"] and "fetching the step's batches" in evidence["where"]
    assert 2.0 <= evidence["threshold_s"] <= 4.0 and evidence["threshold_s"] < evidence["seconds_stalled"] < 6.0
    assert evidence["innermost_frames"][0].startswith("wait (") and evidence["stack_dump"] == "traceback"
    assert "in the data loader's __next__" in finding["message"] and "step 5" in finding["message"]
    stacks = Path(evidence["stack_file"])
    assert stacks == ctx.run_dir / "hangs" / "rank-0-step-5.txt"
    text = stacks.read_text(encoding="utf-8")
    assert text.startswith("RANK_HANG: rank 0") and "the training thread" in text and "__getitem" in text and "_next_data" in text
    assert "harness-watchdog-rank-0" in text  # every thread, the watchdog's own included
    report = (ctx.run_dir / "report.md").read_text(encoding="utf-8")
    assert "RANK_HANG" in report and "rank 0 stalled first, at step 5" in report and "hangs/rank-0-step-5.txt" in report
    assert harness_main(["explain", str(trainer.args.output_dir)]) == 0
    captured = capsys.readouterr()
    out = captured.out
    # the live console line, once, from the watchdog thread while the training thread was still blocked
    assert captured.err.count("[harness] step 5 RANK_HANG critical: rank 0 made no progress") == 1, captured.err[-2000:]
    assert "[critical] RANK_HANG" in out and "stalled first: rank 0 stalled first, at step 5" in " ".join(out.split())
    # the console printed it: its log record stays under warning, so that no last-resort handler prints it a second time
    hang_records = [r for r in caplog.records if r.getMessage().startswith("harness watchdog: rank 0 made no progress")]
    assert [r.levelno for r in hang_records] == [logging.INFO], [(r.levelname, r.getMessage()[:80]) for r in caplog.records]
    plugin = ctx.manager.plugin("watchdog")
    assert plugin._thread is None and len(plugin.fired) == 1  # stopped at run end


def test_a_clean_run_with_an_evaluation_and_a_slow_first_save_is_silent(make_trainer: Any, lm_rows: Any) -> None:
    trainer = make_trainer(max_steps=8, eval_strategy="steps", eval_steps=3, save_strategy="steps", save_steps=4,
                           eval_dataset=lm_rows.select(range(16)))
    save = trainer._save_checkpoint

    def slow_save(*args: Any, **kwargs: Any) -> Any:  # cold storage: each save takes longer than the floor
        time.sleep(2.5)
        return save(*args, **kwargs)

    trainer._save_checkpoint = slow_save
    ctx = harness.attach(trainer, config={"plugins": ["defaults"], "disable": ["contamination"], "watchdog": FAST})  # eval rows are train rows
    trainer.train()
    assert trainer.state.global_step == 8
    loud = [f for f in findings_of(trainer.args.output_dir) if f["severity"] in ("warning", "error", "critical")]
    assert loud == [], loud
    plugin = ctx.manager.plugin("watchdog")
    times = plugin._clock.times
    assert plugin.fired == [] and times.count["save"] == 2 and times.count["eval"] == 3 and times.count["compute"] == 8
    assert times.typical("save") >= 2.5 and times.typical("data") < 2.0  # the saves were timed as saves, not as waits for data
    assert not (ctx.run_dir / "hangs").exists()


def test_the_evidence_keeps_a_stall_over_its_threshold_at_millisecond_precision() -> None:
    from harness.plugins.watchdog import stall_in_ms

    assert stall_in_ms(2.0004, 2.0) == (2.001, 2.0)
    assert stall_in_ms(2.0007, 2.0006) == (2.001, 2.0)
    for stalled, threshold in [(1e-4, 0.0), (5.0000001, 5.0), (3.1234, 3.1233), (10.0, 9.9999)]:
        shown_stalled, shown_threshold = stall_in_ms(stalled, threshold)
        assert shown_threshold < shown_stalled and shown_threshold <= threshold and shown_stalled >= stalled


def _two_rank_ctx(run_dir: Path, stream: Any) -> Any:
    from types import SimpleNamespace

    from harness.core.console import Console

    def path(*parts: str) -> Path:  # as RunContext.path: the folder is made
        target = run_dir.joinpath(*parts)
        target.parent.mkdir(parents=True, exist_ok=True)
        return target

    run_dir.mkdir(parents=True, exist_ok=True)
    return SimpleNamespace(rank=0, world_size=2, run_dir=run_dir, path=path,
                           options=SimpleNamespace(severity={}), findings=[], console=Console(stream=stream), manager=None)


def _waiting_stall() -> tuple[Any, Any]:
    from harness.lib.hang_frames import Where
    from harness.lib.hang_watch import BATCH, COMPUTE, Stall

    stall = Stall((time.monotonic() - 3.2, BATCH, 10, 0), COMPUTE, 3.2, 3.0, "floor_s 3 s", time.time() - 3.2)
    return stall, Where("in all_reduce at the step guard", "collective", ["all_reduce (.../torch/distributed/distributed_c10d.py:2)"])


def test_rank_0_waiting_in_a_collective_names_the_rank_that_stalled_first_from_its_spill_file(tmp_path: Path) -> None:
    import io

    from harness.core.findings import Finding, FindingsFile, Severity
    from harness.plugins.watchdog import Watchdog, WatchdogOptions

    run_dir = tmp_path / "out" / "harness"
    stream = io.StringIO()
    ctx = _two_rank_ctx(run_dir, stream)
    peer = Finding(code="RANK_HANG", severity=Severity.CRITICAL, plugin="watchdog", message="rank 1 made no progress", step=10, rank=1,
                   evidence={"where": "in pre_hook (.../train2.py:73)", "where_kind": "other", "progress": [9, 1],
                             "stack_file": str(run_dir / "hangs" / "rank-1-step-10.txt"), "stalled_since_unix": time.time() - 3.5})
    sink = FindingsFile(run_dir / "ranks" / "findings.rank-1.jsonl")
    sink.append(peer)
    sink.close()
    plugin = Watchdog()
    plugin.ctx, plugin.options = ctx, WatchdogOptions(floor_s=3.0)
    stall, where = _waiting_stall()
    started = time.monotonic()
    plugin._record(ctx, plugin.options, stall, where, False)  # what the watchdog thread runs when it fires
    assert time.monotonic() - started < 1.5  # rank 1's finding was there: no wait
    line = stream.getvalue()
    assert line.startswith("[harness] step 10 RANK_HANG critical: rank 0 made no progress for 3.2 s at step 10: rank 0 is waiting "
                           "in all_reduce at the step guard; rank 1 stalled first, at step 10 in pre_hook (.../train2.py:73)"), line
    (finding,) = ctx.findings
    assert finding.evidence["stalled_first"] == {"rank": 1, "step": 10, "where": "in pre_hook (.../train2.py:73)",
                                                 "stack_file": "hangs/rank-1-step-10.txt", "finding": peer.id}
    assert "its stacks in the run directory's hangs/rank-1-step-10.txt" in finding.message
    assert "every thread's stack in the run directory's hangs/rank-0-step-10.txt" in finding.message
    assert Path(finding.evidence["stack_file"]) == run_dir / "hangs" / "rank-0-step-10.txt"  # the evidence keeps the real path


def test_rank_0_waiting_without_the_other_ranks_findings_says_the_stall_is_probably_elsewhere(
    tmp_path: Path, monkeypatch: Any
) -> None:
    import io

    import harness.plugins.watchdog as watchdog
    from harness.plugins.watchdog import Watchdog, WatchdogOptions

    monkeypatch.setattr(watchdog, "PEER_WAIT_S", 0.4)
    stream = io.StringIO()
    ctx = _two_rank_ctx(tmp_path / "out" / "harness", stream)
    plugin = Watchdog()
    plugin.ctx, plugin.options = ctx, WatchdogOptions(floor_s=3.0)
    stall, where = _waiting_stall()
    started = time.monotonic()
    plugin._record(ctx, plugin.options, stall, where, False)
    assert 0.4 <= time.monotonic() - started < 3.0  # a bounded wait for the other ranks' findings
    line = stream.getvalue()
    assert ("rank 0 is waiting in a collective (in all_reduce at the step guard): the rank that stalled is probably another one"
            in line), line
    assert ctx.findings[0].evidence["stalled_first"] is None


def test_a_copied_run_directory_shows_the_stacks_relative_to_the_copy(make_trainer: Any, capsys: Any, tmp_path: Path) -> None:
    import shutil

    trainer = make_trainer(max_steps=6)
    harness.attach(trainer, config={"plugins": ["watchdog", "metrics_log", FAULTS], "watchdog": FAST,
                                    "fault_injector": {"hang_data_at_step": 5, "hang_data_s": 5.0}})
    trainer.train()
    original = Path(trainer.args.output_dir)
    copy = tmp_path / "received" / "run-copy"
    shutil.copytree(original, copy)
    shutil.rmtree(original)  # the paths the run wrote resolve nowhere now
    capsys.readouterr()
    assert harness_main(["report", str(copy), "--no-plots"]) == 0
    report = (copy / "harness" / "report.md").read_text(encoding="utf-8")
    hangs = report[report.index("## Hangs"):]
    assert "stacks in hangs/rank-0-step-5.txt" in hangs and str(original) not in hangs, hangs[:1500]
    assert harness_main(["explain", str(copy)]) == 0
    out = " ".join(capsys.readouterr().out.split())
    assert "stacks in hangs/rank-0-step-5.txt" in out and str(original) not in out, out[-2000:]
    next_step = out[out.index("next: ", out.index("RANK_HANG")):]
    next_step = next_step[:next_step.index("more: ")]
    # the next step is the stack file, in the copy; not `harness explain`, which printed it
    assert "harness explain" not in next_step and f"{copy}/harness/hangs/rank-0-step-5.txt" in next_step, next_step
