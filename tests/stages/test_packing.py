"""stages/packing.py: packed rows keep documents apart, in attention and in the loss, on a real tiny Llama.

The key tests perturb one document and check another document's logits do not move; the negative controls
show the same check fails when the packing information is missing, so the key tests can fail.
"""
from __future__ import annotations

from typing import Any

import pytest
import torch
from datasets import Dataset

from harness.stages.data import DataError
from harness.stages.packing import (
    IGNORE_INDEX,
    PACKED_ATTN_IMPLEMENTATIONS,
    PACKING_ATTN_IMPLEMENTATION,
    pack_token_lists,
    packed_data_collator,
    packed_lm_dataset,
    prepare_model_for_packing,
)
from harness.lib.tiny import build_tiny_llama

SEQ_LEN = 32
PAD = 0
DOC_A = list(range(10, 23))  # 13 tokens
DOC_B = list(range(40, 49))  # 9 tokens -> 10 tokens of padding


# --------------------------------------------------------------------------- pack_token_lists


def test_rows_have_exact_length_and_restart_positions() -> None:
    packed = pack_token_lists([[1, 2, 3], [4, 5], [6, 7, 8, 9]], seq_len=6, pad_id=0)
    assert packed["input_ids"] == [[1, 2, 3, 4, 5, 0], [6, 7, 8, 9, 0, 0]]
    assert packed["position_ids"] == [[0, 1, 2, 0, 1, 0], [0, 1, 2, 3, 0, 1]]
    assert packed["labels"] == [[-100, 2, 3, -100, 5, -100], [-100, 7, 8, 9, -100, -100]]
    assert packed["doc_ids"] == [[0, 0, 0, 1, 1, -1], [0, 0, 0, 0, -1, -1]]
    assert "attention_mask" not in packed


def test_long_document_is_split_and_each_chunk_restarts() -> None:
    packed = pack_token_lists([list(range(1, 12)), [50, 51]], seq_len=4, pad_id=0)
    assert packed["input_ids"] == [[1, 2, 3, 4], [5, 6, 7, 8], [9, 10, 11, 0], [50, 51, 0, 0]]
    assert packed["position_ids"] == [[0, 1, 2, 3], [0, 1, 2, 3], [0, 1, 2, 0], [0, 1, 0, 1]]
    assert [row[0] for row in packed["labels"]] == [IGNORE_INDEX] * 4
    assert packed["labels"][1] == [-100, 6, 7, 8]


def test_exact_fit_has_no_padding_and_empty_documents_are_skipped() -> None:
    packed = pack_token_lists([[1, 2], [], [3, 4]], seq_len=4, pad_id=9)
    assert packed["input_ids"] == [[1, 2, 3, 4]] and packed["doc_ids"] == [[0, 0, 1, 1]]
    assert pack_token_lists([], seq_len=4, pad_id=0)["input_ids"] == []
    with pytest.raises(DataError, match="seq_len must be at least 2"):
        pack_token_lists([[1]], seq_len=1, pad_id=0)


def test_packed_lm_dataset(tokenizer: Any) -> None:
    texts = ["The cat sat on the mat.", "", "A second, slightly longer document about dogs and parks.", "Third."]
    packed = packed_lm_dataset(Dataset.from_dict({"body": texts}), tokenizer, "body", seq_len=24, keep_doc_ids=True)
    assert set(packed.column_names) == {"input_ids", "position_ids", "labels", "doc_ids"}
    assert all(len(row) == 24 for row in packed["input_ids"])
    docs: list[list[int]] = []
    for ids, doc_ids in zip(packed["input_ids"], packed["doc_ids"]):
        for d in sorted(set(doc_ids) - {-1}):
            docs.append([t for t, k in zip(ids, doc_ids) if k == d])
    expected = [tokenizer(t)["input_ids"] + [tokenizer.eos_token_id] for t in texts if t]
    flat = [t for doc in expected for t in doc]
    assert [t for doc in docs for t in doc] == flat  # order kept, nothing lost, eos once per document
    assert all(doc[-1] == tokenizer.eos_token_id or len(doc) == 24 for doc in docs)
    plain = packed_lm_dataset(Dataset.from_dict({"text": texts}), tokenizer, seq_len=24)
    assert set(plain.column_names) == {"input_ids", "position_ids", "labels"}
    with pytest.raises(DataError, match="needs field 'txt'"):
        packed_lm_dataset(Dataset.from_dict({"text": texts}), tokenizer, "txt")


# --------------------------------------------------------------------------- the model sees separate documents


def packed_row() -> dict[str, torch.Tensor]:
    packed = pack_token_lists([DOC_A, DOC_B], SEQ_LEN, PAD)
    assert len(packed["input_ids"]) == 1 and packed["doc_ids"][0].count(-1) == 10
    return {k: torch.tensor(v[0]) for k, v in packed.items()}


def model_for(tokenizer: Any, impl: str, prepare: bool = True) -> Any:
    model = build_tiny_llama(tokenizer, seed=0, attn_implementation=impl).eval()
    return prepare_model_for_packing(model) if prepare else model


@torch.no_grad()
def logits(model: Any, input_ids: torch.Tensor, position_ids: torch.Tensor) -> torch.Tensor:
    return model(input_ids=input_ids, position_ids=position_ids).logits[0]


def perturb_a(input_ids: torch.Tensor, doc_ids: torch.Tensor) -> torch.Tensor:
    changed = input_ids.clone()
    where = (doc_ids == 0).nonzero().flatten()[1:8]  # several tokens of A, including ones B would see
    changed[0, where] = (changed[0, where] + 37) % 200 + 10
    assert not torch.equal(changed, input_ids)
    return changed


