"""Content hashes of token rows: stable across processes and runs (xxh3, never Python's ``hash()``)."""
from __future__ import annotations

import numpy as np
import torch
import xxhash


def row_hashes(rows: torch.Tensor) -> list[str]:
    """One 64-bit hex digest per row of a 2-D integer tensor, from its raw bytes as int64.

    The dtype is fixed before hashing so that the same tokens hash alike
    whether a collator produced int32 or int64.
    """
    if rows.dim() == 1:
        rows = rows.unsqueeze(0)
    array = np.ascontiguousarray(rows.detach().to("cpu", torch.int64).numpy())
    return [xxhash.xxh3_64_hexdigest(array[i].tobytes()) for i in range(array.shape[0])]


_HASH_SEED = 0x7A3D_5EED
_weights: dict[tuple[str, int], torch.Tensor] = {}


def _position_weights(device: torch.device, length: int) -> torch.Tensor:
    """Fixed odd 63-bit multipliers per position (same numbers in every process and run), cached per device."""
    key = (str(device), length)
    cached = _weights.get(key)
    if cached is None:
        generator = torch.Generator().manual_seed(_HASH_SEED)
        cached = (torch.randint(0, 2**62, (max(length, 1),), generator=generator, dtype=torch.int64) * 2 + 1).to(device)
        _weights[key] = cached
    return cached


def device_row_hashes(ids: torch.Tensor, mask: torch.Tensor | None = None) -> torch.Tensor:
    """A 64-bit content hash per row, computed where the batch lives (no host sync, no per-token Python).

    A random linear hash modulo 2^64: each token id (+1, so id 0 counts)
    times a fixed odd multiplier for its position, summed with int64
    wrap-around. Masked (padding) positions contribute nothing, so a row
    hashes alike whatever right padding it got. Two different rows collide
    with probability about 2^-63.
    """
    if ids.dim() == 1:
        ids = ids.unsqueeze(0)
    values = ids.to(torch.int64) + 1
    if mask is not None and mask.shape == ids.shape:
        values = values * mask.to(torch.int64)
    return (values * _position_weights(ids.device, ids.shape[1])[: ids.shape[1]]).sum(dim=1)


def combine_hashes(hashes: torch.Tensor) -> torch.Tensor:
    """One order-sensitive hash of a 1-D int64 hash tensor (a batch from its rows), on its device."""
    weights = _position_weights(hashes.device, hashes.shape[0] + 1)[1 : hashes.shape[0] + 1]
    return (hashes * weights).sum()


def combine_row_hashes(hashes: list[int]) -> int:
    """``combine_hashes`` for row hashes already on the host: the same number, without a device op."""
    weights = _position_weights(torch.device("cpu"), len(hashes) + 1)[1 : len(hashes) + 1].tolist()
    total = sum(h * w for h, w in zip(hashes, weights)) & 0xFFFF_FFFF_FFFF_FFFF
    return total - (1 << 64) if total >= 1 << 63 else total


def hex64(value: int) -> str:
    """An int64 hash as 16 hex digits (two's complement, so negative values print alike everywhere)."""
    return f"{value & 0xFFFF_FFFF_FFFF_FFFF:016x}"
