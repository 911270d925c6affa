"""What happens to an incomplete checkpoint passed over by a resume, in the code (``set_aside``) and in
``playbooks/resume.md``: renamed ``incomplete-checkpoint-<N>``, kept, not rotated, cleaned up by hand. The playbook
says so once, and nowhere that the folders are left in place."""
from __future__ import annotations

import re
from pathlib import Path

from conftest import REPO
from harness.lib.checkpoints import list_checkpoints, set_aside

PLAYBOOK = REPO / "playbooks" / "resume.md"


def test_set_aside_renames_out_of_the_checkpoint_names(tmp_path: Path) -> None:
    for name in ("checkpoint-10", "checkpoint-10"):  # the second takes the ".2" name
        (tmp_path / name).mkdir()
        (tmp_path / name / "model.safetensors").write_bytes(b"w")
        set_aside(tmp_path / name)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["incomplete-checkpoint-10", "incomplete-checkpoint-10.2"]
    assert list_checkpoints(tmp_path) == []  # neither resumed from nor rotated: only a user deletes them


def test_the_resume_playbook_says_what_set_aside_does_once() -> None:
    text = PLAYBOOK.read_text(encoding="utf-8")
    assert "left in place; the next save" not in text and "rotation counts them" not in text
    # the rename is explained in one place (CHECKPOINT_INCOMPLETE), with its suffixes and its cleanup by hand
    assert len(re.findall(r"is renamed `incomplete-checkpoint-<N>`", text)) == 1
    section = text[text.index("## CHECKPOINT_INCOMPLETE"):text.index("## RESUME_UNCHECKED")]
    assert "`incomplete-checkpoint-<N>.2`" in section
    assert "`save_total_limit` does not rotate them" in section
    assert "rm -r <output_dir>/incomplete-checkpoint-<N>" in section
