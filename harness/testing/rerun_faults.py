"""Faults for the rerun verdict: a NaN that lives in the data, and one that lives in one rank's device.

``NanBatch``: a row made of one poison token makes the input embeddings
NaN wherever it goes through the model, in training, in a capture's
forward or in a recomputation on any rank: a fault any rerun reproduces
(``FAULT_REPRODUCED``). Checked on the device (no host read).

``RankNan``: every forward pass on one rank during one step yields NaN, the
rerun's too, while the same micro-batches on another rank are clean (a
broken device: ``FAULT_RANK_SUSPECT``).
"""
from __future__ import annotations

from typing import Any, Callable

import torch


class NanBatch:
    """A row of one poison token, repeated, gives NaN embeddings wherever it goes through the model (any rank, any rerun).

    ``mark`` writes the row into the batch (labels follow), as corrupt data
    would arrive; the hook knows it by its content alone (every token but the
    last the poison id: a run no real text has), so the fault travels with
    the data. The last token is a tag (``salt``: the step), so that rows
    marked at two steps are two samples, not one trained twice (data_hash
    would report the second as DATA_REPEATED).
    """

    def __init__(self, model: Any) -> None:
        embeddings = model.get_input_embeddings()
        self.token = int(embeddings.num_embeddings) - 1
        embeddings.register_forward_hook(self._forward)

    def mark(self, batch: dict[str, Any], row: int = 0, salt: int = 0) -> None:
        ids = batch.get("input_ids")
        if not (torch.is_tensor(ids) and ids.dim() == 2 and row < ids.shape[0] and ids.shape[1] >= 4):
            return
        ids[row].fill_(self.token)
        ids[row, -1] = salt % self.token  # never the poison id itself
        mask = batch.get("attention_mask")
        if torch.is_tensor(mask) and mask.shape == ids.shape:
            mask[row].fill_(1)  # the tag counts where a right-padded row would mask it out (a row hash skips masked positions)
        labels = batch.get("labels")
        if torch.is_tensor(labels) and labels.shape == ids.shape:
            labels[row].copy_(torch.where(labels[row] == -100, labels[row], ids[row]))

    def _forward(self, module: Any, inputs: Any, output: torch.Tensor) -> torch.Tensor | None:
        ids = inputs[0] if inputs else None
        if not torch.is_tensor(ids) or ids.dim() != 2 or ids.shape[1] < 4:
            return None
        hit = (ids[:, :-1] == self.token).all(dim=-1)  # device-side: no host read
        return torch.where(hit[:, None, None], torch.full_like(output, float("nan")), output)


class RankNan:
    """Every forward on ``rank`` while ``active()`` says so yields NaN (the recomputation's included)."""

    def __init__(self, model: Any, active: Callable[[], bool]) -> None:
        self.active = active
        model.get_input_embeddings().register_forward_hook(self._forward)

    def _forward(self, module: Any, inputs: Any, output: torch.Tensor) -> torch.Tensor | None:
        return output * float("nan") if self.active() else None
