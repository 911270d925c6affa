"""Content hashes of token rows: stable across processes, devices and runs (fixed constants, never Python's ``hash()``)."""
from __future__ import annotations

import operator
from itertools import islice
from typing import Any

import numpy as np
import torch


_HASH_SEED = 0x7A3D_5EED
_weights: dict[str, torch.Tensor] = {}  # device -> the longest multipliers drawn so far: one tensor per device, whatever the lengths


def _draw_weights(length: int) -> torch.Tensor:
    """The first ``length`` multipliers, drawn on the CPU from the fixed seed (position i gets the same number for every length)."""
    generator = torch.Generator().manual_seed(_HASH_SEED)
    return torch.randint(0, 2**62, (max(length, 1),), generator=generator, dtype=torch.int64).mul_(2).add_(1)


def _position_weights(device: torch.device, length: int) -> torch.Tensor:
    """Fixed odd 63-bit multipliers per position (same numbers in every process and run), cached per device.

    Only the longest tensor is kept (grown to the next power of two when a
    longer row arrives) and sliced: the CPU generator draws element by
    element, so the first n numbers of a longer draw are the numbers of a
    draw of n. Dynamic padding thus costs O(longest row) memory, not one
    tensor per distinct length.
    """
    length = max(length, 1)
    cached = _weights.get(device)
    last = _last_slice.get(device)
    if last is not None and last[0] is cached and last[1].shape[0] == length:
        return last[1]  # the common step: the length of the last batch (a slice is a tensor op, tens of microseconds in situ)
    if cached is None or cached.shape[0] < length:
        cached = _draw_weights(max(64, 1 << (length - 1).bit_length())).to(device)
        _weights[device] = cached
    view = cached[:length]  # a view: no memory of its own
    _last_slice[device] = (cached, view)
    return view


_last_slice: dict[Any, tuple[torch.Tensor, torch.Tensor]] = {}  # device -> (the cached multipliers, the last slice of them)


_host_list: list[int] = []  # the CPU multipliers as Python ints, for combining row hashes that are already on the host


def _host_weights(length: int) -> list[int]:
    """The first ``length`` multipliers as Python ints (converted once per growth, never per step)."""
    global _host_list
    if len(_host_list) < length:
        _host_list = _draw_weights(max(64, 1 << (max(length, 1) - 1).bit_length())).tolist()  # born on the host
    return _host_list[:length]


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
    values = (ids if ids.dtype == torch.int64 else ids.to(torch.int64)) + 1  # a new tensor: the products below go in place
    if mask is not None and mask.shape == ids.shape:
        values.mul_(mask if mask.dtype == torch.int64 else mask.to(torch.int64))
    # the model's own operations (add, mul, sum) are warm on the training thread; a fused but rarely used one (addcmul)
    # measured slower there, though it is one operation fewer
    return values.mul_(_position_weights(ids.device, ids.shape[1])).sum(dim=1)


MASKED_LABEL = -100  # the labels' ignore index: positions a masked-LM collator left as they were


def masked_lm_run(trainer: Any) -> bool:
    """Whether a trainer's collator masks its batches anew at every collation: ``mlm=True`` (transformers'
    ``DataCollatorForLanguageModeling`` and its whole-word subclass) or permutation LM (``plm_probability``, XLNet).
    Their ``input_ids`` hold ``[MASK]`` and random tokens drawn each time a row is collated, so the same sample never
    hashes alike twice; the labels hold the original tokens where the input was changed. A dataset masked once, ahead
    of training, hashes alike every time as it is (the dataset index hashes it so too). Decided once, at the run's start."""
    collator = getattr(trainer, "data_collator", None)
    return getattr(collator, "mlm", False) is True or getattr(collator, "plm_probability", None) is not None


def sample_tokens(batch: Any, key: str = "input_ids", masked_lm: bool = False) -> torch.Tensor:
    """A batch's ``key`` rows as the samples they are: in a masked-LM run (:func:`masked_lm_run`) the original tokens,
    taken from the labels where they are set (one ``where`` on the device, no host read); otherwise the rows as given."""
    tokens = batch[key]
    labels = batch.get("labels") if masked_lm and key == "input_ids" else None
    if torch.is_tensor(labels) and labels.shape == tokens.shape:
        return torch.where(labels == MASKED_LABEL, tokens, labels)
    return tokens


def batch_row_hashes(batch: Any, key: str = "input_ids", mask_key: str = "attention_mask", masked_lm: bool = False) -> torch.Tensor:
    """``device_row_hashes`` of a batch's samples (:func:`sample_tokens`) as the ledger holds them, the mask honoured
    where it has their shape: a sample hashes alike in every epoch and on a resume."""
    mask = batch.get(mask_key)
    return device_row_hashes(sample_tokens(batch, key, masked_lm), mask if torch.is_tensor(mask) else None)


