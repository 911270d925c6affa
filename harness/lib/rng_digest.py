"""63-bit digests of a process's random streams, to compare them across ranks in one int64 each.

Ranks seeded alike (HF's Trainer calls ``set_seed(args.seed)`` on every rank)
hold bit-identical generator states; ranks seeded apart do not. A digest
says which, at the cost of hashing a few kilobytes once: the torch CPU
generator (mt19937, 5 KB), the current CUDA device's generator (Philox seed
and offset), python's ``random`` and numpy's legacy global ``RandomState``.
A stream this process does not have is ``ABSENT`` (-1; a digest is >= 0).
"""
from __future__ import annotations

import hashlib
import random
from array import array
from collections.abc import Mapping
from typing import Any

STREAMS = ("torch", "cuda", "python", "numpy")
ABSENT = -1
MASK63 = (1 << 63) - 1
STREAM_NAMES = {"torch": "torch CPU", "cuda": "CUDA", "python": "python random", "numpy": "numpy"}


def digest63(*parts: bytes) -> int:
    """A non-negative 63-bit digest of ``parts`` (fits an int64 exchange slot; -1 stays free for "absent")."""
    h = hashlib.blake2b(digest_size=8)
    for part in parts:
        h.update(len(part).to_bytes(8, "little"))
        h.update(part)
    return int.from_bytes(h.digest(), "little") & MASK63


def tensor_digest(state: Any) -> int:
    """Digest of a generator state (a uint8 tensor from ``get_rng_state``)."""
    return digest63(bytes(state.cpu().numpy().tobytes()))


def python_digest(state: tuple[Any, ...] | None = None) -> int:
    """Digest of ``random.getstate()`` (version, 625 words of mt19937 state, the cached gauss)."""
    version, words, gauss = state if state is not None else random.getstate()
    return digest63(repr(version).encode(), array("Q", words).tobytes(), repr(gauss).encode())


def numpy_digest() -> int:
    """Digest of numpy's global legacy ``RandomState`` (what ``np.random.seed`` / ``set_seed`` seed); ABSENT without numpy."""
    try:
        import numpy as np
    except ImportError:
        return ABSENT
    name, keys, pos, has_gauss, cached = np.random.get_state(legacy=True)
    return digest63(str(name).encode(), keys.tobytes(), repr((int(pos), int(has_gauss), float(cached))).encode())


def stream_digests() -> dict[str, int]:
    """This process's streams, digested now (host copies only: no device sync); CUDA only once it is initialised."""
    from harness.lib.rng_state import rng_state

    state = rng_state()
    return {
        "torch": tensor_digest(state["cpu"]),
        "cuda": tensor_digest(state["cuda"]) if "cuda" in state else ABSENT,
        "python": python_digest(),
        "numpy": numpy_digest(),
    }


def equal_groups(digests: Mapping[int, Mapping[str, int]], stream: str) -> list[tuple[int, ...]]:
    """Groups of two or more ranks whose ``stream`` digests are equal (ranks without the stream never group)."""
    by_value: dict[int, list[int]] = {}
    for rank, row in sorted(digests.items()):
        value = row.get(stream, ABSENT)
        if value != ABSENT:
            by_value.setdefault(value, []).append(rank)
    return sorted(tuple(ranks) for ranks in by_value.values() if len(ranks) > 1)


def streams_equal_within(digests: Mapping[int, Mapping[str, int]], ranks: tuple[int, ...]) -> list[str]:
    """The streams (in ``STREAMS`` order) on which every rank of ``ranks`` holds the same, present, state."""
    same = []
    for stream in STREAMS:
        values = {digests[r].get(stream, ABSENT) for r in ranks}
        if len(values) == 1 and ABSENT not in values:
            same.append(stream)
    return same
