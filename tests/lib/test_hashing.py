"""harness.lib.hashing: a sample's hash is its content's, whatever a masked-LM collator did to the batch."""
from __future__ import annotations

from types import SimpleNamespace

import torch

from harness.lib.hashing import MASKED_LABEL, batch_row_hashes, device_row_hashes, masked_lm_run


def test_a_masked_lm_batch_hashes_its_original_tokens_and_other_batches_their_input_ids() -> None:
    original = torch.tensor([[5, 6, 7, 8, 0], [9, 10, 11, 0, 0]])
    mask = (original != 0).long()
    masked = original.clone()
    masked[0, 1], masked[1, 0] = 3, 42  # [MASK] and a random token
    labels = torch.full_like(original, MASKED_LABEL)
    labels[0, 1], labels[1, 0] = 6, 9
    batch = {"input_ids": masked, "attention_mask": mask, "labels": labels}
    assert batch_row_hashes(batch, masked_lm=True).tolist() == device_row_hashes(original, mask).tolist()
    assert batch_row_hashes(batch).tolist() == device_row_hashes(masked, mask).tolist()  # not a masked-LM run
    seq2seq = {"input_ids": masked, "labels": torch.tensor([[1, 2]])}  # labels of another shape are not the inputs'
    assert batch_row_hashes(seq2seq, masked_lm=True).tolist() == device_row_hashes(masked).tolist()


def test_a_masked_lm_run_is_known_by_its_collator() -> None:
    """Collators that mask anew at every collation; not a model class (a dataset masked ahead hashes alike as it is)."""
    from transformers import DataCollatorForLanguageModeling, DataCollatorForPermutationLanguageModeling

    from harness.lib.tiny import corpus_lines, train_tokenizer

    tokenizer = train_tokenizer(corpus_lines()[:50], vocab_size=128)
    tokenizer.add_special_tokens({"mask_token": "<mask>"})
    assert masked_lm_run(SimpleNamespace(data_collator=DataCollatorForLanguageModeling(tokenizer, mlm=True)))
    assert not masked_lm_run(SimpleNamespace(data_collator=DataCollatorForLanguageModeling(tokenizer, mlm=False)))
    assert masked_lm_run(SimpleNamespace(data_collator=DataCollatorForPermutationLanguageModeling(tokenizer)))
    assert not masked_lm_run(SimpleNamespace(data_collator=None))
