"""Finding the train sampler's seed through torch and accelerate loaders (real samplers, no process group; milliseconds)."""
from __future__ import annotations

import torch
from torch.utils.data import BatchSampler, DataLoader, DistributedSampler, RandomSampler, SequentialSampler

from harness.lib.sampler_seed import find_sampler, sampler_seed

DATA = list(range(16))


def test_a_plain_shuffling_loader_draws_from_the_global_generator() -> None:
    torch.manual_seed(9)
    found = sampler_seed(DataLoader(DATA, batch_size=4, shuffle=True))
    assert (found.kind, found.seed, found.sharded) == ("global", 9, False)


def test_a_sampler_with_its_own_generator_and_a_sequential_loader() -> None:
    loader = DataLoader(DATA, sampler=RandomSampler(DATA, generator=torch.Generator().manual_seed(5)), batch_size=4)
    assert (sampler_seed(loader).kind, sampler_seed(loader).seed) == ("generator", 5)
    plain = sampler_seed(DataLoader(DATA, batch_size=4))
    assert plain.kind == "none" and not plain.known and sampler_seed(None).kind == "none"


def test_a_distributed_sampler_is_sharded_and_keeps_its_seed_and_epoch() -> None:
    sampler = DistributedSampler(DATA, num_replicas=2, rank=1, seed=17)
    sampler.set_epoch(2)
    found = sampler_seed(DataLoader(DATA, sampler=sampler, batch_size=4))
    assert (found.kind, found.seed, found.epoch, found.sharded) == ("distributed", 17, 2, True)
    unshuffled = DistributedSampler(DATA, num_replicas=2, rank=1, shuffle=False)
    assert sampler_seed(DataLoader(DATA, sampler=unshuffled, batch_size=4)).kind == "none"


def test_accelerates_seedable_sampler_under_a_two_process_shard() -> None:
    from accelerate.data_loader import BatchSamplerShard, DataLoaderShard, SeedableRandomSampler

    seedable = SeedableRandomSampler(data_source=DATA, data_seed=3)
    shard = BatchSamplerShard(BatchSampler(seedable, 4, False), num_processes=2, process_index=1)
    loader = DataLoaderShard(DATA, batch_sampler=shard)
    found = sampler_seed(loader)
    assert (found.kind, found.seed, found.sharded) == ("seedable", 3, True) and "BatchSamplerShard" in found.chain
    assert find_sampler(loader) is seedable
    assert find_sampler(DataLoader(DATA, sampler=SequentialSampler(DATA))) is None
