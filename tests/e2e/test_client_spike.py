"""Issue 18, item 3, through ``harness wrap`` of an unmodified client script (``examples/run_clm.py``).

A single line of random characters (``examples/clm_data.py --poison_line``)
spreads over a few 64-token blocks of the grouped dataset. With this seed the
sampler first draws one of them at step 18, inside what used to be the
20-step warm-up grace, after the 10-step baseline window: it must be a
``LOSS_SPIKE`` there, and the capture must name the block's dataset index
(the dataset has no id column). Where the poisoned blocks are is computed
here, by tokenising and grouping like run_clm; when the sampler drew them is
read from ``data_hash``'s ledger by content hash, so neither side relies on
the indices under test. The same script on clean data is silent.
"""
from __future__ import annotations

import json
import subprocess
import sys
from itertools import chain
from pathlib import Path
from typing import Any

import pytest
import torch

from conftest import EXAMPLES, findings_of, harness_cli
from harness.lib.hashing import content_hashes
from harness.lib.ledger import read_ledger

BLOCK = 64
MIN_HISTORY = 10  # spike_capture's default baseline window
POISON_LINE = 64  # with seed 0 and batch size 2: no poisoned block in the first 17 steps, one at step 18
ENV = {"HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
SPIKE_CODES = {"LOSS_SPIKE", "GRAD_NORM_SPIKE", "LOSS_DIVERGENCE"}


def _data(out: Path, poison_line: int | None) -> Path:
    extra = ["--poison_line", str(poison_line)] if poison_line is not None else []
    subprocess.run([sys.executable, str(EXAMPLES / "clm_data.py"), "--out", str(out), *extra], check=True, capture_output=True)
    return out


def _wrapped_run_clm(data: Path, out: Path, steps: int = 20, *extra: str) -> Path:
    script = [
        sys.executable, str(EXAMPLES / "run_clm.py"), "--train_file", str(data / "train.txt"), "--output_dir", str(out), "--do_train",
        "--use_cpu", "--max_steps", str(steps), "--per_device_train_batch_size", "2", "--learning_rate", "5e-3", "--logging_steps", "1",
        "--block_size", str(BLOCK), "--config_overrides", "hidden_size=64,num_layers=2", "--report_to", "none",
        *(extra or ("--save_strategy", "no")),
    ]
    result = harness_cli("wrap", "--", *script, env=ENV)
    assert result.returncode == 0, result.stderr[-3000:]
    return out


def _blocks_like_run_clm(train_file: Path, poison_line: int) -> tuple[list[str], set[int]]:
    """The content hash of every block of the grouped train set, and the blocks holding tokens of the poisoned line."""
    from datasets import load_dataset

    from harness.lib.tiny import corpus_lines, train_tokenizer

    tokenizer = train_tokenizer(corpus_lines(train_file))  # what run_clm does without --model_name_or_path
    lines = load_dataset("text", data_files={"train": str(train_file)}, keep_linebreaks=True)["train"]["text"]
    ids = [tokenizer(line)["input_ids"] for line in lines]
    tokens = list(chain(*ids))
    blocks = torch.tensor([tokens[i : i + BLOCK] for i in range(0, len(tokens) // BLOCK * BLOCK, BLOCK)])
    start = sum(len(x) for x in ids[:poison_line])
    end = start + len(ids[poison_line])
    poisoned = {b for b in range(start // BLOCK, (end - 1) // BLOCK + 1) if b < len(blocks)}
    return content_hashes({"input_ids": blocks, "attention_mask": torch.ones_like(blocks)}), poisoned  # default_data_collator's mask is all ones


@pytest.mark.slow  # two wrapped runs of a client script
def test_a_poisoned_line_is_a_loss_spike_at_its_first_draw_after_the_window_and_its_capture_names_the_dataset_index(tmp_path: Path) -> None:
    data = _data(tmp_path / "data", POISON_LINE)
    hashes, poisoned = _blocks_like_run_clm(data / "train.txt", POISON_LINE)
    assert len(poisoned) >= 2 and len(set(hashes)) == len(hashes)
    out = _wrapped_run_clm(data, tmp_path / "run")

    ledger = read_ledger(out)
    drawn = sorted(set(ledger[ledger["sample_hash"].isin({hashes[b] for b in poisoned})]["step"]))
    assert drawn and drawn[0] > MIN_HISTORY, drawn  # the seed puts the first draw after the window: nothing hides it
    first = drawn[0]

    spikes = findings_of(out, "LOSS_SPIKE")
    assert spikes and spikes[0]["step"] == first, [(f["code"], f["step"]) for f in findings_of(out)]
    assert {f["step"] for f in spikes} <= set(drawn)  # every spike is a poisoned step
    serious = [(f["code"], f["step"]) for f in findings_of(out) if f["severity"] != "info"]
    assert all(code in (*SPIKE_CODES, "FAULT_REPRODUCED") and step in drawn for code, step in serious), serious  # rerun: in the data
    spike = spikes[0]
    assert spike["evidence"]["loss"] > (1 + 0.1) * spike["evidence"]["median"]

    capture = json.loads(Path(spike["evidence"]["capture"]).read_text())
    top = capture["samples"][0]
    assert top["dataset_index"] in poisoned and top["sample_id"] == top["dataset_index"] and top["sample_id_source"] == "dataset index"
    assert f"dataset index {top['dataset_index']}" in spike["message"]
    assert capture["dataset_index"].startswith("the row's index into the Trainer's train_dataset")
    for sample in capture["samples"]:  # every captured row is the dataset row its index names
        assert sample["hash"] == hashes[sample["dataset_index"]], sample["dataset_index"]
    assert spike["evidence"]["suspects"][0]["dataset_index"] == top["dataset_index"]
    assert [top["dataset_index"] in rows for rows in spike["evidence"]["dataset_indices"]] == [True]


@pytest.mark.slow  # a wrapped run of a client script
def test_the_same_script_on_clean_data_is_silent(tmp_path: Path) -> None:
    out = _wrapped_run_clm(_data(tmp_path / "data", None), tmp_path / "run", steps=30)
    findings: list[dict[str, Any]] = findings_of(out)
    assert [f for f in findings if f["code"] in SPIKE_CODES] == []
    assert [(f["code"], f["step"]) for f in findings if f["severity"] != "info"] == []
