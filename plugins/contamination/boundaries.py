"""Where lines and documents meet inside a row of token ids: after a token that ends in a line break, around special tokens.

``run_clm.py`` keeps each line's break (``keep_linebreaks``) and joins the
lines; packing joins documents with EOS/BOS. Those tokens tell where one
line or document ends inside an eval row, so that n-grams across the seam
are not counted against a copied line (:mod:`harness.lib.copied_spans`).
A row joined with no marker at all has no boundaries: its n-grams all count.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np


@dataclass(frozen=True)
class BoundaryTokens:
    """Token ids after which a line or document ends (``after``) and ids with a seam on both sides (``around``):
    special tokens, and tokens whose text holds a line break before its end."""

    after: np.ndarray
    around: np.ndarray

    @classmethod
    def of(cls, tokenizer: Any, ids: np.ndarray) -> "BoundaryTokens":
        """The boundary tokens among ``ids`` (the distinct ids of the rows to cut: no walk over the whole vocabulary)."""
        distinct = np.unique(np.asarray(ids, dtype=np.int64))
        special = {int(i) for i in (getattr(tokenizer, "all_special_ids", None) or [])}
        after: list[int] = []
        around: list[int] = []
        plain = [i for i in distinct.tolist() if i not in special]
        around += [i for i in distinct.tolist() if i in special]
        try:
            texts = tokenizer.batch_decode([[i] for i in plain]) if plain else []
        except Exception:  # noqa: BLE001 - a tokenizer that cannot decode single ids: special tokens only
            texts = []
        for i, text in zip(plain, texts):
            if "\n" in text:
                (after if text.endswith("\n") else around).append(i)
        return cls(np.asarray(sorted(after), dtype=np.int64), np.asarray(sorted(around), dtype=np.int64))

    def gaps(self, row: np.ndarray) -> np.ndarray:
        """Sorted gap positions inside ``row`` (gap g lies between token g - 1 and token g; 0 and len(row) excluded)."""
        row = np.asarray(row)
        ends = np.flatnonzero(np.isin(row, self.after)) + 1 if len(self.after) else np.empty(0, dtype=np.int64)
        seams = np.flatnonzero(np.isin(row, self.around)) if len(self.around) else np.empty(0, dtype=np.int64)
        gaps = np.union1d(ends, np.union1d(seams, seams + 1)).astype(np.int64)
        return gaps[(gaps > 0) & (gaps < len(row))]
