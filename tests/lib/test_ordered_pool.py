"""Ordered work in worker processes: input order kept, errors raised in their turn, no deadlock on large messages."""
from __future__ import annotations

import os
import signal
import time
from collections.abc import Iterator

import pytest

from harness.lib.ordered_pool import WorkerDied, ordered_map


def _square_plus(state: int, batch: list[int]) -> list[int]:
    time.sleep(0.001 * (batch[0] % 3))  # batches finish out of order
    return [x * x + state for x in batch]


def _echo_big(state: None, batch: bytes) -> bytes:
    return batch * 2


def _fail_on(state: int, batch: int) -> int:
    if batch == state:
        raise ValueError(f"batch {batch} is bad")
    return batch


def _die_on(state: int, batch: int) -> int:
    if batch == state:
        os.kill(os.getpid(), signal.SIGKILL)
    return batch


def test_results_come_in_input_order_from_several_workers() -> None:
    batches = [[k, k + 1] for k in range(0, 200, 2)]
    assert list(ordered_map(_square_plus, 7, batches, workers=2)) == [[x * x + 7 for x in b] for b in batches]


@pytest.mark.timeout(60)  # a deadlock would otherwise hold the suite for its 15-minute limit
def test_large_batches_and_results_do_not_deadlock() -> None:
    batches = [bytes([k]) * (1 << 20) for k in range(12)]  # 1 MiB each way: far beyond a pipe's buffer
    assert [len(r) for r in ordered_map(_echo_big, None, batches, workers=2, ahead=3)] == [2 << 20] * 12


def test_a_worker_exception_is_raised_in_its_turn() -> None:
    seen: list[int] = []
    with pytest.raises(ValueError, match="batch 5 is bad"):
        for result in ordered_map(_fail_on, 5, range(20), workers=2):
            seen.append(result)
    assert seen == [0, 1, 2, 3, 4]


def test_an_input_error_comes_after_the_batches_read_before_it() -> None:
    def batches() -> Iterator[int]:
        yield from range(6)
        raise OSError("the seventh batch could not be read")

    seen: list[int] = []
    with pytest.raises(OSError, match="seventh"):
        for result in ordered_map(_fail_on, -1, batches(), workers=2):
            seen.append(result)
    assert seen == list(range(6))


def test_a_killed_worker_is_an_error_that_says_so() -> None:
    with pytest.raises(WorkerDied, match="exit code -9"):
        list(ordered_map(_die_on, 3, range(10), workers=2))


def test_stopping_early_ends_the_workers() -> None:
    import multiprocessing

    results = ordered_map(_square_plus, 0, ([k] for k in range(1000)), workers=2)
    assert next(results) == [0]
    children = multiprocessing.active_children()
    assert len(children) == 2
    results.close()
    assert not any(child.is_alive() for child in children)
