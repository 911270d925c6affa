"""``harness resume-point`` on handmade run directories (no training): which checkpoint it names, and the notes on stderr
for the newer folders it passes over (a symlinked checkpoint folder, a broken ``harness_proven`` marker)."""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from cli_in_process import harness_in_process
from harness.lib.checkpoints import linked_checkpoints, list_checkpoints, resolve_last
from harness.lib.proven import FORMAT, MARKER, file_manifest, newest_proven, newest_proven_noting, read_marker, rotate


def _proven_checkpoint(folder: Path, step: int) -> Path:
    """A checkpoint the Trainer can resume from, with a valid proof marker whose manifest matches its files."""
    folder.mkdir(parents=True)
    (folder / "model.safetensors").write_bytes(b"w" * 16)
    (folder / "optimizer.pt").write_bytes(b"o" * 8)
    (folder / "trainer_state.json").write_text(json.dumps({"global_step": step}), encoding="utf-8")
    record = {"format": FORMAT, "step": step, "checks": ["complete"], "files": file_manifest(folder)}
    (folder / MARKER).write_text(json.dumps(record), encoding="utf-8")
    return folder


def _resume_point(capsys: Any, monkeypatch: pytest.MonkeyPatch, run: Path) -> Any:
    return harness_in_process(capsys, monkeypatch, "resume-point", str(run))


def test_a_symlinked_checkpoint_folder_is_never_named_and_is_noted(tmp_path: Path, capsys: Any,
                                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    run = tmp_path / "run"
    _proven_checkpoint(run / "checkpoint-90", 90)
    outside = _proven_checkpoint(tmp_path / "elsewhere" / "checkpoint-100", 100)  # proven, but not the run's own
    (run / "checkpoint-100").symlink_to(outside, target_is_directory=True)

    result = _resume_point(capsys, monkeypatch, run)
    assert result.returncode == 0, result
    assert result.stdout.strip() == str(run / "checkpoint-90")
    notes = [line for line in result.stderr.splitlines() if "checkpoint-100" in line]
    assert len(notes) == 1 and "passed over checkpoint-100: it is a symbolic link" in notes[0], result.stderr

    # the library: a link is not a checkpoint (not listed, not resumed from, not rotated), only listed as a link
    assert list_checkpoints(run) == [run / "checkpoint-90"]
    assert linked_checkpoints(run) == [run / "checkpoint-100"]
    assert resolve_last(run).chosen == run / "checkpoint-90"
    assert newest_proven(run) == run / "checkpoint-90"
    assert rotate(run, 1, []) == [] and (outside / "model.safetensors").is_file()


def test_only_a_symlinked_checkpoint_is_none_with_the_note(tmp_path: Path, capsys: Any,
                                                           monkeypatch: pytest.MonkeyPatch) -> None:
    run = tmp_path / "run"
    run.mkdir()
    (run / "checkpoint-100").symlink_to(_proven_checkpoint(tmp_path / "elsewhere" / "checkpoint-100", 100))
    (run / "checkpoint-110").symlink_to(tmp_path / "nowhere")  # a dangling link: noted too, never a traceback
    result = _resume_point(capsys, monkeypatch, run)
    assert result.returncode == 1 and result.stdout == ""
    assert "passed over checkpoint-100: it is a symbolic link" in result.stderr
    assert "passed over checkpoint-110: it is a symbolic link" in result.stderr
    assert "no proven checkpoint" in result.stderr


@pytest.mark.parametrize("damage, why", [
    (lambda marker: marker.write_text("garbage, not JSON\n", encoding="utf-8"), "not JSON"),
    (lambda marker: marker.write_bytes(b"\xff\xfe\x00broken"), "not JSON"),
    (lambda marker: marker.mkdir(), "it is a folder"),
    (lambda marker: marker.write_text("[1, 2]", encoding="utf-8"), "not a JSON object"),
    (lambda marker: marker.write_text(json.dumps({"format": "other/9", "step": 100}), encoding="utf-8"), "its format is"),
    (lambda marker: marker.write_text(json.dumps({"format": FORMAT, "step": 5}), encoding="utf-8"), "it names step 5"),
], ids=["garbage", "not-utf8", "folder", "list", "format", "step"])
def test_a_broken_proof_marker_on_the_newest_checkpoint_is_noted(tmp_path: Path, capsys: Any, monkeypatch: pytest.MonkeyPatch,
                                                                  damage: Any, why: str) -> None:
    run = tmp_path / "run"
    _proven_checkpoint(run / "checkpoint-90", 90)
    newest = _proven_checkpoint(run / "checkpoint-100", 100)
    (newest / MARKER).unlink()
    damage(newest / MARKER)

    result = _resume_point(capsys, monkeypatch, run)
    assert result.returncode == 0 and result.stdout.strip() == str(run / "checkpoint-90"), result
    notes = [line for line in result.stderr.splitlines() if "checkpoint-100" in line]
    assert len(notes) == 1, result.stderr
    assert f"passed over checkpoint-100: its proof marker {MARKER} could not be read (" in notes[0]
    assert why in notes[0], notes[0]


def test_a_linked_proof_marker_is_not_read_and_is_noted(tmp_path: Path) -> None:
    run = tmp_path / "run"
    _proven_checkpoint(run / "checkpoint-90", 90)
    newest = _proven_checkpoint(run / "checkpoint-100", 100)
    real = tmp_path / "real_marker"
    (newest / MARKER).rename(real)
    (newest / MARKER).symlink_to(real)
    chosen, notes = newest_proven_noting(run)
    assert chosen == run / "checkpoint-90"
    assert notes == [f"passed over checkpoint-100: its proof marker {MARKER} could not be read (it is a symbolic link; "
                     "nothing is read through a link)"]


def test_no_marker_is_not_noted_and_a_valid_one_is_read(tmp_path: Path, capsys: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    run = tmp_path / "run"
    _proven_checkpoint(run / "checkpoint-90", 90)
    (_proven_checkpoint(run / "checkpoint-100", 100) / MARKER).unlink()  # saved, not (yet) proven: nothing to say
    result = _resume_point(capsys, monkeypatch, run)
    assert (result.returncode, result.stdout.strip(), result.stderr) == (0, str(run / "checkpoint-90"), "")
    assert read_marker(run / "checkpoint-100") == (None, None)
    record, problem = read_marker(run / "checkpoint-90")
    assert problem is None and record is not None and record["step"] == 90


def test_a_proven_checkpoint_that_lost_trainer_state_is_noted(tmp_path: Path) -> None:
    run = tmp_path / "run"
    _proven_checkpoint(run / "checkpoint-90", 90)
    newest = _proven_checkpoint(run / "checkpoint-100", 100)
    (newest / MARKER).write_text(json.dumps({"format": FORMAT, "step": 100}), encoding="utf-8")  # no manifest (older marker)
    (newest / "trainer_state.json").unlink()
    chosen, notes = newest_proven_noting(run)
    assert chosen == run / "checkpoint-90"
    assert notes == ["passed over checkpoint-100: it was proven but lacks trainer_state.json now"]
