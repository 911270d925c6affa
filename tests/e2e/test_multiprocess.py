"""The stage runner under torchrun with 2 processes on CPU: DeepSpeed ZeRO-2 pretraining and DDP SFT."""
from __future__ import annotations

from pathlib import Path

import pytest

from conftest import REPO, example_config, findings_of, read_jsonl, torchrun

pytestmark = pytest.mark.slow


def _run(config: Path, stage: str) -> None:
    import os
    import subprocess

    env = dict(os.environ, DS_ACCELERATOR="cpu")
    result = subprocess.run([*torchrun(), "-m", "harness.cli", "run", stage, "--config", str(config)], capture_output=True, text=True, env=env, cwd=REPO, timeout=600)
    assert result.returncode == 0, result.stderr[-4000:]


def test_pretrain_deepspeed_zero2_two_processes(tmp_path: Path) -> None:
    config = example_config("pretrain", tmp_path, training={"max_steps": 10, "save_steps": 5}, deepspeed=str(REPO / "examples" / "ds_zero2.json"))
    _run(config, "pretrain")
    out = tmp_path / "pretrain"
    losses = [r["loss"] for r in read_jsonl(out / "harness" / "metrics.jsonl") if "loss" in r]
    assert len(losses) == 10 and losses[-1] < losses[0]
    assert findings_of(out) == []
    assert (out / "checkpoint-10").exists()


def test_sft_ddp_two_processes(tmp_path: Path) -> None:
    config = example_config("sft", tmp_path, training={"max_steps": 8})
    _run(config, "sft")
    out = tmp_path / "sft"
    losses = [r["loss"] for r in read_jsonl(out / "harness" / "metrics.jsonl") if "loss" in r]
    assert len(losses) == 8 and losses[-1] < losses[0]
    assert findings_of(out) == []
    assert (out / "harness" / "mlflow" / "run.json").exists()
