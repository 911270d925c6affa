"""One rank that ends right after the harness's collectives, as a rank does after ``train()`` returns.

Started by ``test_exit_after_collective.py`` with the launcher's variables
(RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT). The default group stays
referenced, as DDP's reducer keeps it, so destroying it at exit does not stop
gloo's worker threads. One more tensor is held by a C++ object that another
thread drops late (a gloo worker slow to let go of a collective's tensors);
an exit handler that runs after the harness's says whether that had happened
by then. Prints JSON lines: what the collectives returned, then that answer.
"""
from __future__ import annotations

import atexit
import json
import threading
import time

import torch
import torch.distributed as dist

from harness.core.collective_release import keep_until_exit
from harness.core.distributed import all_gather_objects, all_reduce_max, close_process_group_at_exit, gather_to_main

LATE_S = 0.3  # how long after the last collective the stand-in worker lets go


def main() -> None:
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    held_like_ddp = dist.distributed_c10d._get_default_group()  # noqa: F841 - kept until the interpreter ends
    late_worker: list[torch.futures.Future] = []
    atexit.register(lambda: print(json.dumps({"released_before_teardown": not late_worker}), flush=True))  # runs last
    close_process_group_at_exit()
    on_main = gather_to_main({"rank": rank, "findings": [f"finding of rank {rank}"] * (rank + 1)})
    everywhere = all_gather_objects(("rank", rank, b"\x00" * (3 * rank)))
    most = all_reduce_max([rank, -rank, 7])
    print(json.dumps({"rank": rank, "on_main": on_main, "everywhere": [list(map(repr, e)) for e in everywhere], "most": most}), flush=True)

    sent = torch.zeros(1)
    late_worker.append(torch.futures.Future())
    late_worker[0].set_result(sent)
    keep_until_exit(sent)
    del sent
    threading.Thread(target=lambda: (time.sleep(LATE_S), late_worker.clear()), daemon=True).start()
    all_reduce_max([0])  # the end-of-training agreement; then nothing but the exit


if __name__ == "__main__":
    main()
