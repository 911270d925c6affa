"""What a captured row is: its ids (the batch's own id column, the dataset index the tap took from the sampler) and text signals.

Kept free of torch, so that the tap can name the batch keys without loading
the capture machinery.
"""
from __future__ import annotations

from collections.abc import Mapping
from typing import Any

SAMPLE_ID_KEYS = ("sample_id", "sample_ids", "idx", "id", "index")
# The tap adds these to the copy of a batch that on_loss sees (never to the Trainer's inputs): the row's index into
# trainer.train_dataset, from the batch sampler (harness.hf.dataset_index), or why it is not known.
DATASET_INDEX_KEY = "harness_dataset_index"
DATASET_INDEX_NOTE_KEY = "harness_dataset_index_note"
# The ``num_items_in_batch`` the Trainer passed to compute_loss (the step's label-token count, a device tensor), kept
# in the same copy so that a recomputation of the micro-batch (harness.lib.recompute) normalises its loss alike.
NUM_ITEMS_KEY = "harness_num_items_in_batch"


def sample_ids(batch: Any) -> list[Any] | None:
    """The batch's own sample ids, when the collator kept a column for them."""
    if not isinstance(batch, Mapping):
        return None
    for key in SAMPLE_ID_KEYS:
        value = batch.get(key)
        if value is not None:
            return value.tolist() if hasattr(value, "tolist") else list(value)
    return None


def dataset_indices(batch: Any) -> list[int] | None:
    """Each row's index into the Trainer's train dataset, when the tap could take it from the batch sampler."""
    value = batch.get(DATASET_INDEX_KEY) if isinstance(batch, Mapping) else None
    return list(value) if value is not None else None


def dataset_index_note(batches: list[Mapping[str, Any]]) -> str:
    """What the captured rows' ``dataset_index`` means, or why there is none."""
    if any(dataset_indices(b) is not None for b in batches):
        return "the row's index into the Trainer's train_dataset, from the data loader's batch sampler"
    notes = [b.get(DATASET_INDEX_NOTE_KEY) for b in batches if isinstance(b, Mapping) and b.get(DATASET_INDEX_NOTE_KEY)]
    return f"not known: {notes[0]}" if notes else "not known: the batches did not come through the Trainer's train loader"


def text_heuristics(ids: list[int], text: str | None) -> dict[str, float]:
    """Cheap signs of a broken sample: repeated trigrams, few distinct tokens, unprintable or replaced characters."""
    trigrams = list(zip(ids, ids[1:], ids[2:]))
    chars = len(text) if text else 0
    printable_ws = "\n\t\r"
    return {
        "length_tokens": len(ids),
        "length_chars": chars,
        "repetition": 1.0 - len(set(trigrams)) / len(trigrams) if trigrams else 0.0,
        "distinct_tokens": len(set(ids)) / len(ids) if ids else 0.0,
        "nonprintable_ratio": sum(1 for c in text if not c.isprintable() and c not in printable_ws) / chars if chars else 0.0,
        "replacement_ratio": text.count("\ufffd") / chars if chars else 0.0,
    }
