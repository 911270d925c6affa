"""One rank's random streams and sampler seed as a row of int64s, and what the rows of all ranks say together.

The row rides the step exchange once (the ``rank_rng`` plugin's slot):
``[torch, cuda, python, numpy, sampler kind, sampler seed, sampler epoch, sharded]``
(digests from :mod:`harness.lib.rng_digest`, the sampler from
:mod:`harness.lib.sampler_seed`). Two judgements come out of the rows:

* ranks that share the stream their dropout draws from (the torch CPU
  generator for a CPU model, the CUDA generator for a CUDA one);
* ranks whose sharded sampler shuffles with another seed (or epoch) than
  the others: their slices come from different orders.
"""
from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from harness.lib.rng_digest import ABSENT, STREAMS, equal_groups, streams_equal_within
from harness.lib.sampler_seed import KINDS, SamplerSeed, decode_seed, encode_seed

WIDTH = len(STREAMS) + 4


@dataclass(frozen=True)
class RankRow:
    """What one rank sent: its stream digests and its sampler's seed."""

    digests: dict[str, int]
    sampler: SamplerSeed


@dataclass(frozen=True)
class SharedStream:
    """Ranks that hold the same state of ``stream`` (the dropout stream), and every stream they share."""

    ranks: tuple[int, ...]
    stream: str
    streams: tuple[str, ...]


def pack(digests: Mapping[str, int], sampler: SamplerSeed) -> list[int]:
    seed = encode_seed(sampler.seed) if sampler.seed is not None else 0
    return [int(digests.get(s, ABSENT)) for s in STREAMS] + [KINDS.index(sampler.kind), seed, int(sampler.epoch), int(sampler.sharded)]


def unpack(values: Sequence[int] | None) -> RankRow | None:
    """The row back (None for a rank that sent nothing or a row of another width)."""
    if values is None or len(values) != WIDTH:
        return None
    n = len(STREAMS)
    digests = dict(zip(STREAMS, (int(v) for v in values[:n])))
    kind_code, seed, epoch, sharded = (int(v) for v in values[n:])
    kind = KINDS[kind_code] if 0 <= kind_code < len(KINDS) else "none"
    sampler = SamplerSeed(kind, decode_seed(seed) if kind != "none" else None, epoch, bool(sharded))
    return RankRow(digests, sampler)


def rows_of(received: Sequence[Sequence[int] | None] | None) -> dict[int, RankRow]:
    """Every rank's row from ``ctx.shared(...)`` (ranks that sent nothing are left out)."""
    rows = {}
    for rank, values in enumerate(received or []):
        row = unpack(values)
        if row is not None:
            rows[rank] = row
    return rows


def shared_streams(rows: Mapping[int, RankRow], stream: str) -> list[SharedStream]:
    """Groups of ranks whose ``stream`` state is the same, each with every stream its ranks share."""
    digests = {rank: row.digests for rank, row in rows.items()}
    return [SharedStream(ranks, stream, tuple(streams_equal_within(digests, ranks))) for ranks in equal_groups(digests, stream)]


def sampler_mismatch(rows: Mapping[int, RankRow]) -> dict[int, SamplerSeed] | None:
    """Each sharded rank's sampler seed when they are not all the same (kind, seed and epoch); None when they agree."""
    sharded = {rank: row.sampler for rank, row in rows.items() if row.sampler.known and row.sampler.sharded}
    if len(sharded) < 2 or len({(s.kind, s.seed, s.epoch) for s in sharded.values()}) == 1:
        return None
    return sharded


def majority_seed(seeds: Mapping[int, SamplerSeed]) -> SamplerSeed:
    """The (kind, seed, epoch) most ranks hold (rank 0's on a tie): the odd ones out are the others."""
    counts: dict[tuple[str, int | None, int], list[int]] = {}
    for rank, s in sorted(seeds.items()):
        counts.setdefault((s.kind, s.seed, s.epoch), []).append(rank)
    best = max(counts.values(), key=lambda ranks: (len(ranks), -ranks[0]))
    return seeds[best[0]]
