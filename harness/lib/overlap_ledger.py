"""Which windows of each eval example training has matched, on this rank and agreed over all ranks.

The ``contamination`` plugin judges an eval example on everything training
showed of it, over micro-batches, steps and ranks: a leaked example that a
block boundary cuts in two (and that two ranks may draw) is still one example
with most of its n-grams matched, while a template 13-gram shared by many
questions stays a small fraction. Matched windows are kept as Python ints
used as bitsets (bit i: window i of a tokenisation variant), three per
variant (its lanes): the windows matched, and of those the ones that started
or ended a training row (evidence that a training block boundary, not other
text, cut a copied line there: ``harness.lib.copied_spans``).

Ranks agree through the step exchange's one slot: each shares what it matched
that the agreed set lacks, as ``(key, lane << 40 | chunk, bits)`` triples
of 62-bit chunks; every rank merges every rank's triples, so every rank holds
the same agreed set, judges it alike and names the same reporter for an
example that became dirty (the lowest rank that contributed to it at that
exchange). Keys hash ``(eval set, id, ordinal)``, so ranks agree on them even
if their indexes were built in a different order. Nothing here touches torch.
"""
from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass

import xxhash

from harness.lib.overlap import Tally

CHUNK = 62  # bits per shared int64 (non-negative, whatever the sign handling on the way)
MASK = (1 << CHUNK) - 1
LANE_SHIFT = 40  # chunk numbers below, lane above: 2^40 chunks of 62 windows is far beyond any eval example
TRIPLE = 3

MATCHED, ROW_START, ROW_END = 0, 1, 2  # a variant's lanes: matched windows, those that started / ended a training row
LANES = 3

Bits = dict[int, int]  # lane (``lane_of(variant, kind)``) -> bitset of window offsets
IsDirty = Callable[[int, Bits], bool]


def example_keys(names: Iterable[tuple[str, str]]) -> list[int]:
    """A 62-bit key per (eval set, id); a repeated pair gets its ordinal mixed in, so keys stay distinct."""
    seen: dict[tuple[str, str], int] = {}
    keys = []
    for eval_set, example_id in names:
        ordinal = seen.get((eval_set, example_id), 0)
        seen[(eval_set, example_id)] = ordinal + 1
        keys.append(xxhash.xxh3_64_intdigest(f"{eval_set}\0{example_id}\0{ordinal}".encode()) & MASK)
    return keys


def lane_of(variant: int, kind: int = MATCHED) -> int:
    """The ledger's key for one kind of a variant's windows (every kind is merged and agreed alike: by OR)."""
    return variant * LANES + kind


def bits_of(offsets: Iterable[int]) -> int:
    bits = 0
    for offset in offsets:
        bits |= 1 << offset
    return bits


def offsets_of(bits: int) -> list[int]:
    """The set bits of ``bits``, ascending."""
    out = []
    while bits:
        low = bits & -bits
        out.append(low.bit_length() - 1)
        bits ^= low
    return out


def encode(key: int, lane: int, bits: int) -> list[int]:
    """The non-empty 62-bit chunks of one lane's bitset as flat triples."""
    out: list[int] = []
    chunk = 0
    while bits:
        part = bits & MASK
        if part:
            out += [key, (lane << LANE_SHIFT) | chunk, part]
        bits >>= CHUNK
        chunk += 1
    return out


def decode(values: Sequence[int]) -> list[tuple[int, int, int]]:
    """``(key, lane, bits)`` of flat triples (a cut tail that is not a whole triple is dropped)."""
    out = []
    for i in range(0, len(values) - TRIPLE + 1, TRIPLE):
        key, where, part = int(values[i]), int(values[i + 1]), int(values[i + 2])
        if key < 0 or where < 0 or part <= 0:
            continue  # not ours: never produced by encode
        lane, chunk = where >> LANE_SHIFT, where & ((1 << LANE_SHIFT) - 1)
        out.append((key, lane, part << (CHUNK * chunk)))
    return out


