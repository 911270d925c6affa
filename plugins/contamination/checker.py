"""The contamination plugin's background checker: index lookups of host copies of micro-batches, off the training thread.

One checker serves one ``train()`` call: its own queue, index and thread (one
stuck past the run end never serves the next call). Training only copies
token ids to the host and queues them; when the queue is full it waits, but
never on a dead checker. What the checker finds goes back through a second
queue that the training thread drains (findings are made there only).
"""
from __future__ import annotations

import queue
import threading
import time
from dataclasses import dataclass
from typing import Any

import numpy as np

from harness.lib.ngrams import Hit, NgramIndex

QUEUE_SIZE = 64  # micro-batches waiting for the background checker at most (then training waits for it)
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
        self._jobs: queue.Queue[Job | None] = queue.Queue(maxsize=QUEUE_SIZE)
        self._found: queue.Queue[Found] = queue.Queue()
        self._thread = threading.Thread(target=self._work, name="harness-contamination", daemon=True)
        self._thread.start()

    @property
    def alive(self) -> bool:
        return self._thread.is_alive() and self.error is None

    def put(self, job: Job | None, timeout: float | None = None) -> bool:
        """Queue for the thread, waiting while it is busy but never on a dead one (or past ``timeout``); False if not queued."""
        waited = 0.0
        while self.alive:
            try:
                self._jobs.put(job, timeout=PUT_POLL_S)
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
        out = []
        while True:
            try:
                out.append(self._found.get_nowait())
            except queue.Empty:
                return out

    def _work(self) -> None:
        while True:
            job = self._jobs.get()
            if job is None:
                self._jobs.task_done()
                return
            try:
                if job.ready is not None:
                    job.ready.synchronize()
                rows = job.host.numpy().astype(np.int64, copy=False)
                hits = self.index.query_rows(rows)
                self.checked_tokens += rows.size
                if hits:
                    self._found.put(Found(job, hits, rows))
            except BaseException as exc:  # noqa: BLE001 - the training thread reports it; this thread ends
                self.error = exc
                return
            finally:
                self._jobs.task_done()
