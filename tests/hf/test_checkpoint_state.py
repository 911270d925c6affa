"""Issue 44 item 10: a malformed harness_state in a checkpoint is data: the resumed training goes on, without it, and says why."""
from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import pytest

import harness
from conftest import findings_of
from harness.lib.checkpoints import read_state_file

DAMAGED = {
    "a list": ("[1, 2]", "holds a JSON list"),
    "too deep": ("[" * 100_000 + "]" * 100_000, "nested too deep"),
    "not JSON": ('{"resume_check": ', "not JSON"),
    "an entry that is no object": ('{"resume_check": [1], "metrics_log": {"tokens": 5}}', "resume_check are not JSON objects"),
}


@pytest.mark.parametrize("name", list(DAMAGED))
def test_a_damaged_state_file_reads_as_absent_with_its_reason(tmp_path: Path, name: str) -> None:
    text, reason = DAMAGED[name]
    (tmp_path / "harness_state").mkdir()
    (tmp_path / "harness_state" / "rank-0.json").write_text(text)
    states, problem = read_state_file(tmp_path, 0)
    assert problem is not None and reason in problem
    assert states == ({"metrics_log": {"tokens": 5}} if name == "an entry that is no object" else {})
    assert read_state_file(tmp_path, 1) == ({}, None)  # no file: absent, nothing to say


@pytest.mark.parametrize("name", ["a list", "too deep"])
def test_a_resume_from_a_checkpoint_with_a_damaged_state_trains_on(make_trainer: Any, tmp_path: Path, name: str,
                                                                     caplog: pytest.LogCaptureFixture) -> None:
    """Today: AttributeError ('list' object has no attribute 'get') or RecursionError out of train(), exit 1."""
    out = tmp_path / "run"
    first = make_trainer(output_dir=out, max_steps=6, save_strategy="steps", save_steps=3)
    harness.attach(first)
    first.train()
    state = out / "checkpoint-3" / "harness_state" / "rank-0.json"
    state.write_text(DAMAGED[name][0])
    caplog.set_level(logging.WARNING, logger="harness")
    resumed = make_trainer(output_dir=out, max_steps=6, save_strategy="steps", save_steps=3)
    harness.attach(resumed)
    resumed.train(resume_from_checkpoint=str(out / "checkpoint-3"))
    assert resumed.state.global_step == 6
    assert f"{state} cannot be used (it " in caplog.text and DAMAGED[name][1] in caplog.text
    unchecked = [f for f in findings_of(out, "RESUME_UNCHECKED") if "cannot be used" in f["message"]]
    assert len(unchecked) == 1 and DAMAGED[name][1] in unchecked[0]["message"]
