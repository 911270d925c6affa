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
    # 150 ms per row, 4 rows a step: the wait dwarfs the tiny model's step. Under full load a CI run once stalled one
    # step of the window for seconds: the window's summed fraction dipped below 0.3 at step 8 and the finding came late.
    # The bound is judged per step (half the steps of the window waited or more) or on the window's share without its
    # longest wait, so one stalled step cannot move it.
    trainer, _ = _train(make_trainer, {}, train_dataset=SlowRows(lm_rows, 0.15), max_steps=10)
    (bound,) = findings_of(trainer.args.output_dir, "DATALOADER_BOUND")
    assert bound["step"] == 3 + 5  # skip_first 3, then a window of 5 steps
    ev = bound["evidence"]
    assert ev["window_steps"] == 5 and ev["median_wait_s"] >= 4 * 0.15
    assert 2 * ev["steps_waiting"] >= 5 or ev["trimmed_wait_fraction"] > 0.3  # the evidence holds the rule that fired
    assert ev["device"] == "cpu" and "the training loop waits on data" in bound["message"] and "accelerator" not in bound["message"]


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


def _drive(times: list[tuple[float, float]], window: int = 20, skip_first: int = 0, device: str = "cpu") -> list[tuple[int, str, dict[str, Any]]]:
    """The plugin's step logic on controlled (step seconds, data-wait seconds): no training, no clock. Returns its reports."""
    from types import SimpleNamespace

    from harness.plugins.throughput import Throughput

    reports: list[tuple[int, str, dict[str, Any]]] = []
    plugin = Throughput()
    plugin.options = plugin.Options(window=window, skip_first=skip_first, log_every=10**9, dataloader_bound_fraction=0.3,
                                    check_memory_every=10**9, peak_tflops=1.0)
    ctx = SimpleNamespace(world_size=1, rank=0, log_metrics=lambda *a, **k: None,
                          report=lambda code, message, step=None, evidence=None, **k: reports.append((step, message, evidence)))
    plugin.__dict__["ctx"] = ctx
    plugin.on_run_start(trainer=SimpleNamespace(model=torch.nn.Linear(2, 2), args=SimpleNamespace(device=torch.device(device))))
    plugin._memory_reported = True
    for step, (seconds, wait) in enumerate(times, 1):
        plugin.on_step_end(ctx=ctx, step=step, metrics={"step_time": seconds, "data_time": wait, "tokens": 8})
    return reports


def test_host_stalls_in_the_data_fetch_of_a_clean_10ms_run_are_not_dataloader_bound() -> None:
    """Issue 43 item 7: a clean CPU run of 10 ms steps waits about 0.6 ms a step for its batch, but a garbage collection
    or the scheduler of a loaded machine stalls a fetch now and then for tens of milliseconds (seen here: up to 29 ms in
    150 steps). Two 40 ms stalls in a 20-step window were 32% of the window's summed time: DATALOADER_BOUND at step 38,
    "the accelerator idles", on a run with no accelerator. The loop waited in at most 3 steps of 20: not bound."""
    times = [(0.0106, 0.0006)] * 200
    for stalled in (30, 37, 44, 130, 141):  # up to three stalls in one window
        times[stalled] = (0.0106 + 0.040, 0.0006 + 0.040)
    assert _drive(times) == []


def test_a_loop_that_waits_in_most_steps_is_bound_at_once_even_with_a_stalled_step() -> None:
    """Every step waits 6 ms of 16: bound as soon as the window fills (step 20), although one step of the window
    stalled for 2 s in its compute (summed over the window the wait was 5%: today's rule missed it until that step left
    the window)."""
    times = [(0.016, 0.006)] * 60
    times[4] = (2.016, 0.006)
    ((step, message, evidence),) = _drive(times)
    assert step == 20 and evidence["steps_waiting"] == 19 and evidence["window_steps"] == 20 and evidence["wait_fraction"] < 0.3
    assert "in 19 of them" in message and "the training loop waits on data" in message


def test_a_loader_that_stalls_one_step_in_four_for_a_second_is_bound() -> None:
    """A loader that stalls rarely but long (a remote shard fetched every fourth step): 5 steps of the window wait 1 s
    each for data, 96% of the window's time. Fewer than half the steps waited, so the per-step count alone missed it;
    the window's share without its 2 longest waits (3 s of 3.2) is far over the threshold: bound when the window fills."""
    times = [(0.0106 + 1.0, 1.0) if step % 4 == 3 else (0.0106, 0.0006) for step in range(60)]
    ((step, message, evidence),) = _drive(times)
    assert step == 20 and evidence["steps_waiting"] == 5 and evidence["window_steps"] == 20
    assert evidence["wait_fraction"] > 0.9 and evidence["trimmed_wait_fraction"] > 0.9 and evidence["trimmed_steps"] == 2
    assert "in 5 of them" in message and "96% of the window's time" in message and "without its 2 longest waits" in message


def test_a_loader_that_makes_every_other_step_wait_is_bound() -> None:
    """Half the steps wait 6 ms of 16 (a loader as fast as every second step): 10 of 20 is half the window, bound."""
    times = [(0.016, 0.006) if step % 2 else (0.016, 0.0) for step in range(60)]
    ((step, message, evidence),) = _drive(times)
    assert step == 20 and evidence["steps_waiting"] == 10 and "in 10 of them" in message


def test_three_long_host_stalls_in_a_window_of_a_clean_run_are_not_dataloader_bound() -> None:
    """The share without the window's 2 longest waits leaves one 40 ms stall of a clean 10 ms run: 22%, not bound."""
    times = [(0.0106, 0.0006)] * 100
    for stalled in (40, 45, 50, 70, 75, 80):
        times[stalled] = (0.0106 + 0.040, 0.0006 + 0.040)
    assert _drive(times) == []


def test_the_bound_says_the_accelerator_idles_only_on_an_accelerator() -> None:
    times = [(0.016, 0.008)] * 25
    ((_, message, evidence),) = _drive(times, device="cuda")
    assert "the accelerator idles" in message and evidence["device"] == "cuda"
    ((_, message, evidence),) = _drive(times, device="cpu")
    assert "accelerator" not in message and "the training loop waits on data" in message and evidence["device"] == "cpu"


def test_the_bound_is_found_at_the_first_step_whose_window_has_half_its_steps_waiting_after_a_long_run() -> None:
    """The count of waiting steps is kept as steps enter and leave the window: after 5,000 steps of very different
    sizes the finding comes at the step a plain recount finds (half the window waiting: 10 of 20)."""
    import random
    from collections import deque

    rng = random.Random(3)
    times = [(rng.choice([1e-3, 0.02, 5.0, 300.0]), 0.0) for _ in range(5000)]
    times += [(0.02, rng.uniform(0.0, 0.004)) for _ in range(100)] + [(0.02, 0.0065 + 0.0001 * i) for i in range(60)]
    times += [(0.02, 0.03 if i % 3 == 0 else 0.0) for i in range(30)]  # a third of the steps: never half
    window: deque[tuple[float, float]] = deque(maxlen=20)
    expected = None
    for step, (seconds, wait) in enumerate(times, 1):
        window.append((seconds, wait))
        kept = sorted(window, key=lambda entry: entry[1])[:18]
        trimmed = sum(w for _, w in kept) / sum(s for s, _ in kept)
        if expected is None and len(window) == 20 and (2 * sum(w > 0.3 * s for s, w in window) >= 20 or trimmed > 0.3):
            expected = step
    assert expected == 5100 + 10
    assert [step for step, _, _ in _drive(times)] == [expected]
