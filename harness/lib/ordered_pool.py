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
state is pickled once per worker).
"""
from __future__ import annotations

import multiprocessing
import os
import queue
import threading
from collections import deque
from collections.abc import Callable, Iterable, Iterator
from multiprocessing.connection import Connection, wait
from typing import Any, TypeVar

Batch = TypeVar("Batch")
Result = TypeVar("Result")


class WorkerDied(RuntimeError):
    """A worker process ended before it returned its batch (killed, out of memory)."""


def _serve(conn: Connection, function: Callable[[Any, Any], Any], state: Any) -> None:
    """A worker: a batch in, ``(True, result)`` or ``(False, exception)`` out, until ``None`` or the pipe closes.

    A thread reads the batches as they come, so the parent's send never waits
    on this worker's own send of a large result (both would wait forever).
    """
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
                reply: tuple[bool, Any] = (True, function(state, batch))
            except Exception as exc:  # noqa: BLE001 - handed to the parent, which raises it
                reply = (False, exc)
            try:
                conn.send(reply)
            except (BrokenPipeError, ConnectionResetError):
                return
            except Exception as exc:  # noqa: BLE001 - an exception (or a result) that cannot be pickled
                conn.send((False, RuntimeError(f"{type(exc).__name__}: {exc} (while sending {type(reply[1]).__name__})")))
    except KeyboardInterrupt:
        return


def ordered_map(function: Callable[[Any, Batch], Result], state: Any, batches: Iterable[Batch], workers: int,
                ahead: int = 2) -> Iterator[Result]:
    """``function(state, batch)`` for every batch, in ``workers`` processes, yielded in input order.

    An exception a worker raises is raised here in its batch's turn; an
    exception raised while reading ``batches`` (the parent's own input) comes
    after the results of the batches read before it: the first problem in
    input order is the one reported. Closing the iterator early stops the workers.
    """
    context = multiprocessing.get_context("fork" if os.name == "posix" else "spawn")
    processes: list[Any] = []
    pipes: list[Connection] = []
    finished = False
    try:
        for _ in range(workers):
            mine, theirs = context.Pipe()
            process = context.Process(target=_serve, args=(theirs, function, state), daemon=True)
            process.start()
            theirs.close()
            processes.append(process)
            pipes.append(mine)
        yield from _dispatch(pipes, processes, iter(batches), ahead)
        finished = True
    finally:
        _stop(pipes, processes, gracefully=finished)


def _dispatch(pipes: list[Connection], processes: list[Any], batches: Iterator[Any], ahead: int) -> Iterator[Any]:
    queued: dict[Connection, deque[int]] = {pipe: deque() for pipe in pipes}
    owner = dict(zip(pipes, processes))
    results: dict[int, Any] = {}
    sent = delivered = 0
    reading_failed: BaseException | None = None
    exhausted = False
    while True:
        for pipe in pipes:
            while not exhausted and len(queued[pipe]) < ahead:
                try:
                    batch = next(batches)
                except StopIteration:
                    exhausted = True
                    break
                except Exception as exc:  # noqa: BLE001 - raised once the batches before it are delivered
                    reading_failed, exhausted = exc, True
                    break
                pipe.send(batch)
                queued[pipe].append(sent)
                sent += 1
        while delivered in results:
            ok, value = results.pop(delivered)
            if not ok:
                raise value
            yield value
            delivered += 1
        if exhausted and delivered == sent:
            break
        for pipe in wait([pipe for pipe in pipes if queued[pipe]]):
            try:
                reply = pipe.recv()
            except (EOFError, ConnectionResetError):
                process = owner[pipe]
                process.join(timeout=5)
                raise WorkerDied(f"a worker process (pid {process.pid}) ended with exit code {process.exitcode} before it "
                                 "returned its work (killed, or out of memory). Fix: run again with fewer workers, or "
                                 "look for what stopped it (dmesg for the OOM killer).") from None
            results[queued[pipe].popleft()] = reply
    if reading_failed is not None:
        raise reading_failed


def _stop(pipes: list[Connection], processes: list[Any], gracefully: bool) -> None:
    """Normal end: each worker reads ``None`` and returns. Early end (an error, the consumer stopped): terminate them."""
    for pipe in pipes:
        if gracefully:
            try:
                pipe.send(None)
            except OSError:
                pass
        pipe.close()
    for process in processes:
        if not gracefully:
            process.terminate()
        process.join(timeout=5)
        if process.is_alive():
            process.kill()
            process.join()
