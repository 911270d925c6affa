"""Document packing for causal-LM pretraining that keeps documents apart.

Packing fills every row with whole documents so no compute is spent on
padding, but naive packing lets a token attend to (and be predicted from) the
previous, unrelated document. Here nothing crosses a document boundary:

* attention: rows carry ``position_ids`` that restart at 0 at every document
  start and no ``attention_mask``. transformers (5.x) then builds a
  block-diagonal causal mask itself: ``masking_utils._preprocess_mask_arguments``
  calls ``find_packed_sequence_indices(position_ids)`` when
  ``position_ids is not None and attention_mask is None and cache is None``;
  a new sequence starts wherever ``position_ids[t] - position_ids[t-1] != 1``,
  and ``create_causal_mask`` ANDs the causal mask with "same sequence". Both
  the ``sdpa`` and ``eager`` mask builders honour it.
* loss: the first token of every document has label -100, so it is never
  predicted from the previous document's last token (HF shifts labels inside
  the loss: ``labels[i]`` is predicted from ``logits[i-1]``).
* padding: the padding tail is its own "document" (positions restart at 0),
  so real tokens never attend to padding, padding never attends to real
  tokens, and no query row is fully masked (which would give NaN in sdpa).

Caveat (the ``cache is None`` part of the condition): LlamaConfig defaults to
``use_cache=True`` and the model then creates a DynamicCache even in training
mode, which silently disables the packed mask. ``transformers.Trainer`` sets
``model.config.use_cache = args.use_cache`` (False by default); anything else
that runs a model on packed rows must call :func:`prepare_model_for_packing`
or pass ``use_cache=False``. Likewise an ``attention_mask`` (even all ones)
disables it: batch packed rows with :func:`packed_data_collator`.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import Any

from datasets import Dataset

from .data import DataError

__all__ = [
    "IGNORE_INDEX",
    "PACKED_ATTN_IMPLEMENTATIONS",
    "PACKING_ATTN_IMPLEMENTATION",
    "pack_token_lists",
    "packed_data_collator",
    "packed_lm_dataset",
    "prepare_model_for_packing",
]

IGNORE_INDEX = -100
# The attention implementation the runner selects on CPU for packed
# pretraining; verified by tests/stages/test_packing.py (sdpa and eager both
# honour the mask built from restarting position ids).
PACKING_ATTN_IMPLEMENTATION = "sdpa"
PACKED_ATTN_IMPLEMENTATIONS = ("sdpa", "eager")

Columns = dict[str, list[list[int]]]


def _chunks(tokens: list[int], seq_len: int) -> Iterator[list[int]]:
    """A document longer than a row becomes several row-sized documents."""
    for start in range(0, len(tokens), seq_len):
        yield tokens[start : start + seq_len]


def _rows(token_lists: Iterable[list[int]], seq_len: int) -> Iterator[list[list[int]]]:
    """Greedy, order-preserving: documents go into the current row until the next one does not fit."""
    row: list[list[int]] = []
    used = 0
    for tokens in token_lists:
        for chunk in _chunks(list(tokens), seq_len):
            if used + len(chunk) > seq_len:
                yield row
                row, used = [], 0
            row.append(chunk)
            used += len(chunk)
    if row:
        yield row


def _render_row(docs: list[list[int]], seq_len: int, pad_id: int) -> dict[str, list[int]]:
    """Flatten one row's documents into the four per-token columns, padding the tail as its own document."""
    out: dict[str, list[int]] = {"input_ids": [], "position_ids": [], "labels": [], "doc_ids": []}
    for doc_id, doc in enumerate(docs):
        out["input_ids"] += doc
        out["position_ids"] += list(range(len(doc)))
        out["labels"] += [IGNORE_INDEX, *doc[1:]]
        out["doc_ids"] += [doc_id] * len(doc)
    pad = seq_len - len(out["input_ids"])
    out["input_ids"] += [pad_id] * pad
    out["position_ids"] += list(range(pad))
    out["labels"] += [IGNORE_INDEX] * pad
    out["doc_ids"] += [-1] * pad
    return out


