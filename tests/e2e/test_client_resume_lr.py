"""Issue 18 item 4: examples/run_clm.py resumed with another --learning_rate, through `harness wrap`.

HF restores the saved schedule from scheduler.pt (LambdaLR keeps its
base_lrs), so a new --learning_rate is ignored: the harness must say so with
the numbers (LR_CHANGE_IGNORED_ON_RESUME) and not claim that the new LR took
effect; a resume with the same LR stays silent.
"""
from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import EXAMPLES, FAULTS, findings_of, harness_cli, write_yaml

PY = sys.executable
MAX_STEPS = 30


def run_clm(data: Path, out: Path, lr: float, *extra: str, config: Path | None = None, plugins: str | None = None) -> None:
    wrap = ["wrap", *(["--config", str(config)] if config else []), *(["--plugins", plugins] if plugins else []), "--"]
    result = harness_cli(
        *wrap, PY, str(EXAMPLES / "run_clm.py"), "--train_file", str(data / "train.txt"), "--output_dir", str(out),
        "--do_train", "--max_steps", str(MAX_STEPS), "--save_steps", "10", "--learning_rate", str(lr), "--logging_steps", "1",
        "--per_device_train_batch_size", "4", "--use_cpu", "--report_to", "none", "--disable_tqdm", "true",
        "--config_overrides", "hidden_size=64,num_layers=2", *extra,
    )
    assert result.returncode in (0, -9, 137), result.stderr[-4000:]


@pytest.fixture(scope="module")
def killed_at_12(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A run_clm run with --learning_rate 5e-5 killed at step 12: checkpoint-10 is its last."""
    base = tmp_path_factory.mktemp("resume_lr")
    data = base / "data"
    subprocess.run([PY, str(EXAMPLES / "clm_data.py"), "--out", str(data)], check=True, capture_output=True)
    out = base / "run"
    config = write_yaml(base / "kill.yaml", {"fault_injector": {"kill_at_step": 12}})
    run_clm(data, out, 5e-5, config=config, plugins=FAULTS)
    assert (out / "checkpoint-10").is_dir() and not (out / "checkpoint-20").exists()
    return base


def resumed(killed: Path, name: str, lr: float) -> Path:
    out = killed / name
    shutil.copytree(killed / "run", out)
    run_clm(killed / "data", out, lr, "--resume_from_checkpoint", str(out / "checkpoint-10"))
    return out


@pytest.mark.slow
def test_a_new_learning_rate_ignored_on_resume_is_named_with_its_numbers(killed_at_12: Path) -> None:
    out = resumed(killed_at_12, "new_lr", 2e-4)
    (finding,) = findings_of(out, "LR_CHANGE_IGNORED_ON_RESUME")
    ev = finding["evidence"]
    assert finding["step"] == 11 and finding["severity"] == "warning"
    assert ev["configured_lr"] == pytest.approx(2e-4) and ev["restored_base_lr"] == pytest.approx(5e-5)
    assert ev["applied_lr"] == pytest.approx(5e-5 * (1 - 10 / MAX_STEPS), rel=1e-4)  # 3.33e-5: the saved schedule at step 11
    assert ev["configured_would_give"] == pytest.approx(2e-4 * (1 - 10 / MAX_STEPS), rel=1e-4)
    assert "3.33e-05" in finding["message"] and "no effect" in finding["message"]
    for other in findings_of(out, "RESUME_CONFIG_CHANGED"):  # never claims the new LR is in effect
        assert "learning_rate" not in other["message"] or "NOT in effect" in other["message"]
    logged = [r for r in findings_of(out) if r["severity"] in ("warning", "error", "critical")]
    assert [r["code"] for r in logged] == ["LR_CHANGE_IGNORED_ON_RESUME"], logged


@pytest.mark.slow
def test_a_resume_with_the_same_learning_rate_is_silent(killed_at_12: Path) -> None:
    out = resumed(killed_at_12, "same_lr", 5e-5)
    loud = [r for r in findings_of(out) if r["severity"] in ("warning", "error", "critical")]
    assert loud == []
