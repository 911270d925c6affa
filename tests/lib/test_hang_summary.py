"""hang_summary: stack files shown relative to the run directory being read; the other ranks' RANK_HANG read from their
spill files (bounded wait, torn lines, older hangs left out); which rank stalled first."""
from __future__ import annotations

import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any

from harness.core.findings import Finding, FindingsFile, Severity
from harness.lib.hang_summary import brief_where, hang_summary, stack_display, stalled_first, wait_for_peer_hangs


def _hang(rank: int, where: str, kind: str, progress: list[int], stack: str, at: float | None = None) -> Finding:
    evidence = {"where": where, "where_kind": kind, "progress": progress, "stack_file": stack, "last_progress": "step 4 ended",
                "stalled_since_unix": (at or time.time()) - 3}
    finding = Finding(code="RANK_HANG", severity=Severity.CRITICAL, plugin="watchdog", message=f"rank {rank} hung", step=5,
                      rank=rank, evidence=evidence, playbook="hangs#rank_hang")
    if at is not None:
        finding.time = at
    return finding


def _spill(run_dir: Path, finding: Finding) -> Path:
    path = run_dir / "ranks" / f"findings.rank-{finding.rank}.jsonl"
    sink = FindingsFile(path)
    sink.append(finding)
    sink.close()
    return path


def test_a_stack_file_is_shown_relative_to_the_run_directory_not_by_its_original_path(tmp_path: Path) -> None:
    original = "runs/hang_abort/harness/hangs/rank-1-step-10.txt"
    assert stack_display(original) == "hangs/rank-1-step-10.txt"
    assert stack_display("/old/place/out/harness/hangs/rank-0-step-5-2.txt") == "hangs/rank-0-step-5-2.txt"
    assert stack_display(None) is None and stack_display("") is None
    copy = tmp_path / "copy" / "harness"
    (copy / "hangs").mkdir(parents=True)
    (copy / "hangs" / "rank-1-step-10.txt").write_text("stacks", encoding="utf-8")
    run = SimpleNamespace(run_dir=copy, evidence_path=lambda value: copy / "hangs" / Path(value).name)  # as RunRecord resolves it
    assert stack_display("/gone/out/harness/hangs/rank-1-step-10.txt", run) == "hangs/rank-1-step-10.txt"
    text = hang_summary([_hang(1, "in pre_hook (.../train2.py:73)", "other", [9, 1], "/gone/out/harness/hangs/rank-1-step-10.txt"),
                         _hang(0, "in all_reduce", "collective", [9, 1], "/gone/out/harness/hangs/rank-0-step-10.txt")], run)
    assert text is not None and "stacks in hangs/rank-1-step-10.txt" in text and "/gone/" not in text, text
    plain = hang_summary([_hang(1, "in pre_hook", "other", [9, 1], original)])
    assert plain is not None and f"stacks in {original}" not in plain and "stacks in hangs/rank-1-step-10.txt" in plain


def test_the_rank_that_stalled_first_is_read_from_the_other_ranks_spill_files(tmp_path: Path) -> None:
    run_dir = tmp_path / "harness"
    since = time.time() - 10
    _spill(run_dir, _hang(2, "in an old place", "other", [1, 0], "hangs/rank-2-step-2.txt", at=since - 100))  # recovered long ago
    path = _spill(run_dir, _hang(1, "in pre_hook (.../train2.py:73)", "other", [9, 1], "/x/harness/hangs/rank-1-step-10.txt"))
    with open(path, "a", encoding="utf-8") as handle:
        handle.write('{"code": "RANK_HANG", "torn')  # a line still being written
    started = time.monotonic()
    peers = wait_for_peer_hangs(run_dir, 0, since, world_size=3, wait_s=5.0)
    assert time.monotonic() - started < 2.0  # a rank not waiting in a collective is there: no need to wait for more
    assert [p.rank for p in peers] == [1]
    own = {"where": "in all_reduce", "where_kind": "collective", "progress": [9, 1], "stalled_since_unix": since + 5}
    first = stalled_first(0, 10, own, peers)
    assert first is not None and first.rank == 1
    assert stalled_first(1, 10, {"where_kind": "other", "progress": [9, 0], "stalled_since_unix": since}, peers) is None


def test_the_wait_for_the_other_ranks_is_bounded(tmp_path: Path) -> None:
    started = time.monotonic()
    slept: list[float] = []

    def sleep(seconds: float) -> bool:
        slept.append(seconds)
        time.sleep(seconds)
        return False

    assert wait_for_peer_hangs(tmp_path, 0, time.time(), world_size=2, wait_s=0.5, sleep=sleep, poll_s=0.05) == []
    assert 0.5 <= time.monotonic() - started < 2.0 and slept
    assert wait_for_peer_hangs(tmp_path, 0, time.time(), world_size=2, wait_s=5.0, sleep=lambda s: True) == []  # stopped: at once


def test_brief_where_drops_the_details_in_parentheses() -> None:
    words = "in backward (the autograd engine, where DDP's gradient all-reduce waits for every rank) in the training step"
    assert brief_where(words) == "in backward in the training step"
    assert brief_where("in all_reduce at the step guard") == "in all_reduce at the step guard"
