"""OOM forensics as pure logic: recognising the error, where it struck, the causes ranked, the snapshot summary, the counters."""
from __future__ import annotations

import time
from typing import Any

import pytest
import torch

from harness.lib.memory_stats import gib, largest_tensors, memory_counters, tensor_names
from harness.lib.oom_causes import SEED_ORDER, OomFacts, message_numbers, oom_error, phase_of, rank_causes
from harness.lib.oom_snapshot import summarise_snapshot
from harness.testing.oom_fault import OOM_MESSAGE


def _causes(**facts: Any) -> list[str]:
    return [c["cause"] for c in rank_causes(OomFacts(**facts))]


def test_without_evidence_the_seeds_order_stands() -> None:
    assert _causes(step=9, phase="unknown", steps_done=8) == ["batch_too_large", "activations", "sharding", "sequence_length"]
    assert list(SEED_ORDER[:4]) == ["batch_too_large", "activations", "sharding", "sequence_length"]


def test_the_first_step_is_the_static_budget() -> None:
    ranked = rank_causes(OomFacts(step=1, phase="forward", steps_done=0, rows=8, seq_len=2048))
    assert ranked[0]["cause"] == "batch_too_large" and "8x2048" in ranked[0]["evidence"][0]
    assert ranked[1]["cause"] in ("activations", "sharding") and ranked[0]["fix"].startswith("lower per_device_train_batch_size")


def test_before_any_batch_the_model_and_optimizer_state_do_not_fit() -> None:
    ranked = rank_causes(OomFacts(step=None, phase="unknown"))
    assert ranked[0]["cause"] == "sharding" and "before its first micro-batch" in ranked[0]["evidence"][0]


def test_a_longer_batch_after_many_steps_is_the_sequence_length() -> None:
    ranked = rank_causes(OomFacts(step=500, phase="forward", steps_done=499, rows=4, seq_len=8192, longest_before=2048, median_before=900))
    assert ranked[0]["cause"] == "sequence_length"
    assert "8192 tokens long, the longest before was 2048 (median 900)" in ranked[0]["evidence"][0]


def test_where_the_allocation_failed_moves_its_cause_first() -> None:
    assert _causes(step=3, phase="evaluation", steps_done=3, eval_batch=64, train_batch=8)[0] == "evaluation"
    assert _causes(step=3, phase="checkpoint", steps_done=3)[0] == "checkpoint"
    assert _causes(step=1, phase="optimizer", steps_done=0)[0] == "sharding"
    assert _causes(step=5, phase="loss", steps_done=4, rows=8, seq_len=4096, longest_before=4096)[0] == "logits"
    assert "evaluation" not in _causes(step=3, phase="forward", steps_done=2)  # causes without evidence beyond the seeds' row are left out


def test_fragmentation_needs_a_large_unallocated_share() -> None:
    assert _causes(step=50, phase="forward", steps_done=49, seq_len=512, longest_before=512, reserved_unallocated=12.0, reserved=40.0)[0] == "fragmentation"
    assert "fragmentation" not in _causes(step=50, phase="unknown", steps_done=49, reserved_unallocated=1.2, reserved=76.3)
    assert "fragmentation" not in _causes(step=3, phase="forward", steps_done=2, seq_len=512, longest_before=512)
    assert "fragmentation" in _causes(step=300, phase="forward", steps_done=299, seq_len=512, longest_before=512)
    numbers = message_numbers(OOM_MESSAGE)
    assert numbers == {"tried_to_allocate": 2.0, "allocated": 75.10, "reserved_unallocated": 1.20}
    assert message_numbers("Tried to allocate 512.00 MiB")["tried_to_allocate"] == 0.5


def test_oom_errors_are_recognised_through_their_chain() -> None:
    assert oom_error(torch.OutOfMemoryError("CUDA out of memory")) is not None
    assert oom_error(RuntimeError("[enforce fail at alloc_cpu.cpp:83] DefaultCPUAllocator: not enough memory")) is not None
    assert oom_error(MemoryError()) is not None
    try:
        try:
            raise torch.OutOfMemoryError("CUDA error: out of memory")
        except RuntimeError as inner:
            raise ValueError("wrapped by a framework") from inner
    except ValueError as outer:
        assert isinstance(oom_error(outer), torch.OutOfMemoryError)
    assert oom_error(ValueError("shape mismatch")) is None and oom_error(None) is None


