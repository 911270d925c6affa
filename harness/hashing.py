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