def host_row_hashes(ids: torch.Tensor, mask: torch.Tensor | None = None) -> list[int]:
    """``device_row_hashes`` of host tensors, read: the same sums in numpy (int64 wraps alike). For indexing datasets, a
    tight loop where it is 4x faster; not for one batch a step, where torch's warm dispatch beats numpy's cold one."""
    if ids.dim() == 1:
        ids = ids.unsqueeze(0)
    values = ids.numpy().astype(np.int64)  # a copy: the products below go in place
    values += 1
    if mask is not None and mask.shape == ids.shape:
        values *= mask.numpy().astype(np.int64, copy=False)  # a float mask too, as device_row_hashes takes it
    values *= _position_weights(ids.device, ids.shape[1]).numpy()
    return values.sum(axis=1).tolist()


def combine_row_hashes(hashes: list[int]) -> int:
    """One order-sensitive 64-bit hash of a batch from its row hashes (read to the host once per step anyway)."""
    if len(_host_list) <= len(hashes):
        _host_weights(len(hashes) + 1)  # grow the cached multipliers; then no copy of them (map stops at the end of hashes)
    return wrap64(sum(map(operator.mul, hashes, islice(_host_list, 1, None))))


def content_hashes(batch: Any, masked_lm: bool = False) -> list[str]:
    """``batch_row_hashes`` of a batch's ``input_ids`` as hex strings: the sample hashes of the ledger, captures and
    reports (one host read)."""
    return hex64_all(batch_row_hashes(batch, masked_lm=masked_lm).tolist())


def wrap64(value: int) -> int:
    """``value`` as a signed int64 (two's complement, wrapped): how the exchange and the ledger's sums carry it."""
    value &= 0xFFFF_FFFF_FFFF_FFFF
    return value - (1 << 64) if value >= 1 << 63 else value


def from_hex64(text: str) -> int:
    """The signed int64 a ``hex64`` string was made from."""
    return wrap64(int(text, 16))


def hex64(value: int) -> str:
    """An int64 hash as 16 hex digits (two's complement, so negative values print alike everywhere)."""
    return f"{value & 0xFFFF_FFFF_FFFF_FFFF:016x}"


def hex64_all(values: list[int]) -> list[str]:
    """``hex64`` of each value (one call per step's rows on the per-step path, not one per row)."""
    return [f"{value & 0xFFFF_FFFF_FFFF_FFFF:016x}" for value in values]


def dataset_rows(dataset: Any, key: str, indices: range | list[int]) -> list[list[int]] | None:
    """Token rows of a map-style dataset (None when it does not hold ``key``)."""
    try:
        if hasattr(dataset, "column_names") and hasattr(dataset, "select"):
            if key not in dataset.column_names:
                return None
            return [list(r) for r in dataset.select(indices)[key]]
        return [list(dataset[i][key]) for i in indices]
    except (KeyError, TypeError, IndexError):
        return None


def hash_token_rows(rows: list[list[int]]) -> list[int]:
    """``device_row_hashes`` of plain token lists (no padding counted): the same hash a batch row gets."""
    if not rows:
        return []
    width = max(len(r) for r in rows) or 1
    ids = np.zeros((len(rows), width), dtype=np.int64)
    mask = np.zeros((len(rows), width), dtype=np.int64)
    for i, row in enumerate(rows):
        ids[i, : len(row)] = row
        mask[i, : len(row)] = 1
    return host_row_hashes(torch.from_numpy(ids), torch.from_numpy(mask))


_LAST_DATASET: list[Any] = []  # (dataset, key, size, hashes) of the last call: data_hash and contamination share one pass


def dataset_hashes(dataset: Any, key: str, size: int, chunk: int = 1000) -> list[int] | None:
    """Content hashes of the first ``size`` rows of a map-style dataset, read ``chunk`` rows at a time (None without ``key``)."""
    if _LAST_DATASET and _LAST_DATASET[0] is dataset and _LAST_DATASET[1:3] == [key, size]:
        return _LAST_DATASET[3]
    if dataset_rows(dataset, key, range(min(1, size))) is None:
        return None
    hashes: list[int] = []
    for start in range(0, size, chunk):
        hashes += hash_token_rows(dataset_rows(dataset, key, range(start, min(size, start + chunk))) or [])
    _LAST_DATASET[:] = [dataset, key, size, hashes]
    return hashes
