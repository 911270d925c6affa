"""Batches of work in worker processes that each hold one state object, results in input order.

``multiprocessing.Pool`` hands tasks out through three threads of the parent
(tasks, results, worker upkeep) and a shared queue with a lock; on two cores
those threads take CPU from the workers at every task, and two `harness
scan` workers were 1.65x of one. Here each worker has its own pipe, the
parent keeps ``ahead`` batches queued in every pipe (a worker finishing one
finds the next already there) and waits on all pipes at once, so it spends
CPU only to send batches and merge results: 1.8x.

The workers are forked where the platform can (they share the state, an
index of eval examples, without copying it) and spawned elsewhere (the
state is pickled once per worker). Start the pool before any thread of the
parent (a progress bar's) so that no lock is forked while held. A worker
exits when the parent closes its pipe, also when the parent is killed.
"""
from __future__ import annotations

import multiprocessing
import os
import pickle
import queue
import threading
import traceback
from collections import deque
from collections.abc import Callable, Iterable, Iterator
from multiprocessing.connection import Connection, wait
from typing import Any


class WorkerDied(RuntimeError):
    """A worker process ended before it returned its batch (killed, out of memory)."""


class WorkerError(RuntimeError):
    """The worker's traceback of an exception it raised (the ``__cause__`` of the exception raised in the parent)."""


def _serve(conn: Connection, function: Callable[[Any, Any], Any], state: Any, inherited: list[Connection]) -> None:
    """A worker: a batch in, ``(True, result)`` or ``(False, exception, traceback)`` out, until ``None`` or EOF.

    ``inherited``: the parent's ends of every pipe, copied by the fork; closed
    first, so that the parent's exit (or death) closes this worker's pipe. A
    thread reads the batches as they come, so the parent's send never waits
    on this worker's own send of a large result (both would wait forever).
    """
    for other in inherited:
        other.close()
    inbox: queue.SimpleQueue[Any] = queue.SimpleQueue()

    def receive() -> None:
        try:
            while True:
                batch = conn.recv()
                inbox.put(batch)
                if batch is None:
                    return
        except (EOFError, OSError):
            inbox.put(None)

    threading.Thread(target=receive, name="harness-batches-in", daemon=True).start()
    try:
        while (batch := inbox.get()) is not None:
            try:
                reply: tuple[Any, ...] = (True, function(state, batch))
            except Exception as exc:  # noqa: BLE001 - handed to the parent, which raises it
                reply = (False, _portable(exc), traceback.format_exc())
            try:
                conn.send(reply)
            except (BrokenPipeError, ConnectionResetError):
                return
            except Exception as exc:  # noqa: BLE001 - a result that cannot be pickled
                conn.send((False, RuntimeError(f"the result could not be sent to the parent: {type(exc).__name__}: {exc}"),
                           traceback.format_exc()))
    except KeyboardInterrupt:
        return


def _portable(exc: BaseException) -> BaseException:
    """``exc`` when it survives a pickle round trip unchanged in kind, else a RuntimeError that names it."""
    try:
        if type(pickle.loads(pickle.dumps(exc))) is type(exc):
            return exc
    except Exception:  # noqa: BLE001 - any failure to rebuild it: send a description instead
        pass
    return RuntimeError(f"{type(exc).__module__}.{type(exc).__qualname__}: {exc}")


class OrderedPool:
    """``workers`` processes holding ``state``; ``map(batches)`` yields ``function(state, batch)`` in input order.

    An exception a worker raises is raised in the parent in its batch's turn
    (the worker's traceback as its ``__cause__``); an exception raised while
    reading ``batches`` (the parent's own input) comes after the results of the
    batches read before it: the first problem in input order is the one
    reported. Leaving the ``with`` block normally lets the workers finish and
    exit; leaving it on an error, or closing ``map`` early, terminates them.
    """

    def __init__(self, function: Callable[[Any, Any], Any], state: Any, workers: int, ahead: int = 2) -> None:
        if workers < 1 or ahead < 1:
            raise ValueError(f"OrderedPool needs at least one worker and one batch ahead (got {workers} and {ahead})")
        self.function, self.state, self.workers, self.ahead = function, state, workers, ahead
        self.pipes: list[Connection] = []
        self.processes: list[Any] = []
        self._clean = True  # no map left half-way (leaving then lets the workers finish and exit)

    def __enter__(self) -> "OrderedPool":
        fork = os.name == "posix"
        context = multiprocessing.get_context("fork" if fork else "spawn")
        try:
            for _ in range(self.workers):
                mine, theirs = context.Pipe()
                inherited = [*self.pipes, mine] if fork else []  # spawn: the child gets only what is passed
                process = context.Process(target=_serve, args=(theirs, self.function, self.state, inherited), daemon=True)
                process.start()
                theirs.close()
                self.processes.append(process)
                self.pipes.append(mine)
        except BaseException:
            self._stop(gracefully=False)
            raise
        return self

    def __exit__(self, kind: Any, *rest: Any) -> None:
        self._stop(gracefully=kind is None and self._clean)

    def map(self, batches: Iterable[Any]) -> Iterator[Any]:
        self._clean = False
        yield from self._dispatch(iter(batches))
        self._clean = True

    def _dispatch(self, batches: Iterator[Any]) -> Iterator[Any]:
        queued: dict[Connection, deque[int]] = {pipe: deque() for pipe in self.pipes}
        owner = dict(zip(self.pipes, self.processes))
        results: dict[int, tuple[Any, ...]] = {}
        sent = delivered = 0
        reading_failed: BaseException | None = None
        exhausted = False
        while True:
            for pipe in self.pipes:
                while not exhausted and len(queued[pipe]) < self.ahead:
                    try:
                        batch = next(batches)
                    except StopIteration:
                        exhausted = True
                        break
                    except Exception as exc:  # noqa: BLE001 - raised once the batches before it are delivered
                        reading_failed, exhausted = exc, True
                        break
                    try:
                        pipe.send(batch)
                    except OSError:  # the worker is gone: its pipe is closed
                        raise self._died(owner[pipe]) from None
                    queued[pipe].append(sent)
                    sent += 1
            while delivered in results:
                reply = results.pop(delivered)
                if not reply[0]:
                    raise reply[1] from WorkerError(reply[2])
                yield reply[1]
                delivered += 1
            if exhausted and delivered == sent:
                break
            for pipe in wait([pipe for pipe in self.pipes if queued[pipe]]):
                try:
                    results[queued[pipe].popleft()] = pipe.recv()
                except (EOFError, OSError):
                    raise self._died(owner[pipe]) from None
        if reading_failed is not None:
            raise reading_failed

    @staticmethod
    def _died(process: Any) -> WorkerDied:
        process.join(timeout=5)
        return WorkerDied(f"a worker process (pid {process.pid}) ended with exit code {process.exitcode} before it returned "
                          "its work (killed, or out of memory). Fix: run again with fewer workers, or look for what stopped "
                          "it (dmesg shows the OOM killer).")

    def _stop(self, gracefully: bool) -> None:
        """Normal end: each worker reads ``None`` and returns. Otherwise: terminate them. Either way, reap them."""
        for pipe in self.pipes:
            if gracefully:
                try:
                    pipe.send(None)
                except OSError:
                    pass
            pipe.close()
        for process in self.processes:
            if not gracefully:
                process.terminate()
            process.join(timeout=5)
            if process.is_alive():
                process.kill()
                process.join()
        self.pipes, self.processes = [], []
