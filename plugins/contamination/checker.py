"""The contamination plugin's background checker: index lookups of host copies of micro-batches, off the training thread.

One checker serves one ``train()`` call: its own queue, index and thread (one
stuck past the run end never serves the next call). Training only copies
token ids to the host and buffers them (:class:`JobBuffer`); a full group of
micro-batches goes to the thread from ``on_loss``, as backward begins, and
the thread looks the whole group up in one index query while the training
thread is inside backward without the interpreter lock. Handing over every
micro-batch as it came made the thread wake, and take the lock from the
training thread's Python, once per micro-batch: on CPU that cost the
training thread more than the lookup itself. When the queue is full the
training thread waits, but never on a dead checker. What the checker finds
goes back through a second queue that the training thread drains at step
end (findings are made there only).
"""
from __future__ import annotations

import queue
import threading
import time
from collections import deque
from dataclasses import dataclass
from typing import Any

import numpy as np

from harness.lib.ngrams import Hit, NgramIndex

QUEUE_SIZE = 16  # groups of micro-batches waiting for the background checker at most (then training waits for it)
GROUP_SIZE = 16  # micro-batches handed to the checker at once (and whatever is buffered when a step needs the answers)
PUT_POLL_S = 0.5  # how often a waiting put looks whether the checker is still alive


@dataclass
class Job:
    """One micro-batch to look up: where it was trained and its token ids on the host (or on their way there)."""

    step: int
    micro: int
    rank: int
    ids: list[Any] | None  # the batch's sample ids, when it carries them
    host: Any  # a CPU tensor
    ready: Any = None  # a CUDA event recorded after the non-blocking copy


@dataclass
class Found:
    """The hits of one micro-batch (``rows``: its token ids, for snippets)."""

    job: Job
    hits: list[Hit]
    rows: np.ndarray


class Checker:
    """A daemon thread looking micro-batches up in the index; errors end it and are kept for the training thread."""

    def __init__(self, index: NgramIndex) -> None:
        self.index = index
        self.checked_tokens = 0
        self.error: BaseException | None = None  # what killed the thread (set there, read here)
        self._jobs: queue.Queue[list[Job] | None] = queue.Queue(maxsize=QUEUE_SIZE)
        self._found: deque[Found] = deque()  # appended there, taken here: deque's ends are thread-safe without a lock
        self._thread = threading.Thread(target=self._work, name="harness-contamination", daemon=True)
        self._thread.start()

    @property
    def alive(self) -> bool:
        return self._thread.is_alive() and self.error is None

    def put(self, jobs: list[Job] | None, timeout: float | None = None) -> bool:
        """Queue a group for the thread, waiting while it is busy but never on a dead one (or past ``timeout``); False if not queued."""
        waited = 0.0
        while self.alive:
            try:
                self._jobs.put(jobs, timeout=PUT_POLL_S)
                return True
            except queue.Full:
                waited += PUT_POLL_S
                if timeout is not None and waited >= timeout:
                    return False
        return False

    def wait_idle(self, timeout: float) -> bool:
        """Wait until every queued micro-batch was looked up (the last step's agreement needs them); False if not in time."""
        deadline = time.monotonic() + timeout
        while self.alive and self._jobs.unfinished_tasks:
            if time.monotonic() >= deadline:
                return False
            time.sleep(0.005)
        return self._jobs.unfinished_tasks == 0

    def finish(self, timeout: float) -> bool:
        """Let the thread finish the queue and end; True when it did within ``timeout`` (twice: to queue, to end)."""
        if self.put(None, timeout=timeout):
            self._thread.join(timeout=timeout)
        return not self._thread.is_alive() and self.error is None

    def found(self) -> list[Found]:
        """What the thread found since the last call."""
        found, out = self._found, []
        while found:  # the common step finds nothing: one length test, no lock, no exception
            out.append(found.popleft())
        return out

    def _work(self) -> None:
        while True:
            jobs = self._jobs.get()
            if jobs is None:
                self._jobs.task_done()
                return
            try:
                for found in self._look_up(jobs):
                    self._found.append(found)
            except BaseException as exc:  # noqa: BLE001 - the training thread reports it; this thread ends
                self.error = exc
                return
            finally:
                self._jobs.task_done()

    def _look_up(self, jobs: list[Job]) -> list[Found]:
        """One index query per row width for the whole group; each hit goes back to the micro-batch its row came from."""
        by_width: dict[int, list[tuple[Job, np.ndarray]]] = {}
        for job in jobs:
            if job.ready is not None:
                job.ready.synchronize()
            rows = job.host.numpy().astype(np.int64, copy=False)
            by_width.setdefault(rows.shape[1], []).append((job, rows))
        found: list[Found] = []
        for parts in by_width.values():
            stacked = np.concatenate([rows for _, rows in parts]) if len(parts) > 1 else parts[0][1]
            hits = self.index.query_rows(stacked)
            self.checked_tokens += stacked.size
            if not hits:
                continue
            starts = np.cumsum([0] + [len(rows) for _, rows in parts])
            per_job: dict[int, list[Hit]] = {}
            for hit in hits:
                j = int(np.searchsorted(starts, hit.row, side="right")) - 1
                hit.row -= int(starts[j])
                per_job.setdefault(j, []).append(hit)
            found += [Found(parts[j][0], job_hits, parts[j][1]) for j, job_hits in sorted(per_job.items())]
        return found


class JobBuffer:
    """Micro-batches copied to the host, handed to the checker ``GROUP_SIZE`` at a time (or all at once with ``flush``)."""

    def __init__(self, checker: Checker, group_size: int = GROUP_SIZE) -> None:
        self.checker = checker
        self.group_size = max(1, group_size)
        self._jobs: list[Job] = []

    def add(self, job: Job) -> None:
        """Buffer one micro-batch (the caller flushes a full group: ``full``)."""
        self._jobs.append(job)

    @property
    def full(self) -> bool:
        return len(self._jobs) >= self.group_size

    def flush(self, timeout: float | None = None) -> bool:
        """Hand over whatever is buffered (before the answers are needed: the last step, run end)."""
        if not self._jobs:
            return True
        jobs, self._jobs = self._jobs, []
        return self.checker.put(jobs, timeout=timeout)
