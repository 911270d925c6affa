"""Each rank's attempt marker says how its train() call ended; rank 0 gives a rank that failed first a moment to say why."""
from __future__ import annotations

import time
from pathlib import Path

import pytest

from harness.core.codes import CORE_CODES
from harness.core.config import Catalog, resolve_config
from harness.core.context import RunContext
from harness.core.distributed import DistInfo
from harness.core.manager import HarnessPluginManager
from harness.hf import lifecycle
from harness.hf.lifecycle import RunLifecycle
from harness.lib.rank_markers import read_marker


def _ctx(run_dir: Path, rank: int) -> RunContext:
    catalog = Catalog.build(autoload=False)
    return RunContext(resolve_config({"plugins": []}, catalog), {c.code: c for c in CORE_CODES}, HarnessPluginManager(), run_dir,
                      DistInfo(rank=rank, world_size=2, local_rank=rank))


def test_a_crashed_rank_writes_its_status_error_and_failure_time(tmp_path: Path) -> None:
    run_dir = tmp_path / "harness"
    ctx = _ctx(run_dir, 1)
    life = RunLifecycle(ctx, None, None, None)  # type: ignore[arg-type]
    life._failed_at = 123.0
    life._finish_run("crashed", ValueError("injected crash on rank 1 at step 10"))
    ctx.close()
    end = read_marker(run_dir / "ranks" / "attempt.rank-1")
    assert end is not None and (end.state, end.status, end.error, end.ended) == ("ended", "crashed", "ValueError: injected crash on rank 1 at step 10", 123.0)


def test_after_a_failed_collective_rank_0_waits_briefly_for_the_other_ranks(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    run_dir = tmp_path / "harness"
    ctx = _ctx(run_dir, 0)
    (run_dir / "ranks").mkdir(parents=True, exist_ok=True)
    (run_dir / "ranks" / "attempt.rank-1").write_text("running", encoding="utf-8")
    monkeypatch.setattr(lifecycle, "RANK_CRASH_WAIT_S", 0.5)
    began = time.monotonic()
    RunLifecycle(ctx, None, None, None)._collect_rank_ends("crashed", ValueError("own bug"))  # type: ignore[arg-type]
    assert time.monotonic() - began < 0.3  # its own error: no wait
    began = time.monotonic()
    RunLifecycle(ctx, None, None, None)._collect_rank_ends("crashed", RuntimeError("Connection closed by peer [127.0.0.1]:1"))  # type: ignore[arg-type]
    assert 0.4 < time.monotonic() - began < 3.0  # bounded
    ctx.close()
