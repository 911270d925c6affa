"""watchdog across two processes (torchrun, DDP over gloo): rank 1's dataset blocks forever at step 5, hang_action abort.

One launch: the job ends by itself with the watchdog's exit code, rank 1's RANK_HANG names rank 1 and the data loader,
and `harness report` / `harness explain` rebuilt from the run directory alone (the job was killed) say that rank 1 stalled first.
"""
from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import pytest

from cli_in_process import harness_in_process
from conftest import EXAMPLE, FAULTS, harness_cli, read_jsonl, torchrun, write_yaml
from harness.lib.hang_watch import HANG_EXIT_CODE

pytestmark = pytest.mark.slow


def test_a_rank_stuck_in_its_data_loader_is_named_and_the_job_exits_with_the_watchdog_code(
    tmp_path: Path, capsys: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    out = tmp_path / "run"
    config = write_yaml(tmp_path / "h.yaml", {
        "plugins": ["defaults", FAULTS], "watchdog": {"floor_s": 3.0, "factor": 3, "hang_action": "abort"},
        "fault_injector": {"hang_data_at_step": 5, "hang_on_rank": 1},  # forever: only the watchdog ends this job
    })
    script = [str(EXAMPLE), "--output_dir", str(out), "--max_steps", "10", "--save_steps", "0"]
    started = time.monotonic()
    result = harness_cli("wrap", "--config", str(config), "--", *torchrun(2), *script, env={"DS_ACCELERATOR": "cpu"}, timeout=300)
    elapsed = time.monotonic() - started
    text = result.stdout + result.stderr
    assert result.returncode != 0 and f"exitcode  : {HANG_EXIT_CODE}" in text, text[-4000:]  # torchrun names the child's code
    run_dir = out / "harness"
    assert (run_dir / "hanging-data.rank-1").exists() and not (run_dir / "hanging-data.rank-0").exists()

    spilled = [f for f in read_jsonl(run_dir / "ranks" / "findings.rank-1.jsonl") if f["code"] == "RANK_HANG"]
    (hang,) = spilled  # written by rank 1's watchdog thread while its training thread was stuck
    evidence = hang["evidence"]
    assert hang["rank"] == 1 and hang["step"] == 5 and hang["severity"] == "critical" and hang["action"] == "stop"
    assert evidence["where_kind"] == "data" and evidence["where"].startswith("in the data loader's __next__")
    assert evidence["exit_code"] == HANG_EXIT_CODE and evidence["last_progress"] == "step 4 ended"
    assert evidence["threshold_s"] >= 3.0 and "exits with code 76" in hang["message"]
    stacks = run_dir / "hangs" / "rank-1-step-5.txt"
    assert stacks.exists() and "__getitem" in stacks.read_text(encoding="utf-8")
    assert elapsed < 240, elapsed
    in_main = [f for f in read_jsonl(run_dir / "findings.jsonl") if f["code"] == "RANK_HANG"]
    # rank 0 copies rank 1's spilled finding into findings.jsonl at its run end, once (when it gets there before torchrun ends it)
    assert [f["id"] for f in in_main if f["rank"] == 1] in ([], [hang["id"]])
    for rank_0 in [f for f in in_main if f["rank"] != 1]:  # rank 0 may have fired too
        assert rank_0["rank"] == 0 and rank_0["evidence"]["where_kind"] in ("collective", "wait"), rank_0["evidence"]["where"]

    (run_dir / "report.md").unlink(missing_ok=True)  # the job was killed: no report of its own; rebuilt from the files alone
    rebuilt = harness_in_process(capsys, monkeypatch, "report", str(out))  # the CLI's entry point, in this process
    assert rebuilt.returncode == 0, rebuilt.stderr[-3000:]
    report = (run_dir / "report.md").read_text(encoding="utf-8")
    hangs = report[report.index("## Hangs"):]
    assert "RANK_HANG" in report and "rank 1 stalled first, at step 5: in the data loader's __next__" in hangs, hangs[:2000]
    explained = harness_in_process(capsys, monkeypatch, "explain", str(out))
    assert explained.returncode == 0 and "stalled first: rank 1 stalled first, at step 5" in " ".join(explained.stdout.split())
