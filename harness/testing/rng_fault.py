"""A train sampler that shuffles with another seed on one rank (what a per-rank ``set_seed`` before ``train()`` does).

accelerate seeds its ``SeedableRandomSampler`` with ``torch.initial_seed()``
when the loader is built, unless ``data_seed`` is set; a script that calls
``set_seed(seed + rank)`` before ``train()`` gets one seed per rank. The
fault gives the sampler that seed directly, leaving the global RNG alone
(so the ranks' dropout streams stay as the Trainer seeded them). Called at
run start: after the loader is built, before its first ``__iter__``.
"""
from __future__ import annotations

from typing import Any

import torch
from torch.utils.data import DistributedSampler

from harness.lib.sampler_seed import find_sampler, train_loader


def reseed_sampler(trainer: Any, seed: int) -> str:
    """Make the train loader's shuffling sampler use ``seed``; returns the sampler's class name ("" when there is none)."""
    sampler = find_sampler(train_loader(trainer))
    if sampler is None:
        return ""
    if isinstance(getattr(sampler, "initial_seed", None), int):  # accelerate's SeedableRandomSampler
        sampler.initial_seed = int(seed)
    elif isinstance(sampler, DistributedSampler):
        sampler.seed = int(seed)
    elif isinstance(getattr(sampler, "generator", None), torch.Generator):
        sampler.generator.manual_seed(int(seed))
    else:
        sampler.generator = torch.Generator().manual_seed(int(seed))
    return type(sampler).__name__
