"""The eval examples the contamination plugin watches for: the configured eval sets and the Trainer's eval_dataset."""
from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np

from harness.lib.documents import ScanError, iter_documents
from harness.lib.hashing import dataset_rows
from harness.lib.ngrams import EvalExample
from harness.lib.overlap import FrontEnd

from .options import EvalSet


def configured_examples(spec: EvalSet, front: FrontEnd | None) -> list[EvalExample]:
    """One configured eval set, tokenised with the run's tokenizer; ScanError naming the file and the fix if unusable."""
    if front is None:
        raise ScanError(f"the run has no tokenizer (processing_class) to tokenise {spec.path}. Fix: pass processing_class to the Trainer.")
    name = spec.name or Path(spec.path).stem
    found = [EvalExample(name, i, text, front.eval_variants(text)) for i, text in iter_documents(spec.path, spec.field, spec.id_field)]
    if not found:
        raise ScanError(f"the eval set {spec.path} has no example with text in field '{spec.field}'. Fix: check the file and 'field'.")
    return found


def trainer_eval_examples(dataset: Any) -> list[EvalExample]:
    """The Trainer's eval rows as token-id examples (padding excluded when an attention mask says where it is)."""
    if not hasattr(dataset, "__len__") or len(dataset) > 200_000:
        return []
    rows = dataset_rows(dataset, "input_ids", range(len(dataset)))
    masks = dataset_rows(dataset, "attention_mask", range(len(dataset)))
    if rows is None:
        return []
    out = []
    for i, row in enumerate(rows):
        if masks is not None:
            row = [t for t, m in zip(row, masks[i]) if m]
        out.append(EvalExample("eval_dataset", str(i), None, [np.asarray(row, dtype=np.int64)]))
    return out