@pytest.mark.parametrize("impl", PACKED_ATTN_IMPLEMENTATIONS)
def test_perturbing_document_a_leaves_document_b_and_padding_unchanged(tokenizer: Any, impl: str) -> None:
    row = packed_row()
    ids, pos, doc = row["input_ids"][None], row["position_ids"][None], row["doc_ids"]
    model = model_for(tokenizer, impl)
    before = logits(model, ids, pos)
    after = logits(model, perturb_a(ids, doc[None]), pos)
    a, b, pad = doc == 0, doc == 1, doc == -1
    assert not torch.allclose(before[a], after[a], atol=1e-3)
    assert torch.allclose(before[b], after[b], atol=1e-5)
    assert torch.allclose(before[pad], after[pad], atol=1e-5)
    # B in the packed row sees exactly what B alone sees
    alone = logits(model, torch.tensor([DOC_B]), torch.arange(len(DOC_B))[None])
    assert torch.allclose(before[b], alone, atol=1e-5)
    # and real tokens never see padding
    repadded = logits(model, torch.where(doc == -1, 5, ids[0])[None], pos)
    assert torch.allclose(before[~pad], repadded[~pad], atol=1e-5)


def test_packing_attn_implementation_is_one_that_honours_the_packed_mask() -> None:
    assert PACKING_ATTN_IMPLEMENTATION in PACKED_ATTN_IMPLEMENTATIONS


@pytest.mark.parametrize("impl", PACKED_ATTN_IMPLEMENTATIONS)
def test_negative_control_plain_positions_leak_across_documents(tokenizer: Any, impl: str) -> None:
    """Without restarting position ids the model has no packing information: B's logits move with A."""
    row = packed_row()
    ids, doc = row["input_ids"][None], row["doc_ids"]
    plain = torch.arange(SEQ_LEN)[None]
    model = model_for(tokenizer, impl)
    before, after = logits(model, ids, plain), logits(model, perturb_a(ids, doc[None]), plain)
    assert not torch.allclose(before[doc == 1], after[doc == 1], atol=1e-3)


def test_negative_control_kv_cache_disables_packed_mask(tokenizer: Any) -> None:
    """Why prepare_model_for_packing exists: with config.use_cache=True (the Llama default) transformers creates a
    cache in forward and skips packed-sequence detection, even in train mode. If this starts failing, a newer
    transformers detects packing with a cache too and the use_cache workaround is no longer needed."""
    row = packed_row()
    ids, pos, doc = row["input_ids"][None], row["position_ids"][None], row["doc_ids"]
    model = model_for(tokenizer, PACKING_ATTN_IMPLEMENTATION, prepare=False).train()
    assert model.config.use_cache is True
    before, after = logits(model, ids, pos), logits(model, perturb_a(ids, doc[None]), pos)
    assert not torch.allclose(before[doc == 1], after[doc == 1], atol=1e-3)


def test_prepare_model_for_packing_rejects_other_attention(tokenizer: Any) -> None:
    model = build_tiny_llama(tokenizer, seed=0, attn_implementation="sdpa")
    model.config._attn_implementation = "flash_attention_2"  # no flash kernels on CPU: just the check
    with pytest.raises(DataError, match="attn_implementation='sdpa'"):
        prepare_model_for_packing(model)


@pytest.mark.parametrize("impl", PACKED_ATTN_IMPLEMENTATIONS)
def test_packed_loss_equals_per_document_losses(tokenizer: Any, impl: str) -> None:
    """Neither attention nor loss crosses documents: the packed loss is the token-weighted mean of the losses
    of each document run alone (the documents have different lengths, so a leak or a miscount would show)."""
    docs = [DOC_A, DOC_B, list(range(60, 66))]
    packed = pack_token_lists(docs, seq_len=40, pad_id=PAD)
    batch = packed_data_collator([{k: v[0] for k, v in packed.items()} | {"attention_mask": [1] * 40}])
    assert set(batch) == {"input_ids", "position_ids", "labels"}  # a mask, even all ones, would disable packing
    model = model_for(tokenizer, impl)
    with torch.no_grad():
        packed_loss = model(**batch).loss
        summed = sum(model(input_ids=torch.tensor([d]), labels=torch.tensor([d])).loss * (len(d) - 1) for d in docs)
        # the check can fail: same labels, but plain positions let attention cross documents
        leaky = model(input_ids=batch["input_ids"], position_ids=torch.arange(40)[None], labels=batch["labels"]).loss
    expected = summed / sum(len(d) - 1 for d in docs)
    assert torch.allclose(packed_loss, expected, atol=1e-4), (packed_loss, expected)
    assert not torch.allclose(leaky, expected, atol=1e-3)


def test_negative_control_attention_mask_disables_packed_mask(tokenizer: Any) -> None:
    """Why packed_data_collator drops attention_mask: an all-ones mask (what DataCollatorWithPadding adds)
    makes transformers skip packed-sequence detection, so B's logits move with A again."""
    row = packed_row()
    ids, pos, doc = row["input_ids"][None], row["position_ids"][None], row["doc_ids"]
    model = model_for(tokenizer, PACKING_ATTN_IMPLEMENTATION)
    ones = torch.ones_like(ids)
    with torch.no_grad():
        before = model(input_ids=ids, position_ids=pos, attention_mask=ones).logits[0]
        after = model(input_ids=perturb_a(ids, doc[None]), position_ids=pos, attention_mask=ones).logits[0]
    assert not torch.allclose(before[doc == 1], after[doc == 1], atol=1e-3)
