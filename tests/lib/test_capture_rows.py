"""A captured row names its dataset index (from the tap) and its own id column apart, and says when no index is known."""
from __future__ import annotations

from pathlib import Path

import torch

from harness.lib.capture import DATASET_INDEX_KEY, DATASET_INDEX_NOTE_KEY, NOT_MODEL_INPUTS, CaptureResult, _samples, dataset_index_note


def _batch(**extra: object) -> dict[str, object]:
    ids = torch.arange(12).reshape(3, 4)
    return {"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": ids.clone(), **extra}


def test_rows_without_an_id_column_are_named_by_their_dataset_index() -> None:
    rows = _samples(_batch(**{DATASET_INDEX_KEY: [40, 7, 19]}), 0, None, None)
    assert [(r["sample_id"], r["sample_id_source"], r["dataset_index"]) for r in rows] == [
        (40, "dataset index", 40), (7, "dataset index", 7), (19, "dataset index", 19)]
    assert DATASET_INDEX_KEY in NOT_MODEL_INPUTS and DATASET_INDEX_NOTE_KEY in NOT_MODEL_INPUTS  # never fed to the model


def test_an_id_column_stays_the_sample_id_and_the_index_comes_beside_it() -> None:
    rows = _samples(_batch(idx=torch.tensor([5, 6, 7]), **{DATASET_INDEX_KEY: [1, 2, 3]}), 0, None, None)
    assert [(r["sample_id"], r["sample_id_source"], r["dataset_index"]) for r in rows] == [(5, "column", 1), (6, "column", 2), (7, "column", 3)]
    suspects = [{**{k: r[k] for k in ("micro_batch", "row", "sample_id", "sample_id_source", "dataset_index")}, "loss": 1.0, "repetition": 0.0}
                for r in rows]
    text = CaptureResult(Path("."), Path("x.json"), suspects).describe(top=1)
    assert text == "micro-batch 0 row 0 (sample id 5, dataset index 1, loss 1.000, repetition 0.00)"


def test_no_index_is_guessed_and_the_capture_says_why() -> None:
    assert [r["dataset_index"] for r in _samples(_batch(), 0, None, None)] == [None, None, None]
    assert [r["dataset_index"] for r in _samples(_batch(**{DATASET_INDEX_KEY: [1, 2]}), 0, None, None)] == [None] * 3  # a mismatch
    note = "the train dataset is an IterableDataset: its rows have no index"
    assert dataset_index_note([_batch(**{DATASET_INDEX_NOTE_KEY: note})]) == f"not known: {note}"
    assert dataset_index_note([_batch(**{DATASET_INDEX_KEY: [1, 2, 3]})]).startswith("the row's index into the Trainer's train_dataset")
    assert dataset_index_note([_batch()]).startswith("not known")
