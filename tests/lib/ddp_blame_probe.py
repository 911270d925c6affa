"""Run under ``torchrun --nproc_per_node 2`` (gloo, CPU): per-sample blame on one DDP rank alone runs no collective.

Both ranks run a DDP step; then only rank 0 computes per-sample gradient
norms on the unwrapped module (vmap and loop) while rank 1 waits at a barrier.
A collective inside the blame would pair with that barrier and fail or hang
(the process group's timeout is short). Then both ranks run another DDP step:
the reducer must be intact and the ranks' gradients equal. Writes
``rank-<r>.json`` into the folder given as the first argument.
"""
from __future__ import annotations

import json
import os
import sys
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel
from transformers import LlamaForCausalLM

from harness.lib.sample_grads import blame_rows
from harness.lib.tiny import tiny_llama_config


def main() -> None:
    dist.init_process_group("gloo", timeout=timedelta(seconds=60))
    rank = dist.get_rank()
    torch.manual_seed(0)
    ddp = DistributedDataParallel(LlamaForCausalLM(tiny_llama_config(64, hidden_size=32, num_layers=2, num_heads=2)).train())
    ids = torch.randint(3, 64, (4, 16), generator=torch.Generator().manual_seed(rank))
    ddp(input_ids=ids, labels=ids).loss.backward()
    grads = [p.grad.clone() for p in ddp.parameters()]
    methods = []
    if rank == 0:
        for method in ("vmap", "loop"):
            methods.append(blame_rows(ddp.module, [({"input_ids": ids}, ids)], method=method).method)
    untouched = all(torch.equal(p.grad, g) for p, g in zip(ddp.parameters(), grads))
    dist.barrier()
    ddp.zero_grad(set_to_none=True)
    ddp(input_ids=ids, labels=ids).loss.backward()
    flat = torch.cat([p.grad.flatten() for p in ddp.parameters()])
    gathered = [torch.zeros_like(flat) for _ in range(2)]
    dist.all_gather(gathered, flat)
    result = {"rank": rank, "methods": methods, "untouched": untouched, "ranks_agree": bool(torch.equal(*gathered))}
    (Path(sys.argv[1]) / f"rank-{rank}.json").write_text(json.dumps(result), encoding="utf-8")
    dist.destroy_process_group()
    os._exit(0)  # the results are written: seen hanging in interpreter teardown when run from pytest under load


if __name__ == "__main__":
    main()
