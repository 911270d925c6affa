"""Issue 18 item 5: examples/run_clm.py with a compute_loss that averages per micro-batch under GA 4, through `harness wrap`.

From scratch and from a pretrained directory (a first run_clm run's
``trainer.save_model()``), the trap is GA_LOSS_SCALING and not an
INITIAL_LOSS_ANOMALY blaming init; the normal loss with GA 4 is silent, and
a pretrained fine-tune with the normal loss gets no INITIAL_LOSS_ANOMALY
for starting low.
"""
from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import EXAMPLES, findings_of, harness_cli, read_jsonl

PY = sys.executable
LOUD = ("warning", "error", "critical")


@pytest.fixture(scope="module")
def data(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("ga_data")
    subprocess.run([PY, str(EXAMPLES / "clm_data.py"), "--out", str(out)], check=True, capture_output=True)
    return out


@pytest.fixture(scope="module")
def pretrained(data: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny Llama trained 40 steps by run_clm itself (no harness), saved with trainer.save_model()."""
    out = tmp_path_factory.mktemp("pretrained") / "model"
    result = subprocess.run(
        [PY, str(EXAMPLES / "run_clm.py"), "--train_file", str(data / "train.txt"), "--output_dir", str(out), "--do_train",
         "--max_steps", "40", "--learning_rate", "3e-3", "--per_device_train_batch_size", "8", "--save_strategy", "no",
         "--use_cpu", "--report_to", "none", "--disable_tqdm", "true", "--config_overrides", "hidden_size=64,num_layers=2"],
        capture_output=True, text=True, timeout=600,
    )
    assert result.returncode == 0 and (out / "model.safetensors").is_file(), result.stderr[-3000:]
    return out


def fine_tune(data: Path, out: Path, *extra: str) -> list[dict]:
    result = harness_cli(
        "wrap", "--", PY, str(EXAMPLES / "run_clm.py"), "--train_file", str(data / "train.txt"), "--output_dir", str(out),
        "--do_train", "--max_steps", "3", "--save_strategy", "no", "--logging_steps", "1", "--per_device_train_batch_size", "4",
        "--use_cpu", "--report_to", "none", "--disable_tqdm", "true", *extra,
    )
    assert result.returncode == 0, result.stderr[-4000:]
    return findings_of(out)


def _ga_trap(findings: list[dict]) -> dict:
    (finding,) = [f for f in findings if f["code"] == "GA_LOSS_SCALING"]
    assert finding["step"] == 1 and finding["severity"] == "warning"
    assert finding["evidence"]["gradient_accumulation_steps"] == 4 and 3.0 < finding["evidence"]["factor"] < 5.3
    assert finding["evidence"]["micro_batch_loss"] == pytest.approx(finding["evidence"]["recomputed_micro_batch_mean"], rel=1e-3)
    assert "num_items_in_batch" in finding["message"]
    assert [f["code"] for f in findings if f["severity"] in LOUD] == ["GA_LOSS_SCALING"]  # no INITIAL_LOSS_ANOMALY blaming init
    return finding


@pytest.mark.slow
def test_the_ga_trap_from_scratch_is_named_and_init_is_not_blamed(data: Path, tmp_path: Path) -> None:
    findings = fine_tune(data, tmp_path / "run", "--config_overrides", "hidden_size=64,num_layers=2",
                         "--loss_per_micro_batch", "true", "--gradient_accumulation_steps", "4")
    _ga_trap(findings)
    assert not [f for f in findings if f["code"] == "INITIAL_LOSS_ANOMALY"]


@pytest.mark.slow
def test_the_normal_loss_with_ga_4_is_silent(data: Path, tmp_path: Path) -> None:
    findings = fine_tune(data, tmp_path / "run", "--config_overrides", "hidden_size=64,num_layers=2", "--gradient_accumulation_steps", "4")
    assert [f for f in findings if f["severity"] in LOUD] == []


@pytest.mark.slow
def test_the_ga_trap_from_a_pretrained_model(data: Path, pretrained: Path, tmp_path: Path) -> None:
    findings = fine_tune(data, tmp_path / "run", "--model_name_or_path", str(pretrained),
                         "--loss_per_micro_batch", "true", "--gradient_accumulation_steps", "4")
    _ga_trap(findings)


@pytest.mark.slow
def test_a_pretrained_fine_tune_may_start_low(data: Path, pretrained: Path, tmp_path: Path) -> None:
    findings = fine_tune(data, tmp_path / "run", "--model_name_or_path", str(pretrained))
    first = next(r["loss"] for r in read_jsonl(tmp_path / "run" / "harness" / "metrics.jsonl") if r.get("step") == 1)
    vocab = json.loads((pretrained / "config.json").read_text())["vocab_size"]
    assert first < 0.5 * math.log(vocab)  # the case of the issue: far below ln(V), as a trained model should be
    assert [f for f in findings if f["code"] == "INITIAL_LOSS_ANOMALY"] == []  # not even at info
    assert [f for f in findings if f["severity"] in LOUD] == []
