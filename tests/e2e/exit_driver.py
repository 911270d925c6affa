"""One rank that ends right after the harness's collectives, as a rank does after ``train()`` returns.

Started by ``test_exit_after_collective.py`` with the launcher's variables
(RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT). The default group stays
referenced, as DDP's reducer keeps it, so destroying it at exit does not stop
gloo's worker threads. One more tensor is held by a C++ object that another
thread drops late (a gloo worker slow to let go of a collective's tensors);
an exit handler that runs after the harness's says whether that had happened
by then. The script's own collectives come last, as an evaluation's gather
and a barrier do after training: their tensors are out of the harness's reach,
so a thread that takes gloo's worker name and keeps running a while stands in
for a worker late to let go of them, and the same handler says whether it had
gone idle. Before that, the broadcasts of tensors others keep (grad_sync's
repair, the rerun plugin's batches) are timed: they wait for gloo, which
must not mean waiting out the limit. Prints JSON lines: what the collectives
returned, how long the broadcasts took and what the harness kept, then that answer.
"""
from __future__ import annotations

import atexit
import json
import threading
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from harness.core import collective_release
from harness.core.collective_release import _WORKER_THREAD_NAME, keep_until_exit
from harness.core.distributed import (
    all_gather_objects,
    all_reduce_max,
    broadcast_from,
    close_process_group_at_exit,
    exchange_rows,
    gather_to_main,
)
from harness.lib.rerun_exchange import broadcast_result, broadcast_step

LATE_S = 0.3  # how long after the last collective the stand-in worker lets go
HELD_LIKE_DDP: list[Any] = []  # the default group, referenced until the interpreter ends (as DDP's reducer does)


def _kept_after(call: Any) -> tuple[Any, list[int]]:
    """``call()``'s result and, per collective it made, how many tensors the harness kept for the exit."""
    collective_release._kept.clear()
    result = call()
    return result, [len(sent) for sent in collective_release._kept]


def _timed(call: Any) -> tuple[Any, float]:
    started = time.monotonic()
    result = call()
    return result, time.monotonic() - started


def main() -> None:
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    HELD_LIKE_DDP.append(dist.distributed_c10d._get_default_group())
    late_worker: list[torch.futures.Future] = []
    busy_worker: dict[str, float] = {}
    atexit.register(lambda: print(json.dumps({  # registered first, so it runs last
        "released_before_teardown": not late_worker, "workers_idle_before_teardown": "idle_at" in busy_worker,
    }), flush=True))
    close_process_group_at_exit()
    on_main, kept_gather = _kept_after(lambda: gather_to_main({"rank": rank, "findings": [f"finding of rank {rank}"] * (rank + 1)}))
    everywhere, kept_all_gather = _kept_after(lambda: all_gather_objects(("rank", rank, b"\x00" * (3 * rank))))
    most, kept_reduce = _kept_after(lambda: all_reduce_max([rank, -rank, 7]))
    rows, kept_rows = _kept_after(lambda: exchange_rows([rank, 5]))
    params = [torch.full((3,), float(rank)), torch.zeros(2, dtype=torch.int64) + rank]  # kept by their owner, like a model's
    _, repair_s = _timed(lambda: broadcast_from(params, src=1))
    batch = {"input_ids": torch.arange(6).view(2, 3) * (rank + 1)}
    step, rerun_s = _timed(lambda: broadcast_step(0, rank, [batch], None, [1.5]))
    result, result_s = _timed(lambda: broadcast_result(0, rank, 1, ([2.5], 0.5, True)))
    print(json.dumps({
        "rank": rank, "on_main": on_main, "everywhere": [list(map(repr, e)) for e in everywhere], "most": most, "rows": rows,
        "params": [p.tolist() for p in params],
        "rerun": [step[0][0]["input_ids"].tolist(), step[2], result], "seconds": {"broadcast_from": repair_s, "rerun_step": rerun_s, "rerun_result": result_s},
        "kept": {"gather_to_main": kept_gather, "all_gather_objects": kept_all_gather, "all_reduce_max": kept_reduce, "exchange_rows": kept_rows},
    }), flush=True)

    sent = torch.zeros(1)
    late_worker.append(torch.futures.Future())
    late_worker[0].set_result(sent)
    keep_until_exit(sent)
    del sent
    threading.Thread(target=lambda: (time.sleep(LATE_S), late_worker.clear()), daemon=True).start()
    all_reduce_max([0])  # the end-of-training agreement

    outputs = [torch.empty(2) for _ in range(2)]  # an evaluation's gather, as accelerate makes it: the list dies at once
    dist.all_gather(outputs, torch.full((2,), float(rank)))
    del outputs
    dist.barrier()
    threading.Thread(target=_busy_then_idle, args=(busy_worker,), daemon=True).start()
    while "named_at" not in busy_worker:
        time.sleep(0.001)
    # then nothing but the exit


def _busy_then_idle(record: dict[str, float]) -> None:
    """Take gloo's worker name, run for LATE_S (a worker late to release a collective's tensors), then sleep."""
    Path(f"/proc/self/task/{threading.get_native_id()}/comm").write_text(_WORKER_THREAD_NAME)
    record["named_at"] = time.monotonic()
    while time.monotonic() - record["named_at"] < LATE_S:
        pass
    record["idle_at"] = time.monotonic()
    threading.Event().wait()


if __name__ == "__main__":
    main()
