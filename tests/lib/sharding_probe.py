"""Run under ``torchrun --nproc_per_node 2`` (gloo, CPU): what harness.lib.sharding and the fingerprints see of FSDP2 and FSDP1.

Prints one JSON line per rank and layout: the detected sharding, the full parameter counts, and this rank's
fingerprints of its shards (summed over ranks by the test, they must equal the unsharded model's).
"""
from __future__ import annotations

import json

import torch
import torch.distributed as dist
from torch.distributed.fsdp import FullyShardedDataParallel, fully_shard

from harness.lib.fingerprints import exact_fingerprints, optimizer_tensors, param_tensors, tensor_sums
from harness.lib.sharding import full_parameter_counts, model_sharding, replicated_local


def build() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(5, 7), torch.nn.ReLU(), torch.nn.Linear(7, 3))  # 7 rows: shards of 4 and 3


def main() -> None:
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    layouts = {
        "fsdp2": lambda m: fully_shard(m),
        "fsdp1": lambda m: FullyShardedDataParallel(m, device_id=torch.device("cpu")),
        "fsdp1_orig": lambda m: FullyShardedDataParallel(m, device_id=torch.device("cpu"), use_orig_params=True),
    }
    for name, wrap in layouts.items():
        model = wrap(build())
        sums = tensor_sums(param_tensors(model))  # before any update: the shards of the seeded model
        optimizer = torch.optim.Adam(model.parameters(), lr=0.1)
        model(torch.ones(2, 5)).sum().backward()
        norm = torch.nn.utils.clip_grad_norm_(model.parameters(), 1e9)
        optimizer.step()
        sharding = model_sharding(model)
        total, trainable = full_parameter_counts(model)
        print(json.dumps({
            "layout": name, "rank": rank, "kind": sharding.kind, "shard_size": sharding.shard_size, "described": sharding.describe(),
            "total": total, "trainable": trainable, "sum": sum(v[0] for v in sums.values()), "squares": sum(v[1] for v in sums.values()),
            "local_numel": sum(t.numel() for t in param_tensors(model).values()),
            "exact": len(exact_fingerprints([p.grad for p in model.parameters()])),
            "optimizer_tensors": len(optimizer_tensors(optimizer)),
            "norm": float(replicated_local(norm)), "norm_plain": type(replicated_local(norm)).__name__,
        }), flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
