"""One n-gram index for contamination checks, fed by two front ends (token ids, normalised words).

An eval example becomes a sequence of 64-bit units: token ids, or hashes of
its normalised words. Every window of ``n`` units gets a 64-bit polynomial
rolling hash with a fixed base (never Python's ``hash()``, so indexes agree
across processes and runs), computed for all windows at once from one
prefix sum. The index keeps the hashes sorted, with the example and offset
each came from, and a packed bitmap over the hashes' top bits as a
prefilter: most training windows are rejected by one lookup. A window that passes the prefilter and a
binary search is compared unit for unit with the eval example's window, so a
hash collision never becomes a reported match. Examples shorter than ``n``
are indexed as one window of their own length.
"""
from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field

import numpy as np

from harness.lib.scan_kernels import KERNELS
from harness.lib.word_scan import WordChunk, normalise_words  # noqa: F401 - normalise_words re-exported

BASE = np.uint64(0x9E3779B97F4A7C15)  # odd: multiplication by it is a bijection mod 2^64
_THREE, _SEVEN = np.uint64(3), np.uint64(7)


_CHUNK = 1 << 20  # units hashed per pass: bounds the temporaries (a few arrays of 8 MB)
_POWERS: dict[str, np.ndarray] = {}


def _inverse(odd: int) -> int:
    """Multiplicative inverse of an odd number modulo 2^64 (Newton's iteration)."""
    x = odd
    for _ in range(6):
        x = (x * (2 - odd * x)) % (1 << 64)
    return x


def _powers(length: int) -> tuple[np.ndarray, np.ndarray]:
    """BASE^m and BASE^-m for m < length (mod 2^64), cached and grown on demand."""
    if "forward" not in _POWERS or len(_POWERS["forward"]) < length:
        size = min(max(1 << (length - 1).bit_length(), 1 << 16), max(length, _CHUNK + 64))  # doubled as needed
        with np.errstate(over="ignore"):
            forward = np.cumprod(np.full(size, BASE, dtype=np.uint64))
            backward = np.cumprod(np.full(size, np.uint64(_inverse(int(BASE))), dtype=np.uint64))
        _POWERS["forward"] = np.concatenate([np.ones(1, dtype=np.uint64), forward[:-1]])
        _POWERS["backward"] = np.concatenate([np.ones(1, dtype=np.uint64), backward[:-1]])
    return _POWERS["forward"], _POWERS["backward"]


def _window_hashes(units: np.ndarray, n: int, out: np.ndarray) -> None:
    """Hashes sum((u+1) * BASE^(n-1-j)) of every window into ``out``, from one prefix sum (five passes, any n)."""
    count = len(units) - n + 1
    values = np.add(units.view(np.uint64) if units.dtype == np.int64 else units.astype(np.uint64), np.uint64(1))  # id 0 counts
    forward, backward = _powers(len(values))
    prefix = np.zeros(len(values) + 1, dtype=np.uint64)
    with np.errstate(over="ignore"):
        np.multiply(values, backward[: len(values)], out=values)
        np.cumsum(values, out=prefix[1:])
        np.subtract(prefix[n:], prefix[:count], out=out)
        np.multiply(out, forward[n - 1 : n - 1 + count], out=out)  # window i then carries BASE^(i+n-1-m) for its unit m


def window_hashes(units: np.ndarray, n: int) -> np.ndarray:
    """Polynomial hashes (mod 2^64, fixed base) of every window of ``n`` consecutive units; empty when fewer units.

    Every output bit depends on every unit of the window, the top bits (the
    prefilter's) included, through the multiplications' carries. Long inputs
    are hashed in chunks that overlap by n-1 units, so every window is hashed
    exactly once and the temporaries stay small.
    """
    count = len(units) - n + 1
    if count <= 0 or n <= 0:
        return np.empty(0, dtype=np.uint64)  # no window (n 0 has none either: never uninitialised values)
    out = np.empty(count, dtype=np.uint64)
    for start in range(0, count, _CHUNK):
        stop = min(start + _CHUNK, count)
        _window_hashes(units[start : stop + n - 1], n, out[start:stop])
    return out


