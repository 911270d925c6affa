"""A bounded, exact table of 64-bit keys: counts (or a first value) per key in fixed memory.

``data_hash`` remembers which samples an epoch has trained and which id each
content hash first came with. A Python ``Counter`` of them grows with the
epoch (about 100 bytes per sample, without bound); this table is open
addressing with linear probing over two flat ``array`` buffers (an 8-byte
key and an 8-byte count or value per slot, load factor at most 1/2), grown
by doubling up to ``capacity`` keys and never beyond: 2^k slots of 16 bytes
for the smallest k with 2^k >= 2 x capacity, i.e. at most 64 bytes per key
of capacity (2 million keys: 64 MiB), 16 KiB for a small run.

Exact until full: a key is either stored with its true count, or (once
``capacity`` distinct keys are held) not stored at all, and then counted in
``untracked``. So a full table can miss a repeat; it never invents one. The
only false positive left is two different samples mapping to one 64-bit key
(content hashes are 64-bit already; string sample ids go through xxh3-64):
with n distinct keys about n^2 / 2^65, i.e. below 3e-7 for 10 million.
"""
from __future__ import annotations

from array import array
from typing import Any

import numpy as np
import xxhash

_M64 = 0xFFFF_FFFF_FFFF_FFFF
_ZERO = 0x9E37_79B9_7F4A_7C15  # stands in for key 0 (0 marks an empty slot)
_MIX = 0x9E37_79B9_7F4A_7C15  # Fibonacci hashing: sequential ids spread over the table
_START_BITS = 10


def key64(value: Any) -> int:
    """A stable 64-bit key for a sample id or a (signed) 64-bit hash: ints as they are, strings by xxh3-64."""
    if isinstance(value, bool) or not isinstance(value, int):
        data = value.encode() if isinstance(value, str) else repr(value).encode()
        return xxhash.xxh3_64_intdigest(data) or _ZERO
    return (value & _M64) or _ZERO


class SeenTable:
    """Counts per 64-bit key (``add``) or the first value stored per key (``setdefault``), ``capacity`` keys at most."""

    def __init__(self, capacity: int) -> None:
        self.capacity = max(1, int(capacity))
        self._max_bits = max(_START_BITS, (2 * self.capacity - 1).bit_length())
        self.untracked = 0  # keys met while the table was full (not stored)
        self._reset(_START_BITS)

    def _reset(self, bits: int) -> None:
        self._bits = bits
        self._mask = (1 << bits) - 1
        self._keys = array("Q", bytes(8 << bits))
        self._values = array("Q", bytes(8 << bits))
        self._size = 0

    def __len__(self) -> int:
        return self._size

    @property
    def slots(self) -> int:
        return self._mask + 1

    @property
    def nbytes(self) -> int:
        return self._keys.itemsize * len(self._keys) + self._values.itemsize * len(self._values)

    def clear(self) -> SeenTable:
        """Forget every key (memory stays allocated for the next epoch); returns the table."""
        self._keys = array("Q", bytes(8 * len(self._keys)))
        self._values = array("Q", bytes(8 * len(self._values)))
        self._size = 0
        self.untracked = 0
        return self

    def _slot(self, key: int) -> int:
        """The slot holding ``key``, or the empty slot where it would go."""
        keys, mask = self._keys, self._mask
        slot = ((key * _MIX) & _M64) >> (64 - self._bits)
        while True:
            held = keys[slot]
            if held == key or held == 0:
                return slot
            slot = (slot + 1) & mask

    def _claim(self, key: int) -> int | None:
        """The slot of ``key``, inserting it when absent; None when it is absent and the table is full."""
        slot = self._slot(key)
        if self._keys[slot] == key:
            return slot
        if self._size >= self.capacity:
            self.untracked += 1
            return None
        if 2 * (self._size + 1) > self.slots and self._bits < self._max_bits:
            self._grow()
            slot = self._slot(key)
        self._keys[slot] = key
        self._size += 1
        return slot

    def _grow(self) -> None:
        """Double the table, rehashing in numpy: a Python loop over millions of keys would stall the step it lands in.

        Linear probing stays valid for any placement in which every key sits at
        or after its home slot with no empty slot in between. Sorted by home
        slot, ``pos_i = max(home_i, pos_{i-1} + 1)`` is such a placement (one
        cumulative maximum); the few keys it would push past the last slot are
        inserted by ordinary probing, which wraps around.
        """
        old_keys = np.frombuffer(self._keys, dtype=np.uint64)
        old_values = np.frombuffer(self._values, dtype=np.uint64)
        held = old_keys != 0
        keys, values = old_keys[held], old_values[held]
        self._reset(self._bits + 1)
        home = ((keys * np.uint64(_MIX)) >> np.uint64(64 - self._bits)).astype(np.int64)  # uint64 products wrap mod 2^64
        order = np.argsort(home, kind="stable")
        keys, values, home = keys[order], values[order], home[order]
        steps = np.arange(len(keys), dtype=np.int64)
        pos = np.maximum.accumulate(home - steps) + steps if len(keys) else home
        fits = pos < self.slots
        new_keys = np.frombuffer(self._keys, dtype=np.uint64)
        new_values = np.frombuffer(self._values, dtype=np.uint64)
        new_keys[pos[fits]] = keys[fits]
        new_values[pos[fits]] = values[fits]
        self._size = int(fits.sum())
        for key, value in zip(keys[~fits].tolist(), values[~fits].tolist()):
            slot = self._slot(key)
            self._keys[slot] = key
            self._values[slot] = value
            self._size += 1

    def add(self, key: int) -> int:
        """Count ``key`` once more: its count now (0 when the table is full and does not hold it)."""
        keys, values = self._keys, self._values
        slot = ((key * _MIX) & _M64) >> (64 - self._bits)
        held = keys[slot]
        if held == key:  # the common cases inline: found, or an empty slot at the first probe
            count = values[slot] = values[slot] + 1
            return count
        if held == 0 and self._size < self.capacity and 2 * (self._size + 1) <= self.slots:
            keys[slot] = key
            values[slot] = 1
            self._size += 1
            return 1
        slot = self._claim(key)
        if slot is None:
            return 0
        count = self._values[slot] + 1
        self._values[slot] = count
        return count

    def count(self, key: int) -> int:
        slot = self._slot(key)
        return self._values[slot] if self._keys[slot] == key else 0

    def setdefault(self, key: int, value: int) -> int | None:
        """The value stored for ``key``, storing ``value`` when absent (None when absent and the table is full)."""
        slot = self._slot(key)
        if self._keys[slot] == key:
            return self._values[slot]
        slot = self._claim(key)
        if slot is None:
            return None
        self._values[slot] = value & _M64
        return value & _M64
