"""Issue 44 item 4: training never writes through links planted in a copied or received run directory."""
from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Any

import pytest

import harness
from conftest import EXAMPLE, harness_cli, write_yaml
from harness.core.appendfile import OUTAGES, LineAppender
from harness.core.errors import RunDirLinkedError


def _trained(make_trainer: Any, out: Path) -> Path:
    first = make_trainer(output_dir=out, max_steps=3)
    harness.attach(first)
    first.train()
    return out / "harness"


def test_a_symlink_or_a_hard_link_in_the_run_directory_refuses_the_attach(make_trainer: Any, tmp_path: Path) -> None:
    """findings.jsonl linked to a file outside the run, or the ledger a hard link of another copy's: today the resumed
    run appended findings outside the run and truncated the other copy's ledger (5,104 to 971 bytes)."""
    run_dir = _trained(make_trainer, tmp_path / "run")
    outside = tmp_path / "outside.jsonl"
    outside.write_text("precious\n")
    (run_dir / "findings.jsonl").unlink()
    (run_dir / "findings.jsonl").symlink_to(outside)
    with pytest.raises(RunDirLinkedError, match=r"findings.jsonl \(a symbolic link to .*outside.jsonl\)"):
        harness.attach(make_trainer(output_dir=tmp_path / "run", max_steps=3))
    assert outside.read_text() == "precious\n"
    (run_dir / "findings.jsonl").unlink()
    ledger = run_dir / "ledger" / "rank-0.jsonl"
    before = ledger.read_bytes()
    os.link(ledger, tmp_path / "other-copy.jsonl")
    with pytest.raises(RunDirLinkedError, match=r"ledger/rank-0.jsonl \(a hard link: 2 names share it\).*cp -r"):
        harness.attach(make_trainer(output_dir=tmp_path / "run", max_steps=3))
    assert (tmp_path / "other-copy.jsonl").read_bytes() == before


def test_a_linked_run_directory_under_wrap_exits_2_with_one_paragraph(tmp_path: Path) -> None:
    out = tmp_path / "out"
    (out / "harness").mkdir(parents=True)
    (out / "harness" / "steps.jsonl").symlink_to(tmp_path / "elsewhere.jsonl")
    config = write_yaml(tmp_path / "h.yaml", {})
    result = harness_cli("wrap", "--config", str(config), "--", sys.executable, str(EXAMPLE), "--output_dir", str(out),
                         "--max_steps", "2", env={"DS_ACCELERATOR": "cpu"})
    assert result.returncode == 2 and "Traceback" not in result.stderr, result.stderr[-3000:]
    assert "holds links where the harness writes: steps.jsonl (a symbolic link to" in result.stderr
    assert not (tmp_path / "elsewhere.jsonl").exists()


def test_the_appenders_never_write_through_a_link(tmp_path: Path) -> None:
    """The writers' own guard, under the attach check: a link is an outage of that file, never a write through it."""
    target = tmp_path / "outside.jsonl"
    target.write_text("")
    (tmp_path / "harness").mkdir()
    (tmp_path / "harness" / "metrics.jsonl").symlink_to(target)
    try:
        assert not LineAppender(tmp_path / "harness" / "metrics.jsonl").write('{"step": 1}\n')
        assert target.read_text() == ""
    finally:
        OUTAGES.active.clear()
