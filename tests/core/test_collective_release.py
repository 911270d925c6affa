"""The exit waits for a backend thread to drop the harness's collective tensors (a C++ holder stands in for gloo's worker),
and for gloo's worker threads to go idle (a thread that takes their name stands in for a busy one)."""
from __future__ import annotations

import sys
import threading
import time
from pathlib import Path
from typing import Iterator

import pytest
import torch

from harness.core import collective_release
from harness.core.collective_release import keep_until_exit, released_after, settle, wait_for_idle_workers

TASKS = Path("/proc/self/task")
needs_proc = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="thread states are read from /proc")


def _held_by_cpp(tensor: torch.Tensor) -> torch.futures.Future:
    """A C++ object that holds ``tensor``, as a gloo work holds a collective's tensors until its thread drops it."""
    future: torch.futures.Future = torch.futures.Future()
    future.set_result(tensor)
    return future


def _drop_later(holder: list[object], delay_s: float) -> threading.Thread:
    def drop() -> None:
        time.sleep(delay_s)
        holder.clear()

    thread = threading.Thread(target=drop)
    thread.start()
    return thread


def test_a_tensor_only_the_harness_keeps_settles_at_once() -> None:
    keep_until_exit(torch.zeros(3), torch.ones(2))
    started = time.monotonic()
    assert settle(limit_s=5.0)
    assert time.monotonic() - started < 0.5
    assert not collective_release._kept  # settled tensors are let go


def test_settle_waits_until_the_other_thread_drops_its_reference() -> None:
    tensor = torch.arange(4)
    holder: list[object] = [_held_by_cpp(tensor)]
    keep_until_exit(tensor)
    del tensor
    thread = _drop_later(holder, 0.2)
    assert settle(limit_s=5.0)
    assert not holder, "settle returned while the holder still held the tensor"
    thread.join()


def test_settle_gives_up_at_its_limit() -> None:
    tensor = torch.arange(4)
    holder = _held_by_cpp(tensor)
    keep_until_exit(tensor)
    started = time.monotonic()
    assert not settle(limit_s=0.1)
    assert 0.09 <= time.monotonic() - started < 1.0
    del holder


def test_released_after_waits_for_tensors_others_keep() -> None:
    params = [torch.zeros(2), torch.zeros(3)]  # kept by their owner throughout, like a model's parameters
    holder: list[object] = []
    started = time.monotonic()
    with released_after(params, limit_s=5.0):
        holder.append(_held_by_cpp(params[1]))
        thread = _drop_later(holder, 0.2)
    assert not holder, f"released_after returned after {time.monotonic() - started:.3f} s while the holder still held a tensor"
    thread.join()


def test_released_after_does_not_wait_when_nothing_else_holds_them() -> None:
    params = [torch.zeros(2)]
    started = time.monotonic()
    with released_after(params, limit_s=5.0):
        pass
    assert time.monotonic() - started < 0.5


class _BusyWorker:
    """A thread named as gloo's workers are, running (state R) until told to sleep, then asleep on an event (state S)."""

    def __init__(self) -> None:
        self.stop_spinning = threading.Event()
        self.finish = threading.Event()
        self.spun_until = 0.0
        self.named = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()
        assert self.named.wait(5)

    def _run(self) -> None:
        (TASKS / str(threading.get_native_id()) / "comm").write_text(collective_release._WORKER_THREAD_NAME)
        self.named.set()
        while not self.stop_spinning.is_set():
            pass
        self.spun_until = time.monotonic()
        self.finish.wait()

    def close(self) -> None:
        self.stop_spinning.set()
        self.finish.set()
        self.thread.join(5)


@pytest.fixture
def busy_worker() -> Iterator[_BusyWorker]:
    worker = _BusyWorker()
    yield worker
    worker.close()


@needs_proc
def test_idle_workers_are_found_at_once(busy_worker: _BusyWorker) -> None:
    busy_worker.stop_spinning.set()  # asleep on its queue, as an idle gloo worker is
    time.sleep(0.05)
    started = time.monotonic()
    assert wait_for_idle_workers(limit_s=5.0)
    assert time.monotonic() - started < 0.5


@needs_proc
def test_the_exit_waits_while_a_worker_runs(busy_worker: _BusyWorker) -> None:
    assert "R" in collective_release._worker_states(TASKS)  # real gloo workers of this process, if any, are idle
    threading.Timer(0.3, busy_worker.stop_spinning.set).start()
    assert wait_for_idle_workers(limit_s=5.0)
    assert busy_worker.spun_until, "wait_for_idle_workers returned while the worker was still running"
    assert set(collective_release._worker_states(TASKS)) == {"S"}


@needs_proc
def test_a_worker_that_never_settles_is_waited_for_up_to_the_limit(busy_worker: _BusyWorker) -> None:
    started = time.monotonic()
    assert not wait_for_idle_workers(limit_s=0.2)
    assert 0.19 <= time.monotonic() - started < 2.0


def test_without_readable_threads_the_gil_is_left_free_for_a_grace(tmp_path: Path) -> None:
    started = time.monotonic()
    assert wait_for_idle_workers(limit_s=5.0, tasks=tmp_path / "no-proc")
    assert collective_release._NO_PROC_GRACE_S <= time.monotonic() - started < 1.0
