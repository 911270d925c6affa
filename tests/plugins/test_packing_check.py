"""packing_check: the verdict comes from perturbing one document of a real packed row, for every mask form.

Measured on CPU with transformers 5.x and the Trainer (which turns the KV cache off): restarting position_ids alone
keep documents apart under both sdpa and eager (transformers builds the block-diagonal mask from them); a 4D boolean
block-diagonal mask keeps them apart under sdpa; eager adds that boolean mask to the scores instead of masking, so
documents leak; an all-ones 2D attention_mask (what padding collators add) switches the packed mask off and leaks
under both. The plugin knows none of this: each verdict below is its measurement.
"""
from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import pytest
from datasets import Dataset

import harness
from conftest import EXAMPLE, findings_of, read_jsonl, wrapped_example, write_yaml
from harness.stages.packing import packed_lm_dataset
from harness.lib.tiny import build_tiny_llama, corpus_lines

sys.path.insert(0, str(EXAMPLE.parent))
from train_trainer import PackedCollator  # noqa: E402  (the example script's collator: the same batches as under wrap)

CASES = [  # (attn_implementation, mask form, documents leak?)
    ("sdpa", "position_ids", False),
    ("eager", "position_ids", False),
    ("sdpa", "mask4d", False),
    ("eager", "mask4d", True),
]


@pytest.fixture(scope="module")
def packed_rows(tokenizer: Any) -> Dataset:
    texts = [s.strip() + "." for line in corpus_lines()[:60] for s in line.split(".") if len(s.strip()) > 20]
    return packed_lm_dataset(Dataset.from_dict({"text": texts}), tokenizer, seq_len=64, keep_doc_ids=True)


def _train(make_trainer: Any, tokenizer: Any, rows: Dataset, impl: str, collator: Any, steps: int = 1, **config: Any) -> Path:
    model = build_tiny_llama(tokenizer, seed=0, attn_implementation=impl)
    trainer = make_trainer(model=model, train_dataset=rows, data_collator=collator, max_steps=steps, remove_unused_columns=False)
    harness.attach(trainer, config={"packing_check": config} if config else None)
    trainer.train()
    return Path(trainer.args.output_dir)


def _verdicts(out: Path) -> list[dict[str, Any]]:
    return read_jsonl(out / "harness" / "packing_check.jsonl")


def _assert_verdict(out: Path, impl: str, leaks: bool) -> None:
    (result,) = _verdicts(out)
    assert result["attn_implementation"] == impl and result["boundaries"] == "position_ids" and result["documents"] >= 2
    assert result["perturbed_document_change"] > 0.01  # the experiment moved the perturbed document itself
    assert result["verdict"] == ("leak" if leaks else "separate"), result
    found = findings_of(out, "PACKING_CROSS_DOC_ATTENTION")
    if leaks:
        (finding,) = found
        assert finding["step"] == 1 and finding["severity"] == "error" and finding["evidence"]["leak"] > 0.01
        assert impl in finding["message"] and finding["evidence"]["mask_form"] in finding["message"]
    else:
        assert found == [] and result["leak"] == 0.0


@pytest.mark.parametrize("impl,form,leaks", CASES)
def test_mask_cases_through_attach(make_trainer: Any, tokenizer: Any, packed_rows: Dataset, impl: str, form: str, leaks: bool) -> None:
    out = _train(make_trainer, tokenizer, packed_rows, impl, PackedCollator(form))
    _assert_verdict(out, impl, leaks)
    assert findings_of(out, "PACKING_LOSS_ON_PADDING") == []


@pytest.mark.slow  # a long end-to-end run (subprocesses or hundreds of steps): CI runs it, the quick subset does not
def test_mask_cases_through_wrap(tmp_path: Path) -> None:
    """The four cases as four unmodified script runs under `harness wrap` (two at a time: they are independent)."""
    from concurrent.futures import ThreadPoolExecutor

    config = write_yaml(tmp_path / "h.yaml", {})

    def run(case: tuple[str, str, bool]) -> Any:
        impl, form, _ = case
        return wrapped_example(tmp_path / f"{impl}-{form}", config, "--packing", form, "--attn_implementation", impl, steps=1, save_steps=0)

    with ThreadPoolExecutor(max_workers=2) as pool:
        results = list(pool.map(run, CASES))
    for (impl, form, leaks), result in zip(CASES, results):
        assert result.returncode == 0, result.stderr[-3000:]
        _assert_verdict(tmp_path / f"{impl}-{form}", impl, leaks)


