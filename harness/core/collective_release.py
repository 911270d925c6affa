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

The script's own last collectives carry the same race and are out of the
harness's reach: accelerate's gather for evaluation metrics drops its output
list the moment ``all_gather`` returns, and torch's gloo ``barrier`` makes a
tensor of its own (a bare two-rank script ending in a barrier aborted in 7 of
40 runs). So the exit hook also waits until gloo's worker threads are idle
(``wait_for_idle_workers``): a worker that still has to let go of a tensor
is runnable or running while this thread sleeps with the GIL released; an
idle one sleeps on its queue.
"""
from __future__ import annotations

import collections
import contextlib
import sys
import time
from pathlib import Path
from typing import Iterator, Sequence

import torch

SETTLE_LIMIT_S = 2.0  # an exit waits at most this long for the backend; a collective's worker needs microseconds
_WORKER_THREAD_NAME = "pt_gloo_runloop"  # the name torch gives gloo's worker threads (their /proc comm)
_QUIET_POLLS = 3  # consecutive polls, 1 ms apart with the GIL free, that find every worker asleep
_NO_PROC_GRACE_S = 0.05  # where threads cannot be read (not Linux), the GIL is left free this long instead
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


def _worker_states(tasks: Path) -> list[str] | None:
    """The scheduler state ('R', 'S', ...) of each of gloo's worker threads in this process; None without /proc."""
    try:
        thread_ids = [entry.name for entry in tasks.iterdir()]
    except OSError:
        return None
    states = []
    for thread_id in thread_ids:
        try:
            if (tasks / thread_id / "comm").read_text().strip() != _WORKER_THREAD_NAME:
                continue
            stat = (tasks / thread_id / "stat").read_text()
        except OSError:  # the thread ended between the listing and the read
            continue
        states.append(stat[stat.rindex(")") + 2])  # the field after "(comm)"; comm may itself hold ")"
    return states


def wait_for_idle_workers(limit_s: float = SETTLE_LIMIT_S, tasks: Path = Path("/proc/self/task")) -> bool:
    """Sleep (the GIL free) until every gloo worker thread has been asleep for a few polls (True), or ``limit_s`` (False).

    A worker that finished a collective and must still release its tensors
    asks for the GIL; with the GIL free it gets it at once, so it shows as
    running or runnable ('R') until it is back on its queue ('S'). Covers
    the collectives of the script and of torch itself, whose tensors the
    harness never sees.
    """
    if _worker_states(tasks) is None:
        time.sleep(_NO_PROC_GRACE_S)
        return True
    deadline = time.monotonic() + limit_s
    quiet = 0
    while quiet < _QUIET_POLLS:
        if time.monotonic() >= deadline:
            return False
        time.sleep(0.001)
        states = _worker_states(tasks) or []
        quiet = quiet + 1 if all(state == "S" for state in states) else 0
    return True
