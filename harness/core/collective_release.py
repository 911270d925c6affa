"""Wait for gloo's worker threads to let go of a collective's tensors before the interpreter ends.

gloo runs each collective on one of its worker threads. The caller's
``wait()`` returns when the data has arrived; the worker drops its own
reference to the tensors a moment later. Dropping the last C++ reference to
a tensor that has a Python object takes the GIL (to release that object).
If the rank has meanwhile returned from ``train()`` and the interpreter is
finalising, CPython ends any thread that asks for the GIL: the worker is
unwound through a C++ destructor and the process aborts with "terminate
called without an active exception", a failed job after training ended well.

``torch.distributed.destroy_process_group`` does not help when something
else still holds the group (DDP's reducer does), and a rank's last
collective is typically the harness's own agreement at the end of training,
so the harness waits for its own tensors:

- tensors the harness makes for a collective and then drops are handed to
  ``keep_until_exit``; the exit hook (``settle``) waits until the backend
  holds none of them (nothing is paid per step);
- tensors that others keep (a model's parameters) are waited for at once,
  around the collective, by ``released_after``.
"""
from __future__ import annotations

import collections
import contextlib
import sys
import time
from typing import Iterator, Sequence

import torch

SETTLE_LIMIT_S = 2.0  # an exit waits at most this long for the backend; a collective's worker needs microseconds
_KEPT_COLLECTIVES = 16  # the tensors of this many recent collectives are kept; a worker holds only its latest

_kept: collections.deque[tuple[torch.Tensor, ...]] = collections.deque(maxlen=_KEPT_COLLECTIVES)


def keep_until_exit(*tensors: torch.Tensor) -> None:
    """Hold tensors that only this collective used, so that ``settle`` can see whether the backend still holds them."""
    _kept.append(tensors)


def _references(tensors: Sequence[torch.Tensor], i: int) -> int:
    """References to ``tensors[i]``'s Python object, getrefcount's own argument left out (a C++ holder counts as one).

    Taken by index, never through a loop variable, so that every count sees the same references.
    """
    return sys.getrefcount(tensors[i]) - 1


def _wait(tensors: Sequence[torch.Tensor], allowed: Sequence[int], limit_s: float) -> bool:
    """Sleep (the GIL released) until each tensor has at most its allowed references; False at the limit."""
    deadline = time.monotonic() + limit_s
    pending = list(range(len(tensors)))
    while True:
        pending = [i for i in pending if _references(tensors, i) > allowed[i]]
        if not pending:
            return True
        if time.monotonic() >= deadline:
            return False
        time.sleep(0.0005)


def settle(limit_s: float = SETTLE_LIMIT_S) -> bool:
    """Wait until no kept tensor is held by a backend thread any more (True), or ``limit_s`` passed (False)."""
    tensors = [tensor for sent in _kept for tensor in sent]
    _kept.clear()
    allowed = [1] * len(tensors)  # the list above is the one reference that is not the backend's
    return _wait(tensors, allowed, limit_s)


@contextlib.contextmanager
def released_after(tensors: Sequence[torch.Tensor], limit_s: float = SETTLE_LIMIT_S) -> Iterator[None]:
    """Around collectives on ``tensors`` that others keep: on leaving, wait until the backend has let go of them."""
    tensors = list(tensors)
    before = [_references(tensors, i) for i in range(len(tensors))]
    yield
    _wait(tensors, before, limit_s)