def _hashes_by_length(units: np.ndarray, lengths: list[int]) -> dict[int, np.ndarray]:
    """``window_hashes(units, n)`` for several ``n`` at once, from one prefix sum per piece (the same values)."""
    total = len(units)
    out = {n: np.empty(max(total - n + 1, 0), dtype=np.uint64) for n in lengths}
    if not lengths or total < min(lengths):
        return out
    longest = max(lengths)
    for start in range(0, total, _CHUNK):
        piece = units[start : min(start + _CHUNK + longest - 1, total)]
        values = np.add(piece.view(np.uint64) if piece.dtype == np.int64 else piece.astype(np.uint64), np.uint64(1))
        forward, backward = _powers(len(values))
        prefix = np.zeros(len(values) + 1, dtype=np.uint64)
        with np.errstate(over="ignore"):
            np.multiply(values, backward[: len(values)], out=values)
            np.cumsum(values, out=prefix[1:])
            for n in lengths:
                count = min(_CHUNK, total - n + 1 - start)
                if count <= 0:
                    continue
                target = out[n][start : start + count]
                np.subtract(prefix[n : n + count], prefix[:count], out=target)
                np.multiply(target, forward[n - 1 : n - 1 + count], out=target)
    return out


def word_units(words: list[str]) -> np.ndarray:
    """Each word as a fixed 64-bit hash of its UTF-8 bytes, the text front end's units (the chunked scan's hash)."""
    return WordChunk.of(" ".join(words).encode("utf-8")).units


@dataclass
class EvalExample:
    """One eval example: where it comes from and its unit sequences (one per tokenisation variant)."""

    eval_set: str
    example_id: str
    text: str | None
    variants: list[np.ndarray]
    cuts: list[np.ndarray] | None = None  # per variant: where joined lines/documents meet (harness.lib.copied_spans)

    @property
    def length(self) -> int:
        return max((len(v) for v in self.variants), default=0)

    def cuts_of(self, variant: int) -> np.ndarray | None:
        return self.cuts[variant] if self.cuts is not None and variant < len(self.cuts) else None


@dataclass
class Hit:
    """A training window equal, unit for unit, to a window of an eval example."""

    example: int
    variant: int
    offset: int
    length: int
    position: int
    row: int = 0
    row_start: bool = False  # the window starts its training row (or document): text before it may be cut off, not different
    row_end: bool = False  # the window ends its training row (or document)


@dataclass
class _Table:
    """All indexed windows of one length: sorted hashes and, aligned, where each came from."""

    hashes: np.ndarray
    examples: np.ndarray
    variants: np.ndarray
    offsets: np.ndarray


