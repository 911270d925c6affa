"""A dataset that blocks in ``__getitem__`` when the Trainer asks for one step's batches, for tests of the ``watchdog`` plugin.

At run start the train loader's dataset (the one the torch ``DataLoader``
under accelerate's ``DataLoaderShard`` fetches from) is wrapped, so the block
happens where a stuck data source blocks: inside the data loader's
``__next__``, in the dataset's ``__getitem__`` (or ``__getitems__``), on the
training thread. It blocks once, when the Trainer has ended step ``step - 1``
and fetches the next batch, on a ``threading.Event`` that nobody sets: for
``hold_s`` seconds, or forever when ``hold_s`` is None.
"""
from __future__ import annotations

import threading
from pathlib import Path
from typing import Any


class HangingDataset:
    """Delegates to ``inner``; the first fetch after step ``step - 1`` ended waits ``hold_s`` seconds (None: forever)."""

    def __init__(self, inner: Any, trainer: Any, step: int, hold_s: float | None, marker: Path | None = None) -> None:
        self._inner, self._trainer, self._step, self._hold_s, self._marker = inner, trainer, step, hold_s, marker
        self._done = False
        self.release = threading.Event()

    def _maybe_block(self) -> None:
        if self._done or int(self._trainer.state.global_step) + 1 != self._step:
            return
        self._done = True
        if self._marker is not None:
            self._marker.write_text(f"blocked fetching the batches of step {self._step}\n", encoding="utf-8")
        self.release.wait(self._hold_s)

    def __getitem__(self, index: Any) -> Any:
        self._maybe_block()
        return self._inner[index]

    def __getitems__(self, indices: list[Any]) -> Any:
        self._maybe_block()
        many = getattr(self._inner, "__getitems__", None)
        return many(indices) if many is not None else [self._inner[i] for i in indices]

    def __len__(self) -> int:
        return len(self._inner)

    def __getattr__(self, name: str) -> Any:
        inner = self.__dict__.get("_inner")
        if inner is None:
            raise AttributeError(name)
        return getattr(inner, name)


def hang_train_data(trainer: Any, step: int, hold_s: float | None, marker: Path | None = None) -> HangingDataset:
    """Wrap the dataset of the Trainer's prepared train loader (known at ``on_train_begin``) with :class:`HangingDataset`."""
    loader = trainer.callback_handler.train_dataloader
    base = getattr(loader, "base_dataloader", loader)
    wrapped = HangingDataset(base.dataset, trainer, step, hold_s, marker)
    object.__setattr__(base, "dataset", wrapped)  # DataLoader forbids the assignment after init; the next iterator fetches from it
    return wrapped