def test_all_ones_attention_mask_disables_the_packed_mask(make_trainer: Any, tokenizer: Any, packed_rows: Dataset) -> None:
    out = _train(make_trainer, tokenizer, packed_rows, "sdpa", PackedCollator("mask2d"))
    _assert_verdict(out, "sdpa", leaks=True)


def test_a_leak_is_measured_again_every_n_steps_and_reported_once(make_trainer: Any, tokenizer: Any, packed_rows: Dataset) -> None:
    out = _train(make_trainer, tokenizer, packed_rows, "eager", PackedCollator("mask4d"), steps=4, every=2)
    assert [r["step"] for r in _verdicts(out)] == [1, 2, 4] and all(r["verdict"] == "leak" for r in _verdicts(out))
    assert len(findings_of(out, "PACKING_CROSS_DOC_ATTENTION")) == 1


class NaiveLabels(PackedCollator):
    """A collator that sets labels = input_ids: loss on padding and on every document's first token."""

    def __call__(self, features: list[dict[str, Any]]) -> dict[str, Any]:
        batch = super().__call__(features)
        batch["labels"] = batch["input_ids"].clone()
        return batch


def test_labels_on_padding_and_across_boundaries(make_trainer: Any, tokenizer: Any, packed_rows: Dataset) -> None:
    out = _train(make_trainer, tokenizer, packed_rows, "sdpa", NaiveLabels("position_ids"))
    (finding,) = findings_of(out, "PACKING_LOSS_ON_PADDING")
    assert finding["step"] == 1 and finding["evidence"]["boundary_labels"] > 0 and finding["evidence"]["labelled_padding"] > 0
    assert all(position > 0 for _, position in finding["evidence"]["examples"])  # a row's first token starts no boundary


def test_concatenated_documents_are_checked_only_when_boundaries_are_declared(make_trainer: Any, lm_rows: Any) -> None:
    """Rows of EOS-separated text with plain positions claim no separation (GPT-style): not checked by default;
    with ``boundaries: eos`` (a model that builds its own document mask from EOS) the leak is measured and reported."""
    trainer = make_trainer(max_steps=1)
    harness.attach(trainer)
    trainer.train()
    out = Path(trainer.args.output_dir)
    assert not (out / "harness" / "packing_check.jsonl").exists() and findings_of(out, "PACKING_CROSS_DOC_ATTENTION") == []
    declared = make_trainer(output_dir=out.parent / "declared", max_steps=1)
    harness.attach(declared, config={"packing_check": {"boundaries": "eos"}})
    declared.train()
    (result,) = _verdicts(out.parent / "declared")
    assert result["boundaries"] == "eos" and result["verdict"] == "leak" and result["mask_form"] == "2D attention_mask"
    (finding,) = findings_of(out.parent / "declared", "PACKING_CROSS_DOC_ATTENTION")
    assert finding["severity"] == "error"


class MaskOnly(PackedCollator):
    """A 4D block-diagonal mask and no position_ids: the boundaries are the mask's own blocks."""

    def __call__(self, features: list[dict[str, Any]]) -> dict[str, Any]:
        batch = super().__call__(features)
        del batch["position_ids"]
        return batch


@pytest.mark.parametrize("impl,leaks", [("sdpa", False), ("eager", True)])
def test_boundaries_from_the_blocks_of_a_4d_mask(make_trainer: Any, tokenizer: Any, packed_rows: Dataset, impl: str, leaks: bool) -> None:
    out = _train(make_trainer, tokenizer, packed_rows, impl, MaskOnly("mask4d"))
    (result,) = _verdicts(out)
    assert result["boundaries"] == "4D mask" and result["mask_form"] == "4D boolean mask" and result["documents"] >= 2
    assert result["verdict"] == ("leak" if leaks else "separate")
