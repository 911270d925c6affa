"""The distributed sampler's end-of-epoch padding, checked against accelerate's real BatchSamplerShard."""
from __future__ import annotations

import pytest
from accelerate.data_loader import BatchSamplerShard
from torch.utils.data import BatchSampler, SequentialSampler

from harness.lib.sampler_padding import epoch_padding, is_padding


@pytest.mark.parametrize("rows,batch,world", [(65, 4, 2), (64, 4, 2), (10, 3, 4), (7, 8, 2), (100, 5, 3)])
def test_the_padding_matches_what_accelerate_deals_each_rank(rows: int, batch: int, world: int) -> None:
    shards = [list(BatchSamplerShard(BatchSampler(SequentialSampler(range(rows)), batch, False), world, r)) for r in range(world)]
    per_rank = [sum(len(b) for b in s) for s in shards]
    padding = epoch_padding(rows, batch, world)
    total = sum(per_rank)
    if total == rows:
        assert padding is None
        return
    assert padding is not None and per_rank == [padding.per_rank] * world and padding.padded == total - rows
    for shard in shards:  # every repeat a rank sees lies in its last batch, and no more of them than is_padding allows
        seen: set[int] = set()
        position = 0
        for b in shard:
            repeats = sum(1 for i in b if i in seen)
            if repeats:
                assert is_padding(padding, position, repeats)
            seen.update(b)
            position += len(b)


def test_repeats_early_in_the_epoch_or_more_than_a_batch_are_not_padding() -> None:
    padding = epoch_padding(65, 4, 2)
    assert padding is not None and padding.last_round_from == 32
    assert not is_padding(padding, 0, 1)  # a replay from the epoch's start after a resume
    assert not is_padding(padding, 32, 5)  # more repeats than a batch holds
    assert is_padding(padding, 32, 3)


def test_nothing_is_padding_on_one_process_or_with_drop_last() -> None:
    assert epoch_padding(65, 4, 1) is None and epoch_padding(65, 4, 2, drop_last=True) is None
    assert not is_padding(None, 100, 1)
