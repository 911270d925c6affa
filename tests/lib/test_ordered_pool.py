"""Ordered work in worker processes: input order kept, errors raised in their turn, no deadlock on large messages,
no worker left behind."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from collections.abc import Iterator

import pytest

from harness.lib.ordered_pool import OrderedPool, WorkerDied, WorkerError


def _square_plus(state: int, batch: list[int]) -> list[int]:
    time.sleep(0.001 * (batch[0] % 3))  # batches finish out of order
    return [x * x + state for x in batch]


def _echo_big(state: None, batch: bytes) -> bytes:
    return batch * 2


def _fail_on(state: int, batch: int) -> int:
    if batch == state:
        raise ValueError(f"batch {batch} is bad")
    return batch


class _TwoArguments(Exception):
    def __init__(self, first: str, second: str) -> None:
        super().__init__(f"{first} and {second}")  # args hold one string: unpickling would call __init__ with one


def _fail_oddly(state: None, batch: int) -> int:
    raise _TwoArguments("this", "that")


def _die_on(state: int, batch: int) -> int:
    if batch == state:
        os.kill(os.getpid(), signal.SIGKILL)
    return batch


def _mapped(function, state, batches, workers=2, ahead=2) -> list:  # type: ignore[no-untyped-def]
    with OrderedPool(function, state, workers, ahead) as pool:
        return list(pool.map(batches))


def test_results_come_in_input_order_from_several_workers() -> None:
    batches = [[k, k + 1] for k in range(0, 200, 2)]
    assert _mapped(_square_plus, 7, batches) == [[x * x + 7 for x in b] for b in batches]


@pytest.mark.timeout(60)  # a deadlock would otherwise hold the suite for its 15-minute limit
def test_large_batches_and_results_do_not_deadlock() -> None:
    batches = [bytes([k]) * (1 << 20) for k in range(12)]  # 1 MiB each way: far beyond a pipe's buffer
    assert [len(r) for r in _mapped(_echo_big, None, batches, ahead=3)] == [2 << 20] * 12


def test_a_worker_exception_is_raised_in_its_turn_with_the_workers_traceback() -> None:
    seen: list[int] = []
    with pytest.raises(ValueError, match="batch 5 is bad") as raised:
        with OrderedPool(_fail_on, 5, 2) as pool:
            for result in pool.map(range(20)):
                seen.append(result)
    assert seen == [0, 1, 2, 3, 4]
    assert isinstance(raised.value.__cause__, WorkerError) and "_fail_on" in str(raised.value.__cause__)


def test_an_exception_that_cannot_be_rebuilt_comes_back_described() -> None:
    with pytest.raises(RuntimeError, match="_TwoArguments: this and that"):
        _mapped(_fail_oddly, None, range(3))


def test_an_input_error_comes_after_the_batches_read_before_it() -> None:
    def batches() -> Iterator[int]:
        yield from range(6)
        raise OSError("the seventh batch could not be read")

    seen: list[int] = []
    with pytest.raises(OSError, match="seventh"):
        with OrderedPool(_fail_on, -1, 2) as pool:
            for result in pool.map(batches()):
                seen.append(result)
    assert seen == list(range(6))


def test_a_killed_worker_is_an_error_that_says_so() -> None:
    with pytest.raises(WorkerDied, match="exit code -9"):
        _mapped(_die_on, 3, range(10))


def test_a_worker_killed_between_batches_is_an_error_that_says_so() -> None:
    def slow_input() -> Iterator[int]:
        yield 0
        os.kill(pool.processes[0].pid, signal.SIGKILL)  # while the parent reads its input, the first worker dies
        pool.processes[0].join()
        yield from range(1, 10)

    with pytest.raises(WorkerDied, match="exit code -9"):
        with OrderedPool(_fail_on, -1, 2, ahead=1) as pool:
            list(pool.map(slow_input()))


def test_stopping_early_ends_the_workers() -> None:
    pool = OrderedPool(_square_plus, 0, 2)
    with pool:
        results = pool.map([k] for k in range(1000))
        assert next(results) == [0]
        workers = list(pool.processes)
        results.close()
    assert len(workers) == 2 and not any(worker.is_alive() for worker in workers)


@pytest.mark.timeout(60)
def test_workers_exit_when_their_parent_is_killed(tmp_path) -> None:  # type: ignore[no-untyped-def]
    script = textwrap.dedent('''
        import sys, time
        from harness.lib.ordered_pool import OrderedPool

        def slow(state, batch):
            time.sleep(0.05)
            return batch

        with OrderedPool(slow, None, 2) as pool:
            print(*[p.pid for p in pool.processes], flush=True)
            for _ in pool.map(range(10_000)):
                pass
    ''')
    parent = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True)
    assert parent.stdout is not None
    workers = [int(pid) for pid in parent.stdout.readline().split()]
    assert len(workers) == 2
    parent.kill()
    parent.wait()
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline and any(_alive(pid) for pid in workers):
        time.sleep(0.1)
    assert not any(_alive(pid) for pid in workers), "workers outlived their killed parent"


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as handle:
            return handle.read().split(")")[-1].split()[0] != "Z"  # a zombie has exited (init reaps it later)
    except FileNotFoundError:
        return False


def test_a_pool_needs_a_worker() -> None:
    with pytest.raises(ValueError, match="at least one worker"):
        OrderedPool(_square_plus, 0, 0)
