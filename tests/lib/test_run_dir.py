"""The run directory before the first step: a folder the harness cannot write is a clear error (not a PermissionError
from inside ``Trainer.train``), and a second live run on the same output directory is refused. Also: ``harness
replay`` of a copied run directory uses the checkpoints beside the capture.
"""
from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from transformers import TrainerCallback

import harness
from cli_in_process import harness_in_process
from conftest import EXAMPLE, FAULTS, REPO, findings_of, harness_cli, write_yaml
from harness.core.errors import HarnessError, RunDirLockedError, RunDirNotWritableError

HOLD = """
import sys, time
from pathlib import Path
from harness.lib import rundir
rundir.acquire(Path(sys.argv[1]), 1)
print("held", flush=True)
time.sleep(300)
"""

TRY = """
import sys
from pathlib import Path
from harness.lib import rundir
from harness.core.errors import RunDirLockedError
try:
    rundir.acquire(Path(sys.argv[1]), 1)
except RunDirLockedError as exc:
    print(exc)
    sys.exit(3)
"""


def _holder(run_dir: Path) -> subprocess.Popen[str]:
    proc = subprocess.Popen([sys.executable, "-c", HOLD, str(run_dir)], stdout=subprocess.PIPE, text=True, cwd=REPO)
    assert proc.stdout is not None and proc.stdout.readline().strip() == "held"
    return proc


