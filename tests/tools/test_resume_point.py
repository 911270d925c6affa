"""``harness resume-point`` on handmade run directories (no training): which checkpoint it names, and the notes on stderr
for the newer folders it passes over (a symlinked checkpoint folder, a broken ``harness_proven`` marker, a checkpoint of a
history the run went back from)."""
from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import pytest

from cli_in_process import harness_in_process
from handmade_runs import T2, proven_checkpoint, rolled_back_run, saved_at, write_run_json
from harness.lib.checkpoints import linked_checkpoints, list_checkpoints, resolve_last
from harness.lib.proven import CHECKED, CHECKED_FORMAT, FORMAT, MARKER, file_manifest, newest_proven, newest_proven_noting, read_marker, rotate


def _resume_point(capsys: Any, monkeypatch: pytest.MonkeyPatch, run: Path) -> Any:
    return harness_in_process(capsys, monkeypatch, "resume-point", str(run))


def test_a_symlinked_checkpoint_folder_is_never_named_and_is_noted(tmp_path: Path, capsys: Any,
                                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    run = tmp_path / "run"
    proven_checkpoint(run / "checkpoint-90", 90)
    outside = proven_checkpoint(tmp_path / "elsewhere" / "checkpoint-100", 100)  # proven, but not the run's own
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
    (run / "checkpoint-100").symlink_to(proven_checkpoint(tmp_path / "elsewhere" / "checkpoint-100", 100))
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
    proven_checkpoint(run / "checkpoint-90", 90)
    newest = proven_checkpoint(run / "checkpoint-100", 100)
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
    proven_checkpoint(run / "checkpoint-90", 90)
    newest = proven_checkpoint(run / "checkpoint-100", 100)
    real = tmp_path / "real_marker"
    (newest / MARKER).rename(real)
    (newest / MARKER).symlink_to(real)
    chosen, notes = newest_proven_noting(run)
    assert chosen == run / "checkpoint-90"
    assert notes == [f"passed over checkpoint-100: its proof marker {MARKER} could not be read (it is a symbolic link; "
                     "nothing is read through a link)"]


def test_no_marker_is_not_noted_and_a_valid_one_is_read(tmp_path: Path, capsys: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    run = tmp_path / "run"
    proven_checkpoint(run / "checkpoint-90", 90)
    (proven_checkpoint(run / "checkpoint-100", 100) / MARKER).unlink()  # saved, not (yet) proven: nothing to say
    result = _resume_point(capsys, monkeypatch, run)
    assert (result.returncode, result.stdout.strip(), result.stderr) == (0, str(run / "checkpoint-90"), "")
    assert read_marker(run / "checkpoint-100") == (None, None)
    record, problem = read_marker(run / "checkpoint-90")
    assert problem is None and record is not None and record["step"] == 90


def test_a_proven_checkpoint_that_lost_trainer_state_is_noted(tmp_path: Path) -> None:
    run = tmp_path / "run"
    proven_checkpoint(run / "checkpoint-90", 90)
    newest = proven_checkpoint(run / "checkpoint-100", 100)
    (newest / MARKER).write_text(json.dumps({"format": FORMAT, "step": 100}), encoding="utf-8")  # no manifest (older marker)
    (newest / "trainer_state.json").unlink()
    chosen, notes = newest_proven_noting(run)
    assert chosen == run / "checkpoint-90"
    assert notes == ["passed over checkpoint-100: it was proven but lacks trainer_state.json now"]


# -- a history the run went back from ---------------------------------------------------------------------------------
# A run saved checkpoint-30, -40 and -50 and was killed at step 57; the user resumed from checkpoint-30 (attempt 2), which
# wrote a new checkpoint-40 and was killed at step 45. Attempt 1's checkpoint-50 is still there, the newest by name:
# resuming from it would silently discard attempt 2's steps 31-45. run.json records when and from which step attempt 2
# started; checkpoint-50 was written before that.

def test_a_newer_checkpoint_of_a_history_the_run_went_back_from_is_passed_over(tmp_path: Path, capsys: Any,
                                                                               monkeypatch: pytest.MonkeyPatch) -> None:
    run = rolled_back_run(tmp_path)
    result = _resume_point(capsys, monkeypatch, run)
    assert result.returncode == 0, result
    assert result.stdout.strip() == str(run / "checkpoint-40")
    assert result.stderr == ("harness resume-point: passed over checkpoint-50: written before the resume from checkpoint-30 "
                             "(attempt 2): a history the run went back from.\n"), result.stderr

    # the Trainer's resume_from_checkpoint=True (the stage runner's --resume) makes the same choice, and does not take the
    # abandoned folder for an incomplete one (nothing to rename, nothing to report as broken)
    found = resolve_last(run)
    assert found.chosen == run / "checkpoint-40" and found.skipped == []
    assert found.abandoned == [(run / "checkpoint-50", "written before the resume from checkpoint-30 (attempt 2): a history "
                                                      "the run went back from")]
    assert newest_proven(run) == run / "checkpoint-40"


def test_the_last_attempt_that_trained_sets_the_line_and_a_continued_line_passes_nothing_over(tmp_path: Path) -> None:
    run = rolled_back_run(tmp_path)
    attempts = json.loads((run / "harness" / "run.json").read_text(encoding="utf-8"))["attempts"]
    # a train() call that failed before training began (a bad checkpoint path) records no start: attempt 2 still counts
    write_run_json(run, [*attempts, {"started": None, "resumed_from": None, "start_step": None, "status": "crashed"}])
    assert newest_proven_noting(run)[0] == run / "checkpoint-40" and resolve_last(run).chosen == run / "checkpoint-40"

    # attempt 3 continues attempt 2's line from checkpoint-40 and saves checkpoint-50 again: nothing is abandoned any more
    t3 = T2 + 1000
    write_run_json(run, [*attempts, {"started": t3, "resumed_from": str(run / "checkpoint-40"), "start_step": 40, "status": "running"}])
    assert newest_proven_noting(run) == (run / "checkpoint-40", ["passed over checkpoint-50: written before the resume from "
                                                                 "checkpoint-40 (attempt 3): a history the run went back from"])
    saved_at(run / "checkpoint-50", t3 + 100)
    assert newest_proven_noting(run) == (run / "checkpoint-50", [])
    found = resolve_last(run)
    assert (found.chosen, found.abandoned) == (run / "checkpoint-50", [])


@pytest.mark.parametrize("damage", [
    lambda path: path.unlink(),
    lambda path: path.write_text("{not json", encoding="utf-8"),
    lambda path: path.write_text(json.dumps({"attempts": "none"}), encoding="utf-8"),
], ids=["missing", "garbage", "no-attempts"])
def test_without_a_readable_run_json_the_newest_proven_checkpoint_is_named_as_before(
        tmp_path: Path, capsys: Any, monkeypatch: pytest.MonkeyPatch, damage: Any) -> None:
    run = rolled_back_run(tmp_path)
    damage(run / "harness" / "run.json")
    result = _resume_point(capsys, monkeypatch, run)
    assert (result.returncode, result.stdout.strip(), result.stderr) == (0, str(run / "checkpoint-50"), "")
    assert resolve_last(run).chosen == run / "checkpoint-50"


def test_only_abandoned_checkpoints_name_none_and_say_why(tmp_path: Path, capsys: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    run = rolled_back_run(tmp_path)
    for step in (30, 40):  # rotated away: attempt 2 has no checkpoint left, attempt 1's newer one is of another history
        shutil.rmtree(run / f"checkpoint-{step}")
    result = _resume_point(capsys, monkeypatch, run)
    assert result.returncode == 1 and result.stdout == ""
    assert "passed over checkpoint-50: written before the resume from checkpoint-30 (attempt 2)" in result.stderr
    assert "no proven checkpoint in" in result.stderr and "of the history the run's last train() call continues" in result.stderr
    found = resolve_last(run)
    assert found.chosen is None and found.skipped == [] and [p.name for p, _ in found.abandoned] == ["checkpoint-50"]


# -- no proof could be made: complete and finite (harness_checked) -----------------------------------------------------
# A model above max_model_mb, a model with no batch it accepts, a saved format that cannot be built: the checkpoint is complete
# and its weights load with finite values, but nothing is proven. resume-point names it (exit 0) and says why it is not
# proven; a proven one is still preferred, and a checkpoint with no marker (found corrupt, or never checked) never named.

NOT_PROVEN = "the reference loss: the model is 9000 MiB in fp32, above max_model_mb (4096); raise it or set check_loss: false"


def checked_checkpoint(folder: Path, step: int) -> Path:
    """A checkpoint marked harness_checked (the proof could not be made), as the checking thread writes it."""
    proven_checkpoint(folder, step)
    (folder / MARKER).unlink()
    record = {"format": CHECKED_FORMAT, "step": step, "checks": ["complete", "weights_finite", "shapes"], "not_proven": NOT_PROVEN,
              "files": file_manifest(folder)}
    (folder / CHECKED).write_text(json.dumps(record), encoding="utf-8")
    return folder


def test_with_nothing_proven_the_newest_complete_and_finite_checkpoint_is_named_with_why(
        tmp_path: Path, capsys: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    run = tmp_path / "run"
    checked_checkpoint(run / "checkpoint-90", 90)
    checked_checkpoint(run / "checkpoint-100", 100)
    result = _resume_point(capsys, monkeypatch, run)
    assert (result.returncode, result.stdout.strip()) == (0, str(run / "checkpoint-100")), result
    assert result.stderr == (f"harness resume-point: checkpoint-100 is not proven ({NOT_PROVEN}); checks passed: complete, "
                             "weights_finite, shapes; named because it is complete and its weights load with finite values, and no "
                             "checkpoint is proven.\n"), result.stderr
    assert newest_proven(run) is None  # never taken for proven (rotation keeps only proven ones)


def test_a_proven_checkpoint_is_preferred_to_a_newer_one_only_checked(tmp_path: Path, capsys: Any,
                                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    run = tmp_path / "run"
    proven_checkpoint(run / "checkpoint-90", 90)
    checked_checkpoint(run / "checkpoint-100", 100)
    result = _resume_point(capsys, monkeypatch, run)
    assert (result.returncode, result.stdout.strip()) == (0, str(run / "checkpoint-90")), result
    assert result.stderr == (f"harness resume-point: passed over checkpoint-100 for the proven checkpoint-90: checkpoint-100 is not "
                             f"proven ({NOT_PROVEN}); checks passed: complete, weights_finite, shapes.\n"), result.stderr


def test_a_checkpoint_without_a_marker_is_never_the_fallback_and_a_changed_one_is_passed_over(
        tmp_path: Path, capsys: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    run = tmp_path / "run"
    checked_checkpoint(run / "checkpoint-80", 80)
    changed = checked_checkpoint(run / "checkpoint-90", 90)
    (changed / "optimizer.pt").write_bytes(b"o" * 3)  # cut short after it was checked
    (proven_checkpoint(run / "checkpoint-100", 100) / MARKER).unlink()  # found corrupt (or never checked): no marker at all
    result = _resume_point(capsys, monkeypatch, run)
    assert (result.returncode, result.stdout.strip()) == (0, str(run / "checkpoint-80")), result
    lines = result.stderr.splitlines()
    assert lines[0] == "harness resume-point: passed over checkpoint-90: it changed since it was checked: optimizer.pt is 3 bytes, 8 when proven."
    assert lines[1].startswith("harness resume-point: checkpoint-80 is not proven (") and len(lines) == 2, lines
    (run / "checkpoint-80" / CHECKED).write_text("{broken", encoding="utf-8")
    result = _resume_point(capsys, monkeypatch, run)
    assert result.returncode == 1 and result.stdout == "" and "no proven checkpoint" in result.stderr
    assert f"passed over checkpoint-80: its marker {CHECKED} could not be read (not JSON" in result.stderr
