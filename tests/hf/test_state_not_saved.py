"""Issue 44 item 9: a harness state that cannot be written at a save is a finding, and the proof does not wait for it."""
from __future__ import annotations

from pathlib import Path
from typing import Any

import harness
from conftest import findings_of


def test_a_state_that_cannot_be_written_is_said_and_the_proof_waits_for_no_marker(make_trainer: Any, tmp_path: Path) -> None:
    """``checkpoint-3/harness_state`` is a file (something in the way): the Trainer saves, training goes on, the harness
    says what it could not write, and checkpoint_proof's verdict names it instead of waiting rank_wait_s for a marker
    rank 0 knows it never wrote (today: one stderr line, then 'rank(s) [0] did not finish ... another node's disk')."""
    out = tmp_path / "run"
    (out / "checkpoint-3").mkdir(parents=True)
    (out / "checkpoint-3" / "harness_state").write_text("in the way")
    trainer = make_trainer(output_dir=out, max_steps=6, save_strategy="steps", save_steps=3)
    harness.attach(trainer)
    trainer.train()
    assert trainer.state.global_step == 6
    (not_saved,) = findings_of(out, "HARNESS_STATE_NOT_SAVED")
    assert not_saved["step"] == 3 and not_saved["evidence"]["errno"] is not None
    assert "harness_state/rank-0.json" in not_saved["message"] and "checkpoint-3" in not_saved["message"]
    unverified = [f for f in findings_of(out, "CHECKPOINT_UNVERIFIED") if "checkpoint-3" in f["message"]]
    assert len(unverified) == 1 and "could not write its plugin state" in unverified[0]["message"]
    assert "another node" not in unverified[0]["message"]
    assert not list((out / "checkpoint-3").glob(".*.tmp")) and (out / "checkpoint-6" / "harness_state" / "rank-0.json").is_file()
