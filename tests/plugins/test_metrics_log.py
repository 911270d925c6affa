"""metrics_log keeps every logged metric in harness/metrics.jsonl, on rank 0 only."""
from __future__ import annotations

from pathlib import Path
from typing import Any

import harness
from conftest import read_jsonl


def test_every_logged_step_is_kept_with_loss_and_lr(make_trainer: Any) -> None:
    trainer = make_trainer(max_steps=4, logging_steps=2)
    harness.attach(trainer)
    trainer.train()
    rows = read_jsonl(Path(trainer.args.output_dir) / "harness" / "metrics.jsonl")
    logged = [r for r in rows if "loss" in r]
    assert [r["step"] for r in logged] == [2, 4]
    assert all(r["loss"] > 0 and "learning_rate" in r and "grad_norm" in r for r in logged)
    assert any("train_runtime" in r for r in rows)


def test_disabled_writes_nothing(make_trainer: Any) -> None:
    trainer = make_trainer(max_steps=2)
    harness.attach(trainer, config={"disable": ["metrics_log"]})
    trainer.train()
    assert not (Path(trainer.args.output_dir) / "harness" / "metrics.jsonl").exists()


def test_step_values_become_json_ready_without_a_read_for_plain_numbers() -> None:
    """steps.jsonl holds numbers as they are, non-finite floats as strings, 0-d numpy/torch scalars as numbers, and
    leaves out what JSON cannot hold."""
    import json
    import math

    import numpy as np
    import torch

    from harness.plugins.metrics_log import _host

    cases = [(1.5, 1.5), (math.nan, "nan"), (-math.inf, "-inf"), (3, 3), (True, True), (None, None), ("x", "x"),
             (np.float32(2.5), 2.5), (np.float64(math.inf), "inf"), (torch.tensor(4), 4), (torch.tensor([1, 2]), None), (object(), None)]
    got = [_host(value) for value, _ in cases]
    assert got == [want for _, want in cases]
    assert [type(v) for v in got[:7]] == [float, str, str, int, bool, type(None), str]
    json.dumps(got)  # all of it JSON-ready