def tally_from_bits(bits: Bits, base: Tally | None = None) -> Tally:
    """A :class:`Tally` for ``judge`` with these windows (documents and locations from ``base``)."""
    tally = Tally()
    for lane, b in bits.items():
        if b:
            variant, kind = divmod(lane, LANES)
            (tally.matched, tally.row_starts, tally.row_ends)[kind][variant] = set(offsets_of(b))
    if base is not None:
        tally.documents, tally.locations, tally.near = base.documents, base.locations, base.near
    return tally


@dataclass(frozen=True)
class Dirty:
    """An eval example that just became dirty, and which rank reports it."""

    example: int
    reporter: int  # the lowest rank that contributed to it at the exchange that made it dirty
    ranks: tuple[int, ...]  # every rank whose matches of it were agreed so far in this run


class MatchLedger:
    """Matched windows per eval example: this rank's, the agreed ones of all ranks, and the examples reported."""

    def __init__(self, keys: Sequence[int]) -> None:
        self.keys = list(keys)
        self._example_of = {k: e for e, k in enumerate(self.keys)}
        self.local: dict[int, Bits] = {}
        self.agreed: dict[int, Bits] = {}
        self.reported: set[int] = set()
        self.contributors: dict[int, set[int]] = {}  # example -> ranks whose windows of it were agreed
        self._unshared: set[int] = set()  # examples whose local bits may hold some the agreed set lacks

    # -- this rank -----------------------------------------------------------------------------------

    def add(self, example: int, lane: int, offsets: Iterable[int]) -> int:
        """Record windows this rank matched (``lane``: which kind of which variant); how many are new to this rank."""
        per = self.local.setdefault(example, {})
        old = per.get(lane, 0)
        new = old | bits_of(offsets)
        per[lane] = new
        if new != old:
            self._unshared.add(example)
        return (new & ~old).bit_count()

    def combined(self, example: int) -> Bits:
        """Agreed and local windows together (what this rank knows of the example)."""
        out = dict(self.agreed.get(example, {}))
        for v, b in self.local.get(example, {}).items():
            out[v] = out.get(v, 0) | b
        return out

    def outgoing(self, capacity: int | None) -> list[int]:
        """Triples of local windows the agreed set lacks, at most ``capacity`` ints (the rest waits for the next exchange)."""
        out: list[int] = []
        for example in sorted(self._unshared):
            agreed = self.agreed.get(example, {})
            parts: list[int] = []
            for lane, bits in sorted(self.local.get(example, {}).items()):
                parts += encode(self.keys[example], lane, bits & ~agreed.get(lane, 0))
            if not parts:
                self._unshared.discard(example)
                continue
            if capacity is not None and len(out) + len(parts) > capacity:
                room = (capacity - len(out)) // TRIPLE * TRIPLE
                out += parts[:room]  # part of it now; the example stays unshared until all of it is agreed
                break
            out += parts
        return out

    # -- all ranks -------------------------------------------------------------------------------------

    def agree(self, per_rank: Sequence[Sequence[int] | None], is_dirty: IsDirty) -> list[Dirty]:
        """Merge every rank's triples (rank order) and return the examples that became dirty, each once per run."""
        contributors: dict[int, list[int]] = {}
        for rank, values in enumerate(per_rank):
            for key, lane, bits in decode(values or []):
                example = self._example_of.get(key)
                if example is None:
                    continue  # an example this rank did not index
                per = self.agreed.setdefault(example, {})
                per[lane] = per.get(lane, 0) | bits
                contributors.setdefault(example, set()).add(rank)
                self.contributors.setdefault(example, set()).add(rank)
        out = []
        for example in sorted(contributors):
            if example in self.reported or not is_dirty(example, self.agreed[example]):
                continue
            self.reported.add(example)
            out.append(Dirty(example, min(contributors[example]), tuple(sorted(self.contributors[example]))))
        return out

    def dirty_here_only(self, is_dirty: IsDirty) -> list[int]:
        """Run end, without an exchange: examples dirty only with this rank's unagreed windows (reported here, once)."""
        out = []
        for example in sorted(self._unshared):
            if example in self.reported or not is_dirty(example, self.combined(example)):
                continue
            self.reported.add(example)
            out.append(example)
        return out

    def restore(self, example: int, lane: int, bits: int) -> None:
        """Agreed windows carried over from a checkpoint (every rank restores the same)."""
        per = self.agreed.setdefault(example, {})
        per[lane] = per.get(lane, 0) | bits