@dataclass
class NgramIndex:
    """Sorted window hashes of a set of eval examples, with a bitmap prefilter and exact confirmation."""

    n: int
    examples: list[EvalExample]
    tables: dict[int, _Table] = field(default_factory=dict)
    templates_dropped: int = 0
    bitmap_bits: int = 24
    _bitmap: np.ndarray = field(default_factory=lambda: np.zeros(1, dtype=np.uint8), repr=False)

    @classmethod
    def build(cls, examples: list[EvalExample], n: int = 13, template_min_examples: int = 10, min_length: int = 1) -> "NgramIndex":
        """Index every window of every example (examples shorter than ``n``: one window of their own length).

        A window shared by ``template_min_examples`` or more distinct examples is
        boilerplate of the eval set (a prompt template) and is left out.
        """
        index = cls(n=n, examples=examples)
        by_length: dict[int, list[tuple[np.ndarray, int, int]]] = {}
        for e, example in enumerate(examples):
            for v, units in enumerate(example.variants):
                if len(units) >= max(min_length, 1):  # an empty example has no window (min_length 0 included)
                    by_length.setdefault(min(n, len(units)), []).append((units, e, v))
        by_length = {length: _windows_of_many(parts, length) for length, parts in by_length.items()}
        total = sum(len(h) for parts in by_length.values() for h, _, _ in parts)
        index.bitmap_bits = int(min(32, max(16, np.ceil(np.log2(max(total, 1) * 64)))))  # about 1 bit in 64 set
        for length, parts in by_length.items():
            hashes = np.concatenate([h for h, _, _ in parts])
            owners = np.concatenate([np.full(len(h), e, dtype=np.int64) for h, e, _ in parts])
            variants = np.concatenate([np.full(len(h), v, dtype=np.int16) for h, _, v in parts])
            offsets = np.concatenate([np.arange(len(h), dtype=np.int64) for h, _, _ in parts])
            if template_min_examples > 0 and len(hashes):
                keep = _not_templates(hashes, owners, template_min_examples)
                index.templates_dropped += int((~keep).sum())
                hashes, owners, variants, offsets = hashes[keep], owners[keep], variants[keep], offsets[keep]
            order = np.argsort(hashes, kind="stable")
            index.tables[length] = _Table(hashes[order], owners[order], variants[order], offsets[order])
        index._bitmap = np.zeros(1 << (index.bitmap_bits - 3), dtype=np.uint8)  # packed bits: fits in cache longer
        for table in index.tables.values():
            slots = table.hashes >> np.uint64(64 - index.bitmap_bits)
            np.bitwise_or.at(index._bitmap, slots >> _THREE, np.left_shift(1, (slots & _SEVEN).astype(np.uint8)).astype(np.uint8))
        return index

    def _maybe(self, hashes: np.ndarray) -> np.ndarray:
        """Positions whose hash may be indexed: its top bits' slot is set in the bitmap (one lookup, no false negatives)."""
        slots = hashes >> np.uint64(64 - self.bitmap_bits)
        bits = self._bitmap[slots >> _THREE] >> (slots & _SEVEN).astype(np.uint8)
        return np.flatnonzero(bits & 1)

    def _maybe_many(self, hashes: np.ndarray) -> np.ndarray:
        """``_maybe`` for long inputs: up to 2^24 slots the bitmap unpacked to one byte per slot (made once, the
        bitmap is fixed after ``build``), one gather instead of four passes; slots as int64, so no index cast."""
        slots = (hashes >> np.uint64(64 - self.bitmap_bits)).view(np.int64)
        if self.bitmap_bits > 24:
            return np.flatnonzero((self._bitmap[slots >> 3] >> (slots & 7).astype(np.uint8)) & 1)
        bytemap = self.__dict__.get("_bytemap")
        if bytemap is None:
            bytemap = self.__dict__["_bytemap"] = np.unpackbits(self._bitmap, bitorder="little").view(np.bool_)
        return np.flatnonzero(bytemap[slots])

    def _window_candidates(self, units: np.ndarray, lengths: list[int]) -> Iterator[tuple[int, np.ndarray, np.ndarray]]:
        """Per indexed length: the start of every window of ``units`` that passes the bitmap, and its hash (the C
        kernel's one rolling pass when it is built, else every window hashed and looked up in numpy)."""
        if KERNELS is not None:
            data = units if units.dtype in (np.int64, np.uint64) else units.astype(np.uint64)
            for length in lengths:
                positions, hashes = KERNELS.window_candidates(data, length, self._bitmap, self.bitmap_bits)
                yield length, np.frombuffer(positions, dtype=np.int64), np.frombuffer(hashes, dtype=np.uint64)
            return
        for length, hashes in _hashes_by_length(units, lengths).items():
            candidates = self._maybe_many(hashes)
            yield length, candidates, hashes[candidates]

    @property
    def windows(self) -> int:
        return sum(len(t.hashes) for t in self.tables.values())

    def windows_of(self, example: int, variant: int) -> int:
        """How many windows of one example's variant exist (what a matched fraction is out of)."""
        units = self.examples[example].variants[variant]
        return max(len(units) - min(self.n, len(units)) + 1, 0) if len(units) else 0

    def query(self, units: np.ndarray) -> list[Hit]:
        """Every window of ``units`` that equals an indexed eval window (confirmed unit for unit)."""
        return self.query_rows(np.asarray(units).reshape(1, -1))

    def query_rows(self, rows: np.ndarray) -> list[Hit]:
        """``query`` for a [rows, length] batch at once (windows never span two rows); ``Hit.row`` says which row."""
        hits: list[Hit] = []
        if rows.ndim != 2 or rows.size == 0:
            return hits
        width = rows.shape[1]
        flat = np.ascontiguousarray(rows).reshape(-1)
        # the C kernel's one rolling pass with the bitmap (when built): the training thread's checker, every micro-batch
        for length, candidates, wanted in self._window_candidates(flat, [n for n in self.tables if n <= width]):
            table = self.tables[length]
            inside = candidates % width <= width - length  # a window inside one row
            candidates, wanted = candidates[inside], wanted[inside]
            if not len(candidates):
                continue
            left = np.searchsorted(table.hashes, wanted, side="left")
            right = np.searchsorted(table.hashes, wanted, side="right")
            found = right > left
            for start, lo, hi in zip(candidates[found].tolist(), left[found].tolist(), right[found].tolist()):
                window = flat[start : start + length]
                for k in range(lo, hi):
                    example, variant, offset = int(table.examples[k]), int(table.variants[k]), int(table.offsets[k])
                    source = self.examples[example].variants[variant][offset : offset + length]
                    if np.array_equal(window, source):  # a hash collision stops here
                        position = start % width
                        hits.append(Hit(example, variant, offset, length, position, start // width, position == 0,
                                        position + length == width))
        return hits

    def query_segments(self, units: np.ndarray, bounds: np.ndarray) -> list[Hit]:
        """``query`` for many documents laid end to end in ``units``; ``bounds``: each one's first index, ascending from 0.

        Windows never span two documents; ``Hit.row`` is the document's index
        and ``Hit.position`` the window's start within it. Hits come document
        by document, each document's in ``query``'s order, so a chunk gives
        what one ``query`` per document would.
        """
        hits: list[Hit] = []
        lengths = [length for length in self.tables if length <= len(units)]
        if not lengths:
            return hits
        units = np.ascontiguousarray(units)
        for length, candidates, wanted in self._window_candidates(units, lengths):
            table = self.tables[length]
            if not len(candidates):
                continue
            rows = np.searchsorted(bounds, candidates, side="right") - 1
            inside = rows == np.searchsorted(bounds, candidates + (length - 1), side="right") - 1
            candidates, rows, wanted = candidates[inside], rows[inside], wanted[inside]
            left = np.searchsorted(table.hashes, wanted, side="left")
            found = table.hashes[np.minimum(left, len(table.hashes) - 1)] == wanted  # one search; the other end only for hits
            wanted, left = wanted[found], left[found]
            right = np.searchsorted(table.hashes, wanted, side="right")
            for start, row, lo, hi in zip(candidates[found].tolist(), rows[found].tolist(), left.tolist(), right.tolist()):
                window = units[start : start + length]
                for k in range(lo, hi):
                    example, variant, offset = int(table.examples[k]), int(table.variants[k]), int(table.offsets[k])
                    if np.array_equal(window, self.examples[example].variants[variant][offset : offset + length]):
                        position = start - int(bounds[row])
                        end = int(bounds[row + 1]) if row + 1 < len(bounds) else len(units)
                        hits.append(Hit(example, variant, offset, length, position, row, position == 0, start + length == end))
        hits.sort(key=lambda hit: hit.row)  # stable: within a document, table by table and position by position
        return hits


