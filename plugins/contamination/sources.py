"""The eval examples the contamination plugin watches for: the configured eval sets and the Trainer's eval_dataset."""
from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np

from harness.lib.documents import MissingFieldError, ScanError, iter_documents, unique_names
from harness.lib.hashing import dataset_rows
from harness.lib.ngrams import EvalExample
from harness.lib.overlap import FrontEnd

from .boundaries import BoundaryTokens
from .options import EvalSet


def eval_set_names(specs: list[EvalSet]) -> list[str]:
    """Each configured eval set's name: ``name``, else the file's stem, made distinct when two share one (-2, -3 ...)."""
    return unique_names([spec.name or Path(spec.path).stem for spec in specs])


def configured_examples(spec: EvalSet, front: FrontEnd | None, name: str, index: int = 0) -> list[EvalExample]:
    """One configured eval set (``contamination.eval_sets[index]``), tokenised with the run's tokenizer; ScanError naming
    the file and the fix if unusable."""
    if front is None:
        raise ScanError(f"the run has no tokenizer (processing_class) to tokenise {spec.path}. Fix: pass processing_class to the Trainer.")
    key = f"contamination.eval_sets[{index}].field"
    try:
        found = [EvalExample(name, i, text, front.eval_variants(text)) for i, text in iter_documents(spec.path, spec.field, spec.id_field)]
    except MissingFieldError as exc:
        raise exc.with_fix(f"set {key} in the harness config to the name of the text field") from None
    if not found:
        raise ScanError(f"the eval set {spec.path} has no example with text in field '{spec.field}'. Fix: check the file and {key}.")
    return found


def trainer_eval_examples(dataset: Any, tokenizer: Any = None) -> list[EvalExample]:
    """The Trainer's eval rows as token-id examples (padding excluded when an attention mask says where it is).

    With the run's tokenizer each row also knows where the lines or documents it joins meet (after a token ending in
    a line break, around special tokens: ``.boundaries``), so a ``run_clm``-style block is judged on
    the n-grams inside its lines (``harness.lib.copied_spans``).
    """
    if not hasattr(dataset, "__len__") or len(dataset) > 200_000:
        return []
    rows = dataset_rows(dataset, "input_ids", range(len(dataset)))
    masks = dataset_rows(dataset, "attention_mask", range(len(dataset)))
    if rows is None:
        return []
    arrays = []
    for i, row in enumerate(rows):
        if masks is not None:
            row = [t for t, m in zip(row, masks[i]) if m]
        arrays.append(np.asarray(row, dtype=np.int64))
    seams = BoundaryTokens.of(tokenizer, np.concatenate(arrays)) if tokenizer is not None and arrays else None
    return [EvalExample("eval_dataset", str(i), None, [row], [seams.gaps(row)] if seams is not None else None)
            for i, row in enumerate(arrays)]
