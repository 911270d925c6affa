"""Issue 18 item 2: a harness stop is loud, through `harness wrap` of an unmodified run_clm-style script.

The client's story: resuming with ``--ignore_data_skip`` makes resume_check
stop training at step 11; run_clm.py goes on, saves, evaluates and exits 0.
Now the banner is on stderr, `harness wrap` exits 75, the report names
attempt 2 and step 11 (it used to name the highest step of any attempt),
and with ``on_stop: raise`` ``harness.HarnessStopped`` leaves ``train()``.
"""
from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import EXAMPLES, findings_of, harness_cli, write_yaml

pytestmark = pytest.mark.slow
PY = sys.executable
STOPPED = "the harness stopped training at step 11 after RESUME_DATA_POSITION (attempt 2, resumed from checkpoint-10)"


def run_clm(data: Path, out: Path, *extra: str, config: Path | None = None) -> subprocess.CompletedProcess[str]:
    """examples/run_clm.py under `harness wrap`: a tiny Llama, 20 steps, a checkpoint every 10."""
    script = [
        str(EXAMPLES / "run_clm.py"), "--train_file", str(data / "train.txt"), "--validation_file", str(data / "validation.txt"),
        "--output_dir", str(out), "--do_train", "--max_steps", "20", "--save_steps", "10", "--logging_steps", "1",
        "--per_device_train_batch_size", "4", "--use_cpu", "--report_to", "none", "--disable_tqdm", "true",
        "--config_overrides", "hidden_size=64,num_layers=2", *extra,
    ]
    return harness_cli("wrap", *(["--config", str(config)] if config else []), "--", PY, *script, timeout=900)


@pytest.fixture(scope="module")
def trained(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """(data, output_dir) of a clean 20-step run with checkpoint-10: wrap returns the script's 0 and says nothing of a stop."""
    root = tmp_path_factory.mktemp("clm")
    data = root / "data"
    subprocess.run([PY, str(EXAMPLES / "clm_data.py"), "--out", str(data)], check=True, capture_output=True, timeout=120)
    out = root / "first"
    result = run_clm(data, out)
    assert result.returncode == 0, result.stderr[-4000:]
    assert "HARNESS STOPPED" not in result.stderr and "harness wrap: the harness stopped" not in result.stderr
    assert (out / "checkpoint-10").is_dir()
    return data, out


def resumed_badly(trained: tuple[Path, Path], tmp_path: Path, config: Path | None = None) -> tuple[Path, subprocess.CompletedProcess[str]]:
    """A copy of the trained run resumed from checkpoint-10 with --ignore_data_skip, then evaluated."""
    data, first = trained
    out = tmp_path / "run"
    shutil.copytree(first, out)
    result = run_clm(data, out, "--do_eval", "--resume_from_checkpoint", str(out / "checkpoint-10"), "--ignore_data_skip", config=config)
    return out, result


def test_an_ignored_stop_exits_75_with_the_banner_and_an_honest_report(trained: tuple[Path, Path], tmp_path: Path) -> None:
    out, result = resumed_badly(trained, tmp_path)
    assert result.returncode == 75, result.stderr[-4000:]
    (cause,) = findings_of(out, "RESUME_DATA_POSITION")
    assert cause["step"] == 11 and cause["action"] == "stop"
    assert (out / "eval_results.json").exists()  # the script went on after the stop: saved, evaluated, exited 0
    err = result.stderr
    banner = err[err.index("HARNESS STOPPED TRAINING"):]
    assert "at step 11 (attempt 2) after RESUME_DATA_POSITION" in banner and "RESUME_DATA_POSITION: micro-batch 0 of step 11" in banner
    assert f"Next: harness explain {out}" in banner
    assert "harness wrap: the harness stopped training at step 11 (attempt 2) after RESUME_DATA_POSITION; exit status 75 " \
           "(the command itself exited 0)" in err
    report = (out / "harness" / "report.md").read_text(encoding="utf-8")
    assert STOPPED in report and "stopped by the harness at step 11 after RESUME_DATA_POSITION" in report
    assert "at step 20" not in report.split("## Findings")[0]  # the first attempt's last step is not this stop's
    explained = harness_cli("explain", str(out))
    assert explained.returncode == 0 and STOPPED in " ".join(explained.stdout.split())


def test_on_stop_raise_propagates_harness_stopped(trained: tuple[Path, Path], tmp_path: Path) -> None:
    out, result = resumed_badly(trained, tmp_path, config=write_yaml(tmp_path / "h.yaml", {"on_stop": "raise"}))
    assert result.returncode == 75, result.stderr[-4000:]  # the script died of HarnessStopped (status 1): wrap says 75
    err = result.stderr
    assert "Traceback" in err and "HarnessStopped: the harness stopped training at step 11 (attempt 2) after RESUME_DATA_POSITION" in err
    assert "raising harness.HarnessStopped (on_stop: raise)" in err
    assert "exit status 75 (the command itself exited 1)" in err
    assert not (out / "eval_results.json").exists()  # the script could not go on as if training had completed
    assert STOPPED in (out / "harness" / "report.md").read_text(encoding="utf-8")  # written before the raise
