"""The dataset index of every training row, taken from the batch sampler: captures name rows of datasets without an id column.

The Trainer's train loader is accelerate's ``DataLoaderShard`` around a torch
``DataLoader`` whose batch sampler yields, per batch, the indices into
``trainer.train_dataset`` (this rank's share under DDP, from
``BatchSamplerShard``). That batch sampler is wrapped by a recorder that puts
each index list in a FIFO as it yields it; the tap takes one list per
micro-batch as ``training_step`` receives it. Loader workers prefetch, but
they deliver batches in the order the sampler gave their indices, so the FIFO
stays aligned (a loader with ``in_order=False`` does not: then no index is
named). A resume wraps the recorder in accelerate's ``SkipBatchSampler``,
which draws and drops the first batches: those lists are dropped here too.

Where no index can be known (an ``IterableDataset``, batches dispatched from
rank 0, a stateful loader, a batch whose row count does not match its list)
the rows get no index and ``note`` says why, rather than a guess.
"""
from __future__ import annotations

import logging
from collections import deque
from collections.abc import Iterator, Mapping
from typing import Any

log = logging.getLogger("harness.hf.dataset_index")

Entry = tuple[int, int, list[int]]  # (iteration of the recorder, position in it, dataset indices)


class RecordingBatchSampler:
    """Yields what the wrapped batch sampler yields, and hands each index list to the feed first."""

    _own = ("inner", "feed")

    def __init__(self, inner: Any, feed: DatasetIndexFeed) -> None:
        object.__setattr__(self, "inner", inner)
        object.__setattr__(self, "feed", feed)

    def __iter__(self) -> Iterator[Any]:
        iteration = self.feed.begin_iteration()
        for position, indices in enumerate(self.inner):
            self.feed.push((iteration, position, [int(i) for i in indices]))
            yield indices

    def __len__(self) -> int:
        return len(self.inner)

    def __getattr__(self, name: str) -> Any:  # batch_size, drop_last, sampler, set_epoch ... of the wrapped sampler
        return getattr(object.__getattribute__(self, "inner"), name)

    def __setattr__(self, name: str, value: Any) -> None:  # accelerate's set_sampler assigns through the loader's batch sampler
        setattr(self.inner, name, value)


class DatasetIndexFeed:
    """The FIFO of index lists between the train loader's batch sampler and the tap."""

    def __init__(self, trainer: Any = None) -> None:
        self.trainer = trainer
        self.note: str | None = None  # why rows have no dataset index, when they have none
        self.recorder: RecordingBatchSampler | None = None
        self._fifo: deque[Entry] = deque()
        self._iteration = 0
        self._skip: dict[int, int] = {}  # iteration -> batches a SkipBatchSampler drew and dropped

    # -- the recorder's side ----------------------------------------------------------------------

    def begin_iteration(self) -> int:
        """A new pass of the sampler: anything left from the last one was never trained (the loop stopped early)."""
        self._iteration += 1
        self._fifo.clear()
        self._skip.clear()
        return self._iteration

    def push(self, entry: Entry) -> None:
        self._fifo.append(entry)

    # -- installing ---------------------------------------------------------------------------------

    def instrument(self, loader: Any) -> Any:
        """Wrap ``loader``'s batch sampler (the Trainer's prepared train loader); returns the loader, changed or not."""
        self.recorder, self.note = None, None
        self._fifo.clear()
        try:
            why_not = self._wrap(loader)
        except Exception as exc:  # noqa: BLE001 - indices are a nicety: never cost the run
            why_not = f"the train loader could not be instrumented ({type(exc).__name__}: {exc})"
        if why_not:
            self.note = why_not
            log.info("harness: captures will not name dataset indices: %s", why_not)
        return loader

    def _wrap(self, loader: Any) -> str | None:
        import torch.utils.data as tud

        if isinstance(getattr(loader, "dataset", None), tud.IterableDataset):
            return "the train dataset is an IterableDataset: its rows have no index"
        if type(loader).__name__ == "DataLoaderDispatcher":
            return "batches are dispatched from rank 0 (accelerate's dispatch_batches): this rank's rows have no index of their own"
        base = getattr(loader, "base_dataloader", loader)  # accelerate's DataLoaderShard wraps a torch DataLoader
        if type(base).__name__ == "StatefulDataLoader":
            return "a stateful data loader restores its own position: indices are not tracked"
        if not isinstance(base, tud.DataLoader):
            return f"the train loader is a {type(base).__name__}, not a torch DataLoader"
        if getattr(base, "num_workers", 0) > 0 and getattr(base, "in_order", True) is False:
            return "the loader's workers deliver batches out of order (in_order=False)"
        sampler = base.batch_sampler
        if sampler is None:
            return "the loader has no batch sampler (batch_size=None)"
        if isinstance(sampler, RecordingBatchSampler):
            self.recorder = sampler
            object.__setattr__(sampler, "feed", self)
            return None
        self.recorder = RecordingBatchSampler(sampler, self)
        object.__setattr__(base, "batch_sampler", self.recorder)  # DataLoader forbids the assignment after init
        return None

    # -- the tap's side -----------------------------------------------------------------------------

    def take(self, rows: int | None) -> list[int] | None:
        """The dataset indices of the micro-batch the tap just received (None when unknown)."""
        if self.recorder is None:
            return None
        while self._fifo:
            iteration, position, indices = self._fifo.popleft()
            if position < self._skipped(iteration):
                continue  # drawn by a SkipBatchSampler on resume and dropped before it became a batch
            if rows is not None and len(indices) != rows:
                self.note = f"a batch of {rows} rows came with {len(indices)} sampler indices: indices not named from then on"
                log.info("harness: %s", self.note)
                self.recorder = None
                self._fifo.clear()
                return None
            return indices
        return None

    def _skipped(self, iteration: int) -> int:
        if iteration not in self._skip:
            self._skip[iteration] = self._skip_of_active_loader()
        return self._skip[iteration]

    def _skip_of_active_loader(self) -> int:
        """Batches a ``SkipBatchSampler`` around the recorder drops (the loader of a resumed epoch), else 0."""
        state = getattr(getattr(self.trainer, "accelerator", None), "gradient_state", None)
        active = getattr(state, "active_dataloader", None) if state is not None else None
        base = getattr(active, "base_dataloader", active)
        outer = getattr(base, "batch_sampler", None)
        if outer is not None and outer is not self.recorder and getattr(outer, "batch_sampler", None) is self.recorder:
            return int(getattr(outer, "skip_batches", 0) or 0)
        return 0


def batch_rows(batch: Any) -> int | None:
    """Rows of a micro-batch, from a tensor's shape (host metadata: no device read)."""
    if isinstance(batch, Mapping):  # a dict, or the BatchEncoding a tokenizer-padding collator returns
        for key in ("input_ids", "labels", "attention_mask", "pixel_values", "chosen_input_ids"):
            value = batch.get(key)
            shape = getattr(value, "shape", None)
            if shape is not None and len(shape) > 0:
                return int(shape[0])
    return None
