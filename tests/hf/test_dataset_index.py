"""Dataset indices from the batch sampler: one list per batch, in the order batches arrive (workers, shards, resume skip).

Real torch DataLoaders and accelerate's own loader wrappers; the dataset's row
``i`` holds the value ``i``, so every batch says which indices it really holds.
"""
from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest
import torch
from transformers import BatchEncoding
from accelerate.data_loader import prepare_data_loader, skip_first_batches
from accelerate.state import GradientState
from torch.utils.data import DataLoader, Dataset, IterableDataset, RandomSampler

from harness.hf.dataset_index import DatasetIndexFeed, RecordingBatchSampler, batch_rows


class Rows(Dataset):
    """Row i is {"input_ids": [i, i]}: a batch names its own dataset indices."""

    def __len__(self) -> int:
        return 37

    def __getitem__(self, i: int) -> dict[str, Any]:
        return {"input_ids": torch.tensor([i, i])}


class Stream(IterableDataset):
    def __iter__(self) -> Any:
        return iter({"input_ids": torch.tensor([i, i])} for i in range(8))


def _drain(feed: DatasetIndexFeed, loader: Any) -> list[tuple[list[int], list[int] | None]]:
    """(indices the batch holds, indices the feed names) for every batch, taken as the tap takes them."""
    out = []
    for batch in loader:
        out.append((batch["input_ids"][:, 0].tolist(), feed.take(batch_rows(batch))))
    return out


def _shuffled(**kw: Any) -> DataLoader:
    return DataLoader(Rows(), batch_size=4, sampler=RandomSampler(Rows(), generator=torch.Generator().manual_seed(3)), **kw)


def test_each_batch_gets_the_indices_its_rows_came_from() -> None:
    feed = DatasetIndexFeed()
    loader = feed.instrument(_shuffled())
    seen = _drain(feed, loader)
    assert len(seen) == 10 and all(held == named for held, named in seen)
    assert sorted(i for held, _ in seen for i in held) == list(range(37))  # shuffled, every row once
    assert isinstance(loader.batch_sampler, RecordingBatchSampler) and len(loader) == 10
    for _ in zip(range(3), loader):  # an epoch the loop left early: its prefetched lists were never trained
        pass
    again = _drain(feed, loader)  # the next pass starts a fresh FIFO
    assert len(again) == 10 and all(held == named for held, named in again)


def test_prefetching_workers_stay_aligned() -> None:
    feed = DatasetIndexFeed()
    loader = feed.instrument(_shuffled(num_workers=2, prefetch_factor=3))
    seen = _drain(feed, loader)
    assert len(seen) == 10 and all(held == named for held, named in seen)


def test_a_shard_and_a_resume_skip_through_accelerate_s_loaders() -> None:
    feed = DatasetIndexFeed(SimpleNamespace(accelerator=SimpleNamespace(gradient_state=GradientState())))
    shard = prepare_data_loader(_shuffled(), num_processes=2, process_index=1, put_on_device=False)
    loader = feed.instrument(shard)
    full = _drain(feed, loader)
    assert all(held == named for held, named in full) and len(full) == 5  # this rank's half
    resumed = skip_first_batches(loader, 2)  # what the Trainer trains from in a resumed epoch
    seen = _drain(feed, resumed)
    assert len(seen) == 3 and all(held == named for held, named in seen)


def test_no_index_is_guessed() -> None:
    feed = DatasetIndexFeed()
    stream = feed.instrument(DataLoader(Stream(), batch_size=4))
    assert [named for _, named in _drain(feed, stream)] == [None, None]
    assert feed.note is not None and "IterableDataset" in feed.note

    feed = DatasetIndexFeed()
    loader = feed.instrument(_shuffled())
    iterator = iter(loader)
    next(iterator)
    assert feed.take(3) is None and "3 rows" in (feed.note or "")  # a batch that does not match its list: say so, stop naming
    assert feed.take(4) is None


@pytest.mark.parametrize("batch,rows", [
    ({"input_ids": torch.zeros(3, 5)}, 3),
    (BatchEncoding({"input_ids": torch.zeros(2, 5)}), 2),  # what tokenizer.pad and DataCollatorForLanguageModeling return
    ({"x": 1}, None),
    ([1, 2], None),
])
def test_batch_rows_reads_shapes_only(batch: Any, rows: int | None) -> None:
    assert batch_rows(batch) == rows
