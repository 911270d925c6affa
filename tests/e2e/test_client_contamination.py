"""Issue 18, item 1: a run_clm-style client with a templated eval set under ``harness wrap``, 1 and 2 processes.

Train and eval are disjoint questions of one template (``examples/clm_data.py``),
so they share template n-grams: a clean fine-tune must give no CONTAMINATION
(the template text is a small fraction of every eval block: partial, summary
only). Planted eval lines (``--plant``) make every eval block they cover dirty,
although no training block holds one whole (the block boundaries differ): each
is reported exactly once, by one rank, and not again after a resume into the
same output_dir.

Issue 43 item 6: eval lines copied one by one from training (``--leak``, the
way a validation file drawn from training text leaks) into blocks of long
lines: no 13-gram across their line breaks was ever trained, yet every block
mostly made of them is dirty, and one summary finding counts the eval rows
that hold training spans.
"""
from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from conftest import EXAMPLES, harness_cli, read_jsonl, torchrun

BLOCK = 64
PLANT = (5, 15)  # eval lines 5..19: starts inside eval block 1, covers blocks 2 and 3 whole (with the client's tokenizer)


def _data(tmp_path: Path, *extra: str) -> Path:
    data = tmp_path / "data"
    subprocess.run([sys.executable, str(EXAMPLES / "clm_data.py"), "--out", str(data), *extra], check=True, capture_output=True)
    return data


def _run_clm(data: Path, out: Path, nproc: int, steps: int, *extra: str, save_steps: int = 10) -> None:
    launcher = [sys.executable] if nproc == 1 else torchrun(nproc)
    result = harness_cli(
        "wrap", "--", *launcher, str(EXAMPLES / "run_clm.py"),
        "--train_file", str(data / "train.txt"), "--validation_file", str(data / "validation.txt"),
        "--do_train", "--do_eval", "--output_dir", str(out), "--max_steps", str(steps), "--per_device_train_batch_size", "4",
        "--logging_steps", "1", "--use_cpu", "--report_to", "none", "--save_steps", str(save_steps), *extra,
    )
    assert result.returncode == 0, result.stderr[-4000:]


def _findings(out: Path) -> list[dict[str, Any]]:
    """Every finding of the run once: rank 0's file and what other ranks spilled (by id)."""
    run = out / "harness"
    rows: dict[str, dict[str, Any]] = {}
    for path in [run / "findings.jsonl", *sorted((run / "ranks").glob("findings.rank-*.jsonl"))]:
        for row in read_jsonl(path) if path.exists() else []:
            rows.setdefault(row["id"], row)
    return list(rows.values())


def _summaries(out: Path) -> list[dict[str, Any]]:
    return [json.loads(p.read_text()) for p in sorted((out / "harness" / "contamination").glob("summary.rank-*.json"))]


def _dirty(out: Path) -> set[str]:
    return {e["id"] for s in _summaries(out) for e in s["examples"] if e["status"] == "dirty"}