def _raised(*names: str) -> BaseException:
    """An OOM raised at the bottom of nested functions with these names (outermost first)."""
    def make(index: int) -> Any:
        def body() -> None:
            if index == len(names):
                raise torch.OutOfMemoryError("CUDA out of memory")
            make(index + 1)()
        if index < len(names):
            body.__code__ = body.__code__.replace(co_name=names[index])
        return body
    try:
        make(0)()
    except torch.OutOfMemoryError as exc:
        return exc
    raise AssertionError("not raised")


@pytest.mark.parametrize(("stack", "phase"), [
    (("training_step", "compute_loss", "forward", "forward"), "forward"),
    (("training_step", "compute_loss", "forward", "loss_function", "cross_entropy"), "loss"),
    (("training_step", "backward"), "backward"),
    (("_maybe_log_save_evaluate", "evaluate", "evaluation_loop", "prediction_step", "forward"), "evaluation"),
    (("_maybe_log_save_evaluate", "_save_checkpoint", "save_model"), "checkpoint"),
    (("train", "helper"), "unknown"),
])
def test_the_phase_comes_from_the_traceback(stack: tuple[str, ...], phase: str) -> None:
    found, where = phase_of(_raised(*stack))
    assert found == phase and where is not None and "test_oom_causes.py" in where


def test_a_snapshot_is_summarised_to_totals_top_blocks_and_the_oom_entry() -> None:
    frames = [{"filename": "/x/torch/nn/functional.py", "line": 1, "name": "linear"}, {"filename": "/m/modeling.py", "line": 7, "name": "forward"}]
    snapshot = {
        "segments": [
            {"device": 0, "total_size": 3 << 30, "allocated_size": 2 << 30, "segment_type": "large", "blocks": [
                {"size": 2 << 30, "requested_size": 2 << 30, "state": "active_allocated", "frames": frames},
                {"size": 1 << 30, "state": "inactive", "frames": []}]},
            {"device": 0, "total_size": 1 << 20, "allocated_size": 512, "segment_type": "small", "blocks": [
                {"size": 512, "requested_size": 500, "state": "active_allocated", "frames": []}]},
            {"device": 1, "total_size": 9 << 30, "allocated_size": 9 << 30, "segment_type": "large", "blocks": []},
        ],
        "device_traces": [[{"action": "alloc", "size": 5}, {"action": "oom", "size": 4 << 30, "device_free": 1 << 20, "frames": frames}], []],
    }
    summary = summarise_snapshot(snapshot, device=0, top=5)
    assert summary["segments"] == 2 and summary["reserved_bytes"] == (3 << 30) + (1 << 20)
    assert summary["reserved_unallocated_bytes"] == (1 << 30) + (1 << 20) - 512 and summary["largest_free_block_bytes"] == 1 << 30
    top = summary["top_allocations"]
    assert [t["bytes"] for t in top] == [2 << 30, 512] and top[0]["frames"] == ["/m/modeling.py:7 forward"]  # torch's own frames dropped
    assert summary["oom"] == [{"requested_bytes": 4 << 30, "device_free_bytes": 1 << 20, "frames": ["/m/modeling.py:7 forward"]}]
    assert summary["live_blocks_with_frames"] == 1 and summary["history"].startswith("frames recorded")


def test_cpu_counters_are_microseconds_and_the_tensor_scan_names_what_it_finds() -> None:
    device = torch.device("cpu")
    counters = memory_counters(device)
    assert counters["rss"] > 0 and counters["peak_rss"] >= counters["rss"] // 2
    started = time.perf_counter()
    for _ in range(1000):
        memory_counters(device)
    assert (time.perf_counter() - started) / 1000 < 50e-6  # measured about 3 us
    model = torch.nn.Linear(512, 512)
    big = torch.zeros(1024, 1024)  # 4 MiB: larger than any other tensor of this process
    view = big[:10]  # a view of the same storage is not counted twice
    found = largest_tensors(top=5, names=tensor_names(model, None))
    assert found["tensors"][0]["bytes"] == 4 << 20 and found["tensors"][0]["shape"] == [1024, 1024]
    assert any(t["name"] == "parameter weight" for t in found["tensors"]) and view.shape[0] == 10
    assert gib(3 << 30) == "3.00 GiB" and gib(5 << 20) == "5.0 MiB" and gib(None) == "n/a"