def _try_lock(run_dir: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-c", TRY, str(run_dir)], capture_output=True, text=True, cwd=REPO, timeout=120)


def test_unwritable_run_dir_is_a_clear_error(make_trainer: Any, tmp_path: Path) -> None:
    # as root os.access says yes to everything: a regular FILE in the path makes the folder impossible for anyone
    blocker = tmp_path / "afile"
    blocker.write_text("not a folder", encoding="utf-8")
    trainer = make_trainer(output_dir=tmp_path / "out")
    with pytest.raises(RunDirNotWritableError) as caught:
        harness.attach(trainer, config={"output_dir": str(blocker / "out")})
    message = str(caught.value)
    assert isinstance(caught.value, HarnessError) and "\n" not in message
    assert str(blocker / "out" / "harness") in message and f"{blocker} is a file, not a folder" in message
    assert "Fix:" in message and "writable output_dir" in message
    assert not hasattr(trainer, "_harness_bridge")

    # the Trainer's own output_dir holding a file named harness
    out = tmp_path / "out2"
    trainer = make_trainer(output_dir=out)
    (out / "harness").write_text("", encoding="utf-8")
    with pytest.raises(RunDirNotWritableError, match="is a file, not a folder"):
        harness.attach(trainer)


@pytest.mark.slow  # a subprocess run (`harness wrap` or the runner): CI runs it, the quick tier does not
def test_unwritable_run_dir_under_wrap_exits_2_without_a_traceback(tmp_path: Path) -> None:
    blocker = tmp_path / "afile"
    blocker.write_text("not a folder", encoding="utf-8")
    config = write_yaml(tmp_path / "h.yaml", {"output_dir": str(blocker / "out")})
    script = [str(EXAMPLE), "--output_dir", str(tmp_path / "out"), "--max_steps", "2"]
    result = harness_cli("wrap", "--config", str(config), "--", sys.executable, *script, env={"DS_ACCELERATOR": "cpu"})
    assert result.returncode == 2, result.stderr[-3000:]
    assert "Traceback" not in result.stderr and "PermissionError" not in result.stderr
    assert f"harness: the harness cannot write its run directory {blocker / 'out' / 'harness'}" in result.stderr
    assert not (tmp_path / "out" / "checkpoint-2").exists()


def test_an_existing_folder_without_write_permission(make_trainer: Any, tmp_path: Path) -> None:
    if os.geteuid() != 0:
        pytest.skip("needs root, to drop to another user in-process")
    out = tmp_path / "readonly"
    trainer = make_trainer(output_dir=out)
    harness.attach(make_trainer(output_dir=tmp_path / "warm"))  # imports done as root: the unprivileged user reads none
    out.chmod(0o555)
    try:
        os.seteuid(65534)
    except OSError as exc:
        pytest.skip(f"cannot drop privileges here: {exc}")
    try:
        with pytest.raises(RunDirNotWritableError) as caught:
            harness.attach(trainer)
    finally:
        os.seteuid(0)
        out.chmod(0o755)
    assert str(out / "harness") in str(caught.value) and "PermissionError" in str(caught.value)


@pytest.mark.slow  # a subprocess run (`harness wrap` or the runner): CI runs it, the quick tier does not
def test_second_run_on_same_output_dir_is_refused(make_trainer: Any, tmp_path: Path) -> None:
    out = tmp_path / "out"
    run_dir = out / "harness"
    run_dir.mkdir(parents=True)
    holder = _holder(run_dir)  # another live run holding this output directory
    try:
        trainer = make_trainer(output_dir=out, max_steps=2)
        with pytest.raises(RunDirLockedError) as caught:
            harness.attach(trainer)
        message = str(caught.value)
        assert str(run_dir) in message and f"pid {holder.pid}" in message and f"kill {holder.pid}" in message
        assert "another output_dir" in message
    finally:
        holder.send_signal(signal.SIGKILL)  # a killed run: the kernel drops its lock, nothing stale is left
        holder.wait()
    assert (run_dir / ".lock").exists()

    tries: list[subprocess.CompletedProcess[str]] = []

    class TryLockWhileTraining(TrainerCallback):
        def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
            if not tries:
                tries.append(_try_lock(run_dir))

    trainer = make_trainer(output_dir=out, max_steps=2, callbacks=[TryLockWhileTraining()])
    harness.attach(trainer)  # the stale lock file of the killed run does not block
    assert _try_lock(run_dir).returncode == 0  # attached, not training: attach only checks the lock
    again = make_trainer(output_dir=out, max_steps=4, save_strategy="steps", save_steps=2)
    harness.attach(again)  # a second trainer of the same process on the same directory: not locked out
    again.train()
    trainer.train()
    assert tries and tries[0].returncode == 3 and f"pid {os.getpid()}" in tries[0].stdout, tries  # refused while it trains
    trainer.train()  # repeated train() calls re-take the lock
    again.train(resume_from_checkpoint=True)
    assert again.state.global_step >= 4 and trainer.state.global_step == 2
    assert _try_lock(run_dir).returncode == 0  # every train() has ended: the directory is free for the next run
    assert findings_of(out, "INTERNAL_PLUGIN_ERROR") == []


def _captured_nan_run(make_trainer: Any, out: Path, save_steps: int) -> Path:
    """A run whose step 4 has a NaN loss (captured by nan_guard) and checkpoints every ``save_steps``; the capture folder."""
    trainer = make_trainer(output_dir=out, max_steps=4, save_strategy="steps", save_steps=save_steps)
    harness.attach(trainer, config={"plugins": ["nan_guard", FAULTS], "fault_injector": {"nonfinite_loss_at_steps": [4]}})
    trainer.train()
    return out / "harness" / "captures" / "step-4"


def test_replay_prefers_checkpoint_beside_capture(make_trainer: Any, tmp_path: Path, capsys: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    from harness.tools.replay import find_capture_file, replay

    original = tmp_path / "original"
    capture_dir = _captured_nan_run(make_trainer, original, save_steps=3)
    assert find_capture_file(capture_dir, None).exists() and (original / "checkpoint-3").is_dir()
    moved = tmp_path / "copied" / "run"
    shutil.copytree(original, moved)
    # the old place now holds another run, with its own checkpoint-3 (other weights)
    shutil.rmtree(original)
    other = make_trainer(output_dir=original, max_steps=3, save_strategy="steps", save_steps=3, seed=1, learning_rate=1e-2)
    other.train()
    assert (original / "checkpoint-3").is_dir()

    _, used, exact, _ = replay(moved / "harness" / "captures" / "step-4")
    assert used == moved / "checkpoint-3" and exact  # not the absolute path stored in capture.json
    result = harness_in_process(capsys, monkeypatch, "replay", str(moved / "harness" / "captures" / "step-4"))
    # on the other run's checkpoint-3 the numbers would differ: exit status 1, "not reproduced"
    assert result.returncode == 0 and "reproduced: every per-sample loss" in result.stdout, result.stdout[-3000:] + result.stderr[-3000:]


HOLD_AND_FORK = """
import os, sys, time
from pathlib import Path
from harness.lib import rundir
rundir.acquire(Path(sys.argv[1]), 1)
child = os.fork()  # a data-loader worker of the run: it outlives a SIGKILL of its parent
if child == 0:
    time.sleep(300)
    os._exit(0)
print(child, flush=True)
time.sleep(300)
"""


def test_a_killed_runs_forked_workers_do_not_keep_the_lock(tmp_path: Path) -> None:
    run_dir = tmp_path / "out" / "harness"
    run_dir.mkdir(parents=True)
    parent = subprocess.Popen([sys.executable, "-c", HOLD_AND_FORK, str(run_dir)], stdout=subprocess.PIPE, text=True, cwd=REPO)
    assert parent.stdout is not None
    child = int(parent.stdout.readline().strip())
    try:
        assert _try_lock(run_dir).returncode == 3  # held by the live run
        parent.send_signal(signal.SIGKILL)
        parent.wait()
        os.kill(child, 0)  # the orphaned worker is still alive...
        retry = _try_lock(run_dir)
        assert retry.returncode == 0, retry.stdout + retry.stderr  # ...and does not hold the killed run's lock
    finally:
        parent.kill()
        try:
            os.kill(child, signal.SIGKILL)
        except ProcessLookupError:
            pass


@pytest.mark.slow  # a run through `harness wrap` (a subprocess): CI runs it, the quick tier does not
def test_replay_skips_an_incomplete_checkpoint(make_trainer: Any, tmp_path: Path, capsys: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """A save killed half-way leaves checkpoint-<N> without trainer_state.json: replay passes it over, or says so."""
    from harness.tools.replay import replay

    out = tmp_path / "out"
    capture_dir = _captured_nan_run(make_trainer, out, save_steps=1)
    assert all((out / f"checkpoint-{n}" / "trainer_state.json").is_file() for n in (1, 2, 3))
    (out / "checkpoint-3" / "trainer_state.json").unlink()  # the capture's own checkpoint (step 3), left incomplete

    _, used, exact, _ = replay(capture_dir)
    assert used == out / "checkpoint-2" and not exact  # the newest complete one before it, never the broken one
    monkeypatch.setenv("COLUMNS", "1000")
    result = harness_in_process(capsys, monkeypatch, "replay", str(capture_dir))
    stdout = " ".join(result.stdout.split())
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert f"skipped {out / 'checkpoint-3'}: it lacks trainer_state.json" in stdout, stdout[-3000:]
    assert "is not the checkpoint of step 3" in stdout

    shutil.rmtree(out / "checkpoint-1")
    shutil.rmtree(out / "checkpoint-2")  # now the only candidate (checkpoint-4 is after the capture) is the broken one
    monkeypatch.delenv("COLUMNS")
    result = harness_in_process(capsys, monkeypatch, "replay", str(capture_dir))
    assert result.returncode == 2 and "Traceback" not in result.stderr, result.stdout[-3000:] + result.stderr[-3000:]
    message = " ".join(result.stderr.split())
    assert f"no complete checkpoint at or before step 3 in {out}: {out / 'checkpoint-3'} lacks trainer_state.json" in message, message
    assert "--checkpoint DIR" in message


def test_replay_never_takes_a_relative_output_dir_from_the_working_directory(
    make_trainer: Any, tmp_path: Path, capsys: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A capture folder copied out of its run: an old capture stored output_dir as the script was given it (``runs/x``);
    replay run from a folder that holds another ``runs/x`` must not use that run's checkpoint. New captures store it
    absolute. Damaged capture files are clear errors (exit 2), never tracebacks."""
    original = tmp_path / "original"
    capture_dir = _captured_nan_run(make_trainer, original, save_steps=3)
    meta = json.loads((capture_dir / "capture.rank-0.json").read_text(encoding="utf-8"))
    assert meta["output_dir"] == str(original) and Path(meta["directory"]).is_absolute()
    loose = tmp_path / "copies" / "step-4"
    shutil.copytree(capture_dir, loose)
    meta["output_dir"] = "runs/x"  # as an older capture stored it
    (loose / "capture.rank-0.json").write_text(json.dumps(meta), encoding="utf-8")
    elsewhere = tmp_path / "elsewhere"
    shutil.copytree(original / "checkpoint-3", elsewhere / "runs" / "x" / "checkpoint-3")  # another run's, by name
    monkeypatch.chdir(elsewhere)
    result = harness_in_process(capsys, monkeypatch, "replay", str(loose))
    message = " ".join(result.stderr.split())
    assert result.returncode == 2 and "lies outside its run directory" in message and "--checkpoint DIR" in message, message
    result = harness_in_process(capsys, monkeypatch, "replay", str(loose), "--tolerance", "-1")
    assert result.returncode == 2 and "--tolerance -1 is not a tolerance" in result.stderr, result.stderr[-2000:]
    result = harness_in_process(capsys, monkeypatch, "replay", str(loose / "capture.rank-0.json"))
    assert result.returncode == 2 and f"Fix: harness replay {loose}" in " ".join(result.stderr.split())
    for damage, said in (("{\"code\": \"LOSS", "cannot be read as JSON"), ("[1, 2]", "holds a JSON list"),
                         (json.dumps({k: v for k, v in meta.items() if k != "weights_from_step"}), "key 'weights_from_step' is missing"),
                         (json.dumps({**meta, "weights_from_step": "twenty"}), "key 'weights_from_step' is a str")):
        (loose / "capture.rank-0.json").write_text(damage, encoding="utf-8")
        result = harness_in_process(capsys, monkeypatch, "replay", str(loose), "--checkpoint", str(original / "checkpoint-3"))
        assert result.returncode == 2 and said in result.stderr and "Traceback" not in result.stderr, result.stderr[-2000:]
    (loose / "capture.rank-0.json").write_text(json.dumps(meta), encoding="utf-8")
    (loose / "batch.rank-0.pt").write_text("not tensors", encoding="utf-8")
    result = harness_in_process(capsys, monkeypatch, "replay", str(loose), "--checkpoint", str(original / "checkpoint-3"))
    assert result.returncode == 2 and "cannot be read as the capture's tensors" in result.stderr, result.stderr[-2000:]