def _windows_of_many(parts: list[tuple[np.ndarray, int, int]], n: int) -> list[tuple[np.ndarray, int, int]]:
    """``(window_hashes(units, n), example, variant)`` for every part, hashed in one pass over all of them laid end to
    end (windows across two parts are computed, then dropped): one call instead of one per eval example."""
    if len(parts) < 2 or len({units.dtype for units, _, _ in parts}) > 1:  # mixed dtypes would concatenate as floats
        return [(window_hashes(units, n), e, v) for units, e, v in parts]
    counts = [len(units) - n + 1 for units, _, _ in parts]
    everything = window_hashes(np.concatenate([units for units, _, _ in parts]), n)
    starts = np.cumsum([0] + [len(units) for units, _, _ in parts[:-1]]).tolist()
    return [(everything[start : start + count], e, v) for start, count, (_, e, v) in zip(starts, counts, parts)]


def _not_templates(hashes: np.ndarray, owners: np.ndarray, limit: int) -> np.ndarray:
    """Mask of windows whose hash occurs in fewer than ``limit`` distinct examples."""
    order = np.lexsort((owners, hashes))
    by_hash, by_owner = hashes[order], owners[order]
    first_of_pair = np.ones(len(order), dtype=np.bool_)  # the first window of each distinct (hash, example)
    first_of_pair[1:] = (by_hash[1:] != by_hash[:-1]) | (by_owner[1:] != by_owner[:-1])
    pair_hashes = by_hash[first_of_pair]  # sorted: a run per hash, as long as its number of examples
    run_starts = np.flatnonzero(np.concatenate([[True], pair_hashes[1:] != pair_hashes[:-1]]))
    examples_per_hash = np.diff(np.append(run_starts, len(pair_hashes)))
    common = pair_hashes[run_starts[examples_per_hash >= limit]]
    return ~np.isin(hashes, common) if len(common) else np.ones(len(hashes), dtype=np.bool_)
