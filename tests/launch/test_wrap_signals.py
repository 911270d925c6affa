"""`harness wrap` passes a scheduler's SIGTERM on to the command's process group and waits: the run ends with a checkpoint."""
from __future__ import annotations

import json
import os
import shlex
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from conftest import EXAMPLE, REPO, findings_of, write_yaml
from harness.lib.stops import EXIT_STOPPED

pytestmark = pytest.mark.slow  # a subprocess run


def _steps_done(out: Path) -> int:
    path = out / "harness" / "steps.jsonl"
    return len([line for line in path.read_text().splitlines() if line.strip()]) if path.exists() else 0


@pytest.mark.parametrize("through_shell", [False, True], ids=["python", "shell-script"])
def test_sigterm_to_wrap_ends_the_run_with_a_checkpoint_and_preempted(tmp_path: Path, through_shell: bool) -> None:
    """`wrap -- python train.py`, and `wrap -- sh -c "python train.py; ..."` (a job script that does not exec): the signal
    reaches the training process through the process group (sending it to the shell alone would orphan training), and
    wrap returns only when that process has saved and ended, with the shell's status (143: the SIGTERM ended it)."""
    out = tmp_path / "run"
    config = write_yaml(tmp_path / "h.yaml", {"metrics_log": {"flush_every": 1}})
    train = [sys.executable, str(EXAMPLE), "--output_dir", str(out), "--max_steps", "60", "--save_steps", "0",
             "--slow_data_rank", "0", "--slow_data_seconds", "0.05"]
    if through_shell:
        train = ["sh", "-c", " ".join(shlex.quote(part) for part in train) + "; echo 'training ended' >&2"]
    command = [sys.executable, "-m", "harness.cli", "wrap", "--config", str(config), "--", *train]
    logs = tmp_path / "stderr.txt"
    with open(logs, "w") as stderr:
        wrap = subprocess.Popen(command, cwd=REPO, env=dict(os.environ, DS_ACCELERATOR="cpu"), stdout=subprocess.DEVNULL, stderr=stderr,
                                start_new_session=True)
        try:
            deadline = time.monotonic() + 240
            while _steps_done(out) < 2:  # training is under way (0.2 s per step: the data loader sleeps)
                assert wrap.poll() is None and time.monotonic() < deadline, logs.read_text()[-3000:]
                time.sleep(0.1)
            wrap.send_signal(signal.SIGTERM)  # to wrap alone, as a scheduler's notice to the job's main process
            code = wrap.wait(timeout=180)
        finally:
            if wrap.poll() is None:
                os.killpg(wrap.pid, signal.SIGKILL)
    text = logs.read_text()
    # python: it exited 0 after the harness stop, which wrap makes 75 ("not finished"); the shell died of the SIGTERM
    assert code == (128 + signal.SIGTERM if through_shell else EXIT_STOPPED), text[-3000:]
    (preempted,) = findings_of(out, "PREEMPTED")
    step = preempted["step"]
    assert 2 <= step < 60 and preempted["evidence"]["signal"] == "SIGTERM" and preempted["rank"] == 0
    checkpoint = out / f"checkpoint-{step}"
    assert preempted["evidence"]["checkpoint"] == str(checkpoint)
    assert sorted(p.name for p in out.glob("checkpoint-*")) == [checkpoint.name]
    for name in ("model.safetensors", "optimizer.pt", "scheduler.pt", "rng_state.pth", "trainer_state.json", "harness_state/rank-0.json"):
        assert (checkpoint / name).stat().st_size > 0, name
    assert json.loads((checkpoint / "trainer_state.json").read_text())["global_step"] == step
    assert f"stopped training at step {step}" in text and "after PREEMPTED" in text
    assert "training ended" not in text  # the shell itself ended at the signal, before its next command