def pack_token_lists(token_lists: Iterable[list[int]], seq_len: int, pad_id: int) -> Columns:
    """Pack tokenised documents into rows of exactly ``seq_len`` tokens.

    Returns columns ``input_ids``, ``position_ids`` (restart at 0 per document
    and for the padding tail), ``labels`` (-100 on each document's first token
    and on padding) and ``doc_ids`` (document index within the row, -1 for
    padding). Empty documents are skipped.
    """
    if seq_len < 2:
        raise DataError(f"packing seq_len must be at least 2 (got {seq_len}): a 1-token row has nothing to predict.")
    columns: Columns = {"input_ids": [], "position_ids": [], "labels": [], "doc_ids": []}
    for docs in _rows((t for t in token_lists if len(t) > 0), seq_len):
        for key, values in _render_row(docs, seq_len, pad_id).items():
            columns[key].append(values)
    return columns


def _pad_id(tokenizer: Any) -> int:
    """Padding id; tokenizers without a pad token pad with eos (masked out of loss and attention anyway)."""
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    if pad is None:
        raise DataError("the tokenizer has neither a pad nor an eos token. Fix: set tokenizer.pad_token.")
    return int(pad)


def _tokenize_batch(batch: dict[str, list[Any]], tokenizer: Any, text_field: str, add_eos: bool) -> Columns:
    """Token ids per document (with the tokenizer's own special tokens, e.g. a BOS), eos appended once."""
    texts = [t for t in batch[text_field] if isinstance(t, str) and t.strip()]
    ids = tokenizer(texts, add_special_tokens=True)["input_ids"] if texts else []
    eos = tokenizer.eos_token_id
    if add_eos and eos is not None:
        ids = [row if row and row[-1] == eos else [*row, eos] for row in ids]
    return {"input_ids": [list(row) for row in ids]}


def packed_lm_dataset(
    dataset: Dataset,
    tokenizer: Any,
    text_field: str = "text",
    seq_len: int = 128,
    add_eos: bool = True,
    keep_doc_ids: bool = False,
    batch_size: int = 1000,
) -> Dataset:
    """Tokenise ``dataset[text_field]`` and pack it into rows for causal-LM training.

    Returns ``input_ids``/``position_ids``/``labels`` (plus ``doc_ids`` when
    ``keep_doc_ids``) and deliberately no ``attention_mask``: its presence
    would switch off transformers' packed-sequence mask. Train with
    :func:`packed_data_collator`: ``Trainer(processing_class=tokenizer)``
    otherwise defaults to DataCollatorWithPadding, which adds an all-ones
    attention_mask, and DataCollatorForLanguageModeling also rebuilds labels.
    Packing runs per ``batch_size`` documents, so each batch's last row may be
    padded.
    """
    if text_field not in dataset.column_names:
        raise DataError(
            f"packing needs field '{text_field}' but the dataset has {dataset.column_names}. "
            "Fix: set text_field to the field that holds the text."
        )
    pad_id = _pad_id(tokenizer)
    tokenized = dataset.map(
        _tokenize_batch,
        batched=True,
        batch_size=batch_size,
        fn_kwargs={"tokenizer": tokenizer, "text_field": text_field, "add_eos": add_eos},
        remove_columns=dataset.column_names,
        keep_in_memory=True,
        desc="tokenize",
    )
    packed = tokenized.map(
        lambda batch: pack_token_lists(batch["input_ids"], seq_len, pad_id),
        batched=True,
        batch_size=batch_size,
        remove_columns=tokenized.column_names,
        keep_in_memory=True,
        desc="pack",
    )
    if len(packed) == 0:
        raise DataError(f"packing produced no rows: field '{text_field}' holds no non-empty text. Fix: check the data.")
    return packed if keep_doc_ids else packed.remove_columns("doc_ids")


def packed_data_collator(features: list[dict[str, Any]]) -> dict[str, Any]:
    """Stack packed rows into tensors, without ``attention_mask`` (whose presence disables the packed mask)."""
    from transformers import default_data_collator

    keep = ("input_ids", "position_ids", "labels")
    return default_data_collator([{k: f[k] for k in keep if k in f} for f in features])


def prepare_model_for_packing(model: Any) -> Any:
    """Make ``model`` apply the packed-sequence mask: check the attention implementation, turn off the KV cache.

    A KV cache (``config.use_cache=True``, the Llama default) makes transformers
    skip packed-sequence detection, so documents would attend to each other.
    """
    impl = getattr(model.config, "_attn_implementation", None)
    if impl not in PACKED_ATTN_IMPLEMENTATIONS:
        raise DataError(
            f"packed pretraining needs attn_implementation in {PACKED_ATTN_IMPLEMENTATIONS}, the model uses '{impl}'. "
            f"Fix: load the model with attn_implementation='{PACKING_ATTN_IMPLEMENTATION}'."
        )
    model.config.use_cache = False
    return model
