"""throughput: a data loader that sleeps is DATALOADER_BOUND at the right step; memory near the limit; tokens/s and MFU logged."""
from __future__ import annotations

import time
from typing import Any

import torch

import harness
from conftest import findings_of
from harness.core.hookspecs import hookimpl


class SlowRows(torch.utils.data.Dataset):
    """The tiny rows, each made slowly (tokenising on the fly, a network filesystem...)."""

    def __init__(self, rows: Any, seconds: float) -> None:
        self.rows, self.seconds = rows, seconds

    def __len__(self) -> int:
        return len(self.rows)

    def __getitem__(self, i: int) -> dict[str, Any]:
        time.sleep(self.seconds)
        return self.rows[i]


class MetricsRecorder:
    name = "metrics_recorder"

    def __init__(self) -> None:
        self.metrics: dict[int, dict[str, Any]] = {}

    @hookimpl
    def on_metrics(self, step: int, metrics: dict[str, Any]) -> None:
        self.metrics.setdefault(step, {}).update(metrics)


def _train(make_trainer: Any, options: dict[str, Any], **args: Any) -> tuple[Any, MetricsRecorder]:
    recorder = MetricsRecorder()
    trainer = make_trainer(**{"max_steps": 14, **args})
    harness.attach(trainer, config={"plugins": ["throughput"], "throughput": {"window": 5, "log_every": 5, **options}}, plugins=[recorder])
    trainer.train()
    return trainer, recorder


def test_a_sleeping_dataset_is_dataloader_bound_once_the_window_fills(make_trainer: Any, lm_rows: Any) -> None:
    # 150 ms per row, 4 rows a step: the wait dwarfs the tiny model's step even on a loaded two-core machine (at 60 ms a
    # CI run under full load once stalled a step of the window for seconds and the fraction dipped below 0.3 at step 8)
    trainer, _ = _train(make_trainer, {}, train_dataset=SlowRows(lm_rows, 0.15), max_steps=10)
    (bound,) = findings_of(trainer.args.output_dir, "DATALOADER_BOUND")
    assert bound["step"] == 3 + 5  # skip_first 3, then a window of 5 steps
    assert bound["evidence"]["wait_fraction"] > bound["evidence"]["threshold"] and bound["evidence"]["median_wait_s"] >= 4 * 0.15


def test_a_clean_run_logs_tokens_per_second_and_mfu_and_finds_nothing(make_trainer: Any) -> None:
    trainer, recorder = _train(make_trainer, {"peak_tflops": 1.0})
    assert findings_of(trainer.args.output_dir) == []
    logged = recorder.metrics[10]
    assert logged["throughput/tokens_per_s"] == logged["throughput/tokens_per_s_per_rank"] > 0  # one process
    params = sum(p.numel() for p in trainer.model.parameters())
    assert logged["throughput/mfu"] == 6 * params * logged["throughput/tokens_per_s_per_rank"] / 1e12
    assert 0 <= logged["throughput/data_wait_fraction"] < 0.3
    assert recorder.metrics[4]["throughput/peak_memory_gb"] > 0


def test_memory_past_the_threshold_is_reported_with_the_numbers(make_trainer: Any) -> None:
    trainer, _ = _train(make_trainer, {"memory_fraction": 1e-6}, max_steps=6)
    (near,) = findings_of(trainer.args.output_dir, "MEMORY_NEAR_LIMIT")
    assert near["step"] == 4 and near["evidence"]["measure"] == "process peak RSS of machine memory"
    assert near["evidence"]["peak_bytes"] > 50e6 and near["evidence"]["limit_bytes"] > near["evidence"]["peak_bytes"]


def test_the_bound_is_found_at_the_first_step_whose_exact_window_crosses_it_whatever_the_running_sums_drift() -> None:
    """The plugin keeps running sums as a cheap first test and decides on the window's exact sums: the finding must
    come at the step a plain recomputation finds, after a long run of steps of very different sizes."""
    import random
    from collections import deque
    from types import SimpleNamespace

    from harness.plugins.throughput import Throughput

    rng = random.Random(3)
    times = [(rng.choice([1e-3, 0.02, 5.0, 300.0]), 0.0) for _ in range(5000)]  # huge and tiny steps: cancellation in the sums
    times += [(0.02, rng.uniform(0.0, 0.004)) for _ in range(100)] + [(0.02, 0.0065 + 0.0001 * i) for i in range(60)]
    reports: list[int] = []
    plugin = Throughput()
    plugin.options = plugin.Options(window=20, skip_first=0, log_every=10**9, dataloader_bound_fraction=0.3, check_memory_every=10**9)
    ctx = SimpleNamespace(world_size=1, rank=0, log_metrics=lambda *a, **k: None,
                          report=lambda code, message, step=None, **k: reports.append(step))
    plugin.__dict__["ctx"] = ctx
    plugin.on_run_start(trainer=SimpleNamespace(model=torch.nn.Linear(2, 2), args=SimpleNamespace(device=torch.device("cpu"))))
    plugin._memory_reported = True
    window: deque[tuple[float, float]] = deque(maxlen=20)
    expected = None
    for step, (seconds, wait) in enumerate(times, 1):
        window.append((seconds, wait))
        if expected is None and len(window) == 20 and sum(w for _, w in window) / sum(s for s, _ in window) > 0.3:
            expected = step
        plugin.on_step_end(ctx=ctx, step=step, metrics={"step_time": seconds, "data_time": wait, "tokens": 8})
    assert expected is not None and expected > 5100 and reports == [expected]
