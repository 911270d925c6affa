"""Earlier processes' undelivered journals: which belong to this job's run, which are named in a finding."""
from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import harness
from conftest import findings_of
from harness.plugins.mlflow.outboxes import leftovers, target_file, write_target

URI = "http://127.0.0.1:5000"


def _outbox(folder: Path, session: str, records: int, cursor: int | None = None, run_id: str | None = "r1",
            uri: str | None = URI) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / f"outbox-{session}.jsonl"
    path.write_text("".join(json.dumps({"k": "m", "key": "loss", "value": 1.0, "ts": 0, "step": i}) + "\n" for i in range(records)))
    if cursor is not None:
        (folder / f"{path.name}.cursor").write_text(str(cursor))
    if uri is not None:
        write_target(path, uri, run_id)
    return path


def test_leftovers_are_the_other_journals_with_records_after_their_cursor(tmp_path: Path) -> None:
    current = _outbox(tmp_path, "20261207-120000-3", 5)
    done = _outbox(tmp_path, "20261207-100000-1", 3)
    (tmp_path / f"{done.name}.cursor").write_text(str(done.stat().st_size))  # delivered whole
    behind = _outbox(tmp_path, "20261207-110000-2", 4, cursor=10)
    never = _outbox(tmp_path, "20261207-090000-0", 2, run_id=None)
    unknown = _outbox(tmp_path, "20261207-080000-9", 2, uri=None)
    os.mkfifo(tmp_path / "outbox-20261207-070000-8.jsonl")  # a received run directory's FIFO: never opened
    (tmp_path / "outbox-20261207-060000-7.jsonl").symlink_to(behind)
    found = leftovers(tmp_path, current)
    assert [one.path for one in found] == [unknown, never, behind]  # oldest session first
    assert found[2].unsent_bytes == behind.stat().st_size - 10 and found[2].run_id == "r1"
    assert found[0].tracking_uri is None and found[1].run_id is None
    assert found[2].belongs_to(URI, "r1", resumed=False) and not found[2].belongs_to(URI, "r2", resumed=True)
    assert not found[2].belongs_to("http://elsewhere", "r1", resumed=True)
    assert found[1].belongs_to(URI, "r7", resumed=True) and not found[1].belongs_to(URI, None, resumed=False)
    assert not found[0].belongs_to(URI, "r1", resumed=True)  # target unknown: never guessed
    assert "a run it never made" in found[1].describe() and "target unknown" in found[0].describe()
    assert json.loads(target_file(behind).read_text()) == {"tracking_uri": URI, "run_id": "r1"}


def test_a_fresh_run_names_another_runs_undelivered_journal_and_leaves_it(make_trainer: Any) -> None:
    trainer = make_trainer(max_steps=2)
    folder = Path(trainer.args.output_dir) / "harness" / "mlflow"
    other = _outbox(folder, "20000101-000000-1", 6, run_id="0123456789abcdef")
    harness.attach(trainer, config={"plugins": ["mlflow"]})
    trainer.train()
    (found,) = findings_of(trainer.args.output_dir, "TRACKING_DEGRADED")
    assert other.name in found["message"] and "run 0123456789abcdef" in found["message"]
    assert found["evidence"]["journals"] == [str(other)] and found["severity"] == "warning"
    assert not (folder / f"{other.name}.cursor").exists()  # not delivered into this job's run


def test_a_target_is_never_written_through_a_link(tmp_path: Path) -> None:
    """A received run directory with a link where the target file goes: the file the link names is left alone."""
    outside = tmp_path / "outside.txt"
    outside.write_text("untouched")
    folder = tmp_path / "run" / "harness" / "mlflow"
    journal = _outbox(folder, "20261207-120000-3", 1, uri=None)
    target = target_file(journal)
    target.with_name(target.name + ".tmp").symlink_to(outside)  # where a plain temporary file would have gone
    write_target(journal, URI, "r1")
    assert outside.read_text() == "untouched"
    target.unlink()
    target.symlink_to(outside)
    write_target(journal, URI, "r1")
    assert outside.read_text() == "untouched"
