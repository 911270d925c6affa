"""The seed of the train loader's shuffling sampler, and whether the loader expects it equal on every rank.

What the HF Trainer (transformers 5.x, accelerate 1.x) builds: a
``RandomSampler`` that ``accelerator.prepare`` replaces with accelerate's
``SeedableRandomSampler`` (``use_seedable_sampler``, on by default), seeded
with ``args.data_seed`` or else ``torch.initial_seed()`` *at the moment the
loader is built* (inside ``train()``), then sharded by ``BatchSamplerShard``:
each rank takes its slice of one shuffled order, so the seeds must be
equal on every rank. The other forms found by the same walk: torch's
``DistributedSampler`` (``seed``, equal by contract), a sampler with its own
``generator`` (``generator.initial_seed()``; accelerate synchronises it from
rank 0 without the seedable sampler) and a shuffling sampler without one,
which draws its order from the global torch generator
(``torch.initial_seed()``: e.g. ``group_by_length``'s ``LengthGroupedSampler``).

Seeds travel as int64: a seed of 2**63 or more is sent as its two's
complement (:func:`encode_seed` / :func:`decode_seed` round-trip exactly).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

KINDS = ("none", "seedable", "distributed", "generator", "global")  # index = the code in the exchange
LINKS = ("base_dataloader", "batch_sampler", "sampler", "inner")  # accelerate's shard, batch samplers, the harness's recorder
MAX_DEPTH = 8


@dataclass(frozen=True)
class SamplerSeed:
    """``kind``: one of ``KINDS``; ``seed``: None for "none"; ``sharded``: the loader cuts one order into per-rank slices."""

    kind: str = "none"
    seed: int | None = None
    epoch: int = 0
    sharded: bool = False
    chain: str = ""

    @property
    def known(self) -> bool:
        return self.kind != "none" and self.seed is not None


def encode_seed(seed: int) -> int:
    """A seed as an int64 (two's complement above 2**63)."""
    value = int(seed) % (1 << 64)
    return value - (1 << 64) if value >= 1 << 63 else value


def decode_seed(value: int) -> int:
    return int(value) + (1 << 64) if value < 0 else int(value)


def _links(obj: Any) -> list[Any]:
    found = []
    for name in LINKS:
        try:
            child = getattr(obj, name, None)
        except Exception:  # noqa: BLE001 - a property that raises is no link
            child = None
        if child is not None and child is not obj:
            found.append(child)
    return found


def walk(loader: Any) -> list[Any]:
    """The loader, its wrapped loader, batch samplers and samplers, outermost first (bounded, each object once)."""
    seen: set[int] = set()
    order: list[Any] = []
    frontier = [loader]
    for _ in range(MAX_DEPTH):
        following = []
        for obj in frontier:
            if obj is None or id(obj) in seen:
                continue
            seen.add(id(obj))
            order.append(obj)
            following += _links(obj)
        frontier = following
    return order


def _is_shard(obj: Any) -> bool:
    """accelerate's ``BatchSamplerShard`` (num_processes) or torch's ``DistributedSampler`` (num_replicas), over several ranks."""
    for name in ("num_processes", "num_replicas"):
        value = getattr(obj, name, None)
        if isinstance(value, int) and not isinstance(value, bool) and value > 1:
            return True
    return False


def _seed_of(obj: Any) -> tuple[str, int, int] | None:
    """(kind, seed, epoch) of a shuffling sampler; None for anything else (loaders, batch samplers, sequential samplers)."""
    import torch
    from torch.utils.data import DataLoader, DistributedSampler, RandomSampler

    if isinstance(obj, DataLoader):
        return None
    epoch = getattr(obj, "epoch", 0)
    epoch = epoch if isinstance(epoch, int) and not isinstance(epoch, bool) else 0
    initial = getattr(obj, "initial_seed", None)
    if isinstance(obj, RandomSampler) and isinstance(initial, int):  # accelerate's SeedableRandomSampler
        return "seedable", initial, epoch
    if isinstance(obj, DistributedSampler):
        return ("distributed", int(obj.seed), epoch) if getattr(obj, "shuffle", True) else None
    generator = getattr(obj, "generator", None)
    if isinstance(generator, torch.Generator):
        return "generator", int(generator.initial_seed()), epoch
    if hasattr(obj, "generator") and generator is None and "Sampler" in type(obj).__name__:
        return "global", int(torch.initial_seed()), epoch  # RandomSampler, LengthGroupedSampler: the global torch generator
    return None


def find_sampler(loader: Any) -> Any | None:
    """The first shuffling sampler under ``loader`` (None: no loader, an iterable dataset, a sequential sampler)."""
    for obj in walk(loader):
        if obj is not loader and _seed_of(obj) is not None:
            return obj
    return None


def sampler_seed(loader: Any) -> SamplerSeed:
    """What ``loader`` shuffles with; ``SamplerSeed()`` when it does not shuffle or cannot be read."""
    if loader is None:
        return SamplerSeed()
    chain = walk(loader)
    names = " > ".join(type(o).__name__ for o in chain)
    if type(loader).__name__ == "DataLoaderDispatcher":  # rank 0 loads for everyone: the other ranks' samplers never draw
        return SamplerSeed(chain=names)
    sharded = any(_is_shard(o) for o in chain)
    for obj in chain:
        if obj is loader:
            continue
        found = _seed_of(obj)
        if found is not None:
            kind, seed, epoch = found
            return SamplerSeed(kind, seed, epoch, sharded, names)
    return SamplerSeed(sharded=sharded, chain=names)


def train_loader(trainer: Any) -> Any | None:
    """The Trainer's prepared train loader (set on its callback handler before ``on_train_begin``)."""
    handler = getattr(trainer, "callback_handler", None)
    return getattr(handler, "train_dataloader", None)