def _covered_blocks(out: Path, data: Path, start: int, count: int) -> set[str]:
    """Eval blocks that lie wholly inside the planted lines, in the client's own tokenisation (its saved tokenizer)."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(out)
    lines = data.joinpath("validation.txt").read_text(encoding="utf-8").splitlines(keepends=True)
    offsets = [0]
    for ids in tokenizer(lines)["input_ids"]:
        offsets.append(offsets[-1] + len(ids))
    first, end = offsets[start], offsets[start + count]
    return {str(b) for b in range(offsets[-1] // BLOCK) if first <= BLOCK * b and BLOCK * b + BLOCK <= end}


def _warnings(out: Path) -> list[dict[str, Any]]:
    return [f for f in _findings(out) if f["severity"] in ("warning", "error", "critical")]


def _copied_shares(out: Path, data: Path) -> list[float]:
    """Per eval block: the share of its tokens that are validation lines also found in train.txt (the client's tokenizer)."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(out)
    trained = set(data.joinpath("train.txt").read_text(encoding="utf-8").splitlines())
    lines = data.joinpath("validation.txt").read_text(encoding="utf-8").splitlines(keepends=True)
    flags = [line.rstrip("\n") in trained for line, ids in zip(lines, tokenizer(lines)["input_ids"]) for _ in ids]
    return [sum(flags[BLOCK * b : BLOCK * b + BLOCK]) / BLOCK for b in range(len(flags) // BLOCK)]


@pytest.mark.slow
@pytest.mark.parametrize(("nproc", "per_line"), [(1, 1), (2, 1), (1, 3)])
def test_clean_fine_tune_with_a_templated_eval_set_is_silent(tmp_path: Path, nproc: int, per_line: int) -> None:
    data, out = _data(tmp_path, "--questions_per_line", str(per_line), "--eval_lines", str(80 // per_line)), tmp_path / "out"
    _run_clm(data, out, nproc, 30)
    assert [f for f in _findings(out) if f["plugin"] == "contamination"] == []
    # the run is otherwise clean too: under DDP accelerate's even_batches pads each epoch's last round with samples from
    # the epoch's start, which data_hash knows is not a repeat
    assert [(f["code"], f["plugin"]) for f in _warnings(out)] == []
    summaries = _summaries(out)
    assert len(summaries) == nproc and all(s["complete"] and s["eval_sets"]["eval_dataset"].get("dirty", 0) == 0 for s in summaries)


@pytest.mark.slow  # two processes: the harder case (a block's n-grams split over ranks); one process is the same code
@pytest.mark.parametrize("nproc", [2])
def test_planted_eval_lines_are_reported_once_per_dirty_block(tmp_path: Path, nproc: int) -> None:
    data, out = _data(tmp_path, "--plant", f"{PLANT[0]}:{PLANT[1]}"), tmp_path / "out"
    _run_clm(data, out, nproc, 30)
    found = [f for f in _findings(out) if f["code"] == "CONTAMINATION"]
    ids = [f["evidence"]["example_id"] for f in found]
    covered = _covered_blocks(out, data, *PLANT)
    assert covered and covered <= set(ids), (covered, ids)
    assert sorted(ids) == sorted(set(ids)) and set(ids) == _dirty(out)  # once each, over ranks; what the summaries call dirty
    for f in found:
        ev = f["evidence"]
        assert ev["matched_fraction"] >= 0.5 and ev["eval_set"] == "eval_dataset" and ev["snippet"]
        assert f["rank"] == ev["rank"] and set(ev["ranks"]) <= set(range(nproc))
        assert ev["agreed"] is True  # through the step exchange (the last step waits for the checker), not at run end
    if nproc == 2:  # with the client's seeded order, the two halves of eval block 2 are drawn by different ranks
        assert any(len(f["evidence"]["ranks"]) == 2 for f in found), [f["evidence"]["ranks"] for f in found]
    assert [f for f in _warnings(out) if f["code"] not in ("CONTAMINATION", "CONTAMINATION_SUMMARY")] == []


@pytest.mark.slow
def test_eval_lines_copied_one_by_one_are_counted_by_their_training_spans(tmp_path: Path) -> None:
    """A fifth of 40 validation lines of three questions each (about 37 tokens) are copies of training lines."""
    data, out = _data(tmp_path, "--questions_per_line", "3", "--eval_lines", "40", "--leak", "0.2"), tmp_path / "out"
    _run_clm(data, out, 1, 30)
    shares = _copied_shares(out, data)
    (summary,) = _summaries(out)
    rows = {e["id"]: e for e in summary["examples"]}
    dirty = _dirty(out)
    assert {str(b) for b, share in enumerate(shares) if share >= 0.55} <= dirty, (shares, rows)
    assert not {str(b) for b, share in enumerate(shares) if share == 0} & dirty
    found = [f for f in _findings(out) if f["code"] == "CONTAMINATION"]
    assert {f["evidence"]["example_id"] for f in found} == dirty
    (said,) = [f for f in _findings(out) if f["code"] == "CONTAMINATION_SUMMARY"]
    long_spans = sum(1 for e in rows.values() if e["longest_span"] >= 32)
    assert long_spans and f"{long_spans} of {len(shares)} eval rows hold training spans of at least 32 tokens" in said["message"]
    assert f"{len(dirty)} of {len(shares)} are dirty" in said["message"], said["message"]
    assert [f for f in _warnings(out) if f["code"] not in ("CONTAMINATION", "CONTAMINATION_SUMMARY")] == []


@pytest.mark.slow  # two processes only (see above): the suite's 20-minute budget
@pytest.mark.parametrize("nproc", [2])
def test_a_resume_into_the_same_output_dir_does_not_report_again(tmp_path: Path, nproc: int) -> None:
    """Attempt 1 reports the planted blocks after its last checkpoint, then dies; attempt 2 trains them again: no repeat.

    The kill -9 is simulated by removing every checkpoint after checkpoint-4: the resume restores nothing of the
    matches (they came at later steps), so only the findings already on disk keep attempt 2 quiet.
    """
    data, out = _data(tmp_path, "--plant", f"{PLANT[0]}:{PLANT[1]}"), tmp_path / "out"
    _run_clm(data, out, nproc, 20, save_steps=4)
    first = {f["id"]: (f["evidence"]["example_id"], f["step"]) for f in _findings(out) if f["code"] == "CONTAMINATION"}
    assert _covered_blocks(out, data, *PLANT) <= {example for example, _ in first.values()}
    assert all(step > 4 for _, step in first.values())  # after the checkpoint the resume starts from
    for checkpoint in out.glob("checkpoint-*"):
        if int(checkpoint.name.split("-")[1]) > 4:
            shutil.rmtree(checkpoint)
    _run_clm(data, out, nproc, 40, save_steps=100)  # run_clm resumes from checkpoint-4 in the same output_dir
    again = {f["id"]: (f["evidence"]["example_id"], f["step"]) for f in _findings(out) if f["code"] == "CONTAMINATION"}
    assert again == first
    seen_again = {e["id"] for s in _summaries(out) for e in s["examples"] if e["status"] == "dirty" and e["documents_hit"]}
    assert {example for example, _ in first.values()} <= seen_again  # attempt 2 met them in its own batches, and kept quiet
    attempts = json.loads((out / "harness" / "run.json").read_text()).get("attempts", [])
    assert len(attempts) == 2
