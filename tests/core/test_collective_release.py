"""The exit waits for a backend thread to drop the harness's collective tensors (a C++ holder stands in for gloo's worker)."""
from __future__ import annotations

import threading
import time

import torch

from harness.core import collective_release
from harness.core.collective_release import keep_until_exit, released_after, settle


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
