"""Where a distributed sampler repeats samples on purpose: the padded last round of an epoch.

With several processes the Trainer's loader goes through accelerate's
``BatchSamplerShard``: batches of ``batch_size`` are dealt round-robin to the
ranks and, with ``even_batches`` (the default), the last round is completed
with samples from the start of the epoch so that every rank takes the same
number of steps. Those samples are trained twice in the epoch by design, not
because the data position was lost; ``data_hash`` must not call them repeats.
torch's ``DistributedSampler`` pads the same way (fewer than ``world_size``
samples, also at the end of the epoch).
"""
from __future__ import annotations

import math
from dataclasses import dataclass


@dataclass(frozen=True)
class EpochPadding:
    """One rank's view of an epoch: how many samples it trains, and from which position on repeats are padding."""

    per_rank: int  # samples each rank trains per epoch
    padded: int  # samples added over all ranks to even the last round out
    batch_size: int

    @property
    def last_round_from(self) -> int:
        """The position (samples into this rank's epoch) where its last, possibly padded, batch starts."""
        return max(0, self.per_rank - self.batch_size)


def epoch_padding(rows: int, batch_size: int, world_size: int, drop_last: bool = False, even_batches: bool = True) -> EpochPadding | None:
    """The padding of one epoch of ``rows`` samples, or None when nothing is padded (one process, exact fit, dropped tail)."""
    if world_size <= 1 or rows <= 0 or batch_size <= 0 or drop_last or not even_batches:
        return None
    batches = math.ceil(rows / batch_size)
    rounds = math.ceil(batches / world_size)
    padded = rounds * batch_size * world_size - rows
    if padded <= 0:
        return None
    return EpochPadding(per_rank=rounds * batch_size, padded=padded, batch_size=batch_size)


def is_padding(padding: EpochPadding | None, position: int, repeats: int) -> bool:
    """Whether ``repeats`` repeated samples of a batch that starts ``position`` samples into the epoch are the sampler's padding."""
    return padding is not None and position >= padding.last_round_from and 0 < repeats <= min(padding.padded, padding.batch_size)
