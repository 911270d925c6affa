"""Rank 0 copies other ranks' spill files into findings.jsonl at the end of a train() call: once per id, no collective.

What the step exchange carried is not written again; what no exchange carried (a finding made in on_run_end, an
off-thread finding, a queue a crash cut off) lands once and is announced; an earlier call's leftovers are written but
not announced as news; a rank that is gone never holds rank 0 longer than the bounded run-end wait.
"""
from __future__ import annotations

import time
from pathlib import Path

import pytest

from harness.core.codes import CORE_CODES
from harness.core.config import Catalog, resolve_config
from harness.core.context import RunContext
from harness.core.distributed import DistInfo
from harness.core.findings import Finding, FindingsFile, Severity, findings_path, read_findings
from harness.core.manager import HarnessPluginManager
from harness.hf import lifecycle
from harness.hf.lifecycle import RunLifecycle


def _ctx(run_dir: Path, rank: int = 0, world_size: int = 2) -> RunContext:
    catalog = Catalog.build(autoload=False)
    return RunContext(resolve_config({"plugins": []}, catalog), {c.code: c for c in CORE_CODES}, HarnessPluginManager(), run_dir,
                      DistInfo(rank=rank, world_size=world_size, local_rank=rank))


def _finding(code: str, rank: int = 1) -> Finding:
    return Finding(code=code, severity=Severity.WARNING, plugin="p", message=code, step=5, rank=rank)


def _spill(run_dir: Path, rank: int, *findings: Finding, torn: bool = False) -> None:
    sink = FindingsFile(findings_path(run_dir, rank))
    for finding in findings:
        sink.append(finding)
    sink.close()
    if torn:  # a rank killed (or still writing) half-way through a line
        with findings_path(run_dir, rank).open("a", encoding="utf-8") as handle:
            handle.write('{"code": "TORN", "sev')


def test_rank_0_merges_what_no_exchange_carried_once_and_announces_only_this_calls(tmp_path: Path) -> None:
    run_dir = tmp_path / "harness"
    earlier, exchanged, late, other_job = _finding("EARLIER"), _finding("EXCHANGED"), _finding("LATE"), _finding("OTHER_JOB", rank=5)
    _spill(run_dir, 1, earlier)  # left by an earlier call whose rank 0 was killed before it could copy it
    _spill(run_dir, 5, other_job)  # an earlier, larger job's rank 5: not this job's (the report still reads it)
    ctx = _ctx(run_dir)
    heard: list[str] = []
    ctx.finding_observers.append(lambda f: heard.append(f.code))
    ctx.note_rank_findings()  # the call begins

    _spill(run_dir, 1, exchanged)
    ctx._hub.file.append(exchanged)  # as the step exchange delivered it
    _spill(run_dir, 1, late, torn=True)  # rank 1's on_run_end, after the last exchange

    merged = ctx.merge_rank_findings()
    assert sorted(f.code for f in merged) == ["EARLIER", "LATE"]
    assert heard == ["LATE"] and [f.code for f in ctx.findings] == ["LATE"]
    assert ctx.merge_rank_findings() == [] and heard == ["LATE"]  # a second call end: nothing twice
    ctx.close()
    codes = [f.code for f in read_findings(run_dir / "findings.jsonl")]
    assert sorted(codes) == ["EARLIER", "EXCHANGED", "LATE"]
    (back,) = [f for f in read_findings(run_dir / "findings.jsonl") if f.code == "LATE"]
    assert (back.id, back.rank, back.step) == (late.id, 1, 5)


def test_other_ranks_and_a_single_process_merge_nothing(tmp_path: Path) -> None:
    run_dir = tmp_path / "harness"
    _spill(run_dir, 1, _finding("LATE"))
    rank_1 = _ctx(run_dir, rank=1)
    assert rank_1.merge_rank_findings() == []  # only rank 0 writes findings.jsonl
    rank_1.close()
    assert not (run_dir / "findings.jsonl").exists()
    alone = _ctx(run_dir, world_size=1)
    assert alone.merge_rank_findings() == []
    alone.close()
    assert read_findings(run_dir / "findings.jsonl") == []


@pytest.mark.parametrize("status", ["completed", "crashed"])
def test_a_rank_that_never_ends_holds_rank_0_only_the_bounded_wait(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, status: str) -> None:
    run_dir = tmp_path / "harness"
    ctx = _ctx(run_dir)
    _spill(run_dir, 1, _finding("BEFORE_THE_KILL"))
    (run_dir / "ranks" / "attempt.rank-1").write_text("running", encoding="utf-8")  # killed: it never writes "ended"
    monkeypatch.setattr(lifecycle, "RANK_END_WAIT_S", 0.5)
    began = time.monotonic()
    RunLifecycle(ctx, None, None, None)._collect_rank_ends(status)  # type: ignore[arg-type]
    waited = time.monotonic() - began
    assert waited < (0.3 if status == "crashed" else 3.0)  # after a crash rank 0 does not wait at all
    ctx.close()
    assert [f.code for f in read_findings(run_dir / "findings.jsonl")] == ["BEFORE_THE_KILL"]


def test_the_merge_waits_for_a_rank_that_ends_late(tmp_path: Path) -> None:
    """Rank 1's run-end finding is written while rank 0 waits for its end marker: it is merged, not missed."""
    import threading

    run_dir = tmp_path / "harness"
    ctx = _ctx(run_dir)
    marker = run_dir / "ranks" / "attempt.rank-1"
    marker.parent.mkdir(parents=True, exist_ok=True)
    marker.write_text("running", encoding="utf-8")

    def rank_1_ends() -> None:
        time.sleep(0.3)
        _spill(run_dir, 1, _finding("SKIPPED_STEPS"))
        marker.write_text("ended", encoding="utf-8")

    thread = threading.Thread(target=rank_1_ends)
    thread.start()
    RunLifecycle(ctx, None, None, None)._collect_rank_ends("completed")  # type: ignore[arg-type]
    thread.join()
    ctx.close()
    assert [f.code for f in read_findings(run_dir / "findings.jsonl")] == ["SKIPPED_STEPS"]
