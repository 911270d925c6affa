"""watchdog across two processes (torchrun, DDP over gloo), default `hang_action: report`: rank 1's dataset blocks forever
at step 5 while rank 0 waits for it in the step's collective.

Only rank 0 prints console lines, and rank 0 is the rank that waits. Its live RANK_HANG line must name the rank that
stalled first (rank 1, in its data loader) and where, read from rank 1's spill file by rank 0's watchdog thread. The job
never ends by itself (report only): the test ends it once the line is out. Then, from a copy of the run directory, the
report's Hangs section and `harness explain` show the stack files relative to the copy, and explain's next step points
at the stack file, not at `harness explain` again.
"""
from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import pytest

from cli_in_process import harness_in_process
from conftest import EXAMPLE, FAULTS, REPO, read_jsonl, torchrun, write_yaml

pytestmark = pytest.mark.slow

LINE_TIMEOUT_S = 150  # the job's start on a loaded 2-core machine, then 5 steps and the 3 s floor


def _end(proc: subprocess.Popen[str], run_dir: Path) -> None:
    """End the job: SIGTERM to harness wrap's process group (torchrun stops its workers), then SIGKILL to what is left,
    the ranks by the pids their RANK_HANG findings recorded (torchrun starts each in its own session)."""
    try:
        os.killpg(proc.pid, signal.SIGTERM)
    except ProcessLookupError:
        pass
    try:
        proc.wait(20)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(10)
    files = [run_dir / "findings.jsonl", *sorted((run_dir / "ranks").glob("findings.rank-*.jsonl"))]
    for path in files:
        for finding in read_jsonl(path) if path.exists() else []:
            pid = finding.get("evidence", {}).get("pid") if finding.get("code") == "RANK_HANG" else None
            if isinstance(pid, int) and pid != os.getpid():
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass


def test_rank_0_waiting_in_a_collective_names_the_rank_that_stalled_first_on_the_console(
    tmp_path: Path, capsys: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    out = tmp_path / "run"
    config = write_yaml(tmp_path / "h.yaml", {
        "plugins": ["defaults", FAULTS], "watchdog": {"floor_s": 3.0, "factor": 3},  # hang_action: report (the default)
        "fault_injector": {"hang_data_at_step": 5, "hang_on_rank": 1},  # forever
    })
    script = [str(EXAMPLE), "--output_dir", str(out), "--max_steps", "10", "--save_steps", "0"]
    env = {**os.environ, "DS_ACCELERATOR": "cpu"}
    proc = subprocess.Popen([sys.executable, "-m", "harness.cli", "wrap", "--config", str(config), "--", *torchrun(2), *script],
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, env=env, cwd=REPO,
                            start_new_session=True)
    lines: list[str] = []
    seen = threading.Event()

    def read() -> None:
        assert proc.stderr is not None
        for line in proc.stderr:
            lines.append(line)
            if "RANK_HANG" in line and line.startswith("[harness]"):
                seen.set()

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    run_dir = out / "harness"
    try:
        assert seen.wait(LINE_TIMEOUT_S), "".join(lines)[-4000:]
        time.sleep(0.5)  # rank 1's own finding is in its spill file already (rank 0 read it); let the stderr lines settle
    finally:
        _end(proc, run_dir)
    reader.join(10)
    console = [line.strip() for line in lines if line.startswith("[harness]") and "RANK_HANG" in line]
    assert len(console) == 1, console  # rank 0's line only: rank 1 prints none
    (line,) = console
    assert line.startswith("[harness] step 5 RANK_HANG critical: rank 0 made no progress for"), line
    assert "rank 0 is waiting in" in line and "rank 1 stalled first, at step 5 in the data loader's __next__" in line, line

    (hang_1,) = [f for f in read_jsonl(run_dir / "ranks" / "findings.rank-1.jsonl") if f["code"] == "RANK_HANG"]
    (hang_0,) = [f for f in read_jsonl(run_dir / "findings.jsonl") if f["code"] == "RANK_HANG" and f["rank"] == 0]
    assert hang_1["evidence"]["where_kind"] == "data" and hang_0["evidence"]["where_kind"] == "collective"
    first = hang_0["evidence"]["stalled_first"]
    assert first["rank"] == 1 and first["step"] == 5 and first["stack_file"] == "hangs/rank-1-step-5.txt" and first["finding"] == hang_1["id"]
    assert "rank 1 stalled first" not in hang_1["message"]  # rank 1 is the one that stalled: its message is its own

    # a copy of the run, read from elsewhere: the stack files are shown relative to the copy's run directory
    copy = tmp_path / "elsewhere" / "copied"
    shutil.copytree(out, copy)
    shutil.rmtree(out)  # the original paths in the evidence resolve nowhere now
    (copy / "harness" / "report.md").unlink(missing_ok=True)
    rebuilt = harness_in_process(capsys, monkeypatch, "report", str(copy))
    assert rebuilt.returncode == 0, rebuilt.stderr[-3000:]
    report = (copy / "harness" / "report.md").read_text(encoding="utf-8")
    hangs = report[report.index("## Hangs"):]
    hangs = hangs[:hangs.find("\n## ", 4) if "\n## " in hangs[4:] else None]
    assert "rank 1 stalled first, at step 5" in hangs and "stacks in hangs/rank-1-step-5.txt" in hangs, hangs[:2000]
    assert str(out) not in hangs, hangs[:2000]
    explained = harness_in_process(capsys, monkeypatch, "explain", str(copy))
    text = " ".join(explained.stdout.split())
    assert explained.returncode == 0 and "stacks in hangs/rank-1-step-5.txt" in text and str(out) not in text, text[-3000:]
    rank_hang = text[text.index("RANK_HANG"):]
    next_line = rank_hang[rank_hang.index("next: "):rank_hang.index("more: ")]
    assert "harness explain" not in next_line and "hangs/rank-" in next_line, next_line
    assert "stack file of the rank that stalled first" in next_line, next_line
    assert f"{copy}/harness/hangs/rank-1-step-5.txt" in next_line, next_line  # the placeholders filled with rank 1's
