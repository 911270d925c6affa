"""checkpoint_proof on real runs: a clean run proves every checkpoint silently; a truncated weights file is
CHECKPOINT_CORRUPT naming the file; with ``save_total_limit: 1`` the last proven checkpoint survives a corrupt newer one."""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

import harness
from conftest import FAULTS, findings_of, harness_cli
from harness.lib.proven import CHECKED, MARKER


def _run(make_trainer: Any, tmp_path: Path, options: dict[str, Any] | None = None, faults: dict[str, Any] | None = None,
         **args: Any) -> tuple[Path, Any]:
    out = tmp_path / "out"
    trainer = make_trainer(output_dir=out, **{"max_steps": 10, "save_strategy": "steps", "save_steps": 5, **args})
    config: dict[str, Any] = {"plugins": ["defaults", FAULTS], "fault_injector": faults or {}}
    if options:
        config["checkpoint_proof"] = options
    ctx = harness.attach(trainer, config=config)
    trainer.train()
    return out, ctx.manager.plugin("checkpoint_proof")


def _checkpoints(out: Path) -> list[str]:
    return sorted((p.name for p in out.glob("checkpoint-*")), key=lambda n: int(n.split("-")[1]))


def test_a_clean_run_proves_every_checkpoint_and_says_nothing(make_trainer: Any, tmp_path: Path, capsys: Any) -> None:
    out, plugin = _run(make_trainer, tmp_path)
    assert [f for f in findings_of(out) if f["severity"] != "info"] == []
    assert findings_of(out, "CHECKPOINT_UNVERIFIED") == [] and findings_of(out, "CHECKPOINT_CORRUPT") == []
    assert _checkpoints(out) == ["checkpoint-5", "checkpoint-10"]
    for name in _checkpoints(out):
        record = json.loads((out / name / MARKER).read_text())
        assert record["checks"] == ["complete", "weights_finite", "shapes", "reference_loss"] and record["step"] == int(name[11:])
        assert abs(record["loss_from_disk"] - record["loss_at_save"]) <= 1e-4 * record["loss_at_save"]
    assert [t["step"] for t in plugin.timings] == [5, 10]  # each checked in the background, its cost measured
    result = harness_cli("resume-point", str(out))
    assert result.returncode == 0 and result.stdout.strip() == str(out / "checkpoint-10")
    # files a resume needs removed (or cut short) after the proof: that checkpoint is passed over, and said why
    record = json.loads((out / "checkpoint-10" / MARKER).read_text())
    assert {"model.safetensors", "optimizer.pt", "scheduler.pt", "trainer_state.json"} <= set(record["files"])
    (out / "checkpoint-10" / "optimizer.pt").unlink()
    with open(out / "checkpoint-10" / "scheduler.pt", "ab") as handle:
        handle.write(b"x")
    from harness.cli import main as harness_main

    capsys.readouterr()  # the run's own output
    assert harness_main(["resume-point", str(out)]) == 0
    captured = capsys.readouterr()
    assert captured.out.strip() == str(out / "checkpoint-5"), captured.out
    assert "passed over checkpoint-10: it changed since it was proven: optimizer.pt is missing; scheduler.pt is" in captured.err, captured.err


def test_a_truncated_weights_file_is_corrupt_and_the_proven_one_survives_rotation(make_trainer: Any, tmp_path: Path) -> None:
    out, _ = _run(make_trainer, tmp_path, faults={"truncate_checkpoint_at_step": 10}, save_total_limit=1)
    (corrupt,) = findings_of(out, "CHECKPOINT_CORRUPT")
    assert corrupt["severity"] == "error" and corrupt["step"] == 10 and corrupt["plugin"] == "checkpoint_proof"
    assert corrupt["evidence"]["files"] == ["model.safetensors"] and "model.safetensors: does not load" in corrupt["message"]
    assert corrupt["evidence"]["last_proven"] == str(out / "checkpoint-5")
    # the Trainer's own rotation (limit 1) would have deleted checkpoint-5 in the save of checkpoint-10
    assert _checkpoints(out) == ["checkpoint-5", "checkpoint-10"]
    assert (out / "checkpoint-5" / MARKER).is_file() and not (out / "checkpoint-10" / MARKER).exists()
    result = harness_cli("resume-point", str(out))
    assert result.returncode == 0 and result.stdout.strip() == str(out / "checkpoint-5")
    assert findings_of(out, "CHECKPOINT_UNVERIFIED") == []


def test_rotation_still_rotates_once_a_newer_checkpoint_is_proven(make_trainer: Any, tmp_path: Path) -> None:
    out, _ = _run(make_trainer, tmp_path, save_total_limit=1, max_steps=15)
    assert _checkpoints(out) == ["checkpoint-15"] and (out / "checkpoint-15" / MARKER).is_file()
    assert [f for f in findings_of(out) if f["severity"] != "info"] == []


def test_a_check_that_cannot_run_is_unverified_once_and_resume_point_falls_back_to_complete_and_finite(
        make_trainer: Any, tmp_path: Path) -> None:
    """No proof can be made (the model is above max_model_mb): nothing is proven, but the checkpoints are complete with
    finite weights (harness_checked), so resume-point names the newest, saying why it is not proven (it exited 1)."""
    out, _ = _run(make_trainer, tmp_path, options={"max_model_mb": 0.001})
    (unverified,) = findings_of(out, "CHECKPOINT_UNVERIFIED")  # one per reason per run, not one per save
    assert unverified["severity"] == "info" and unverified["step"] == 5 and "above max_model_mb" in unverified["message"]
    assert unverified["evidence"]["checks_passed"] == ["complete", "weights_finite", "shapes"]
    assert "harness_checked, which `harness resume-point` names when no checkpoint is proven" in unverified["message"]
    assert not any((out / name / MARKER).exists() for name in _checkpoints(out))
    record = json.loads((out / "checkpoint-10" / CHECKED).read_text())
    assert record["checks"] == ["complete", "weights_finite", "shapes"] and "above max_model_mb" in record["not_proven"]
    result = harness_cli("resume-point", str(out))
    assert result.returncode == 0 and result.stdout.strip() == str(out / "checkpoint-10"), result
    assert "checkpoint-10 is not proven (the reference loss: the model is 1 MiB in fp32, above max_model_mb (0.001)" in result.stderr
    assert "named because it is complete and its weights load with finite values, and no checkpoint is proven" in result.stderr


def test_without_keep_proven_the_trainer_rotates_the_proven_one_away(make_trainer: Any, tmp_path: Path) -> None:
    """The control: the same corrupt save with the Trainer's own rotation leaves nothing a resume can trust."""
    out, _ = _run(make_trainer, tmp_path, options={"keep_proven": False}, faults={"truncate_checkpoint_at_step": 10}, save_total_limit=1)
    assert _checkpoints(out) == ["checkpoint-10"] and len(findings_of(out, "CHECKPOINT_CORRUPT")) == 1
    assert harness_cli("resume-point", str(out)).returncode == 1


def test_a_resume_keeps_the_proof_of_the_attempt_before_and_the_folder_it_writes(make_trainer: Any, tmp_path: Path) -> None:
    """Across a resume with ``save_total_limit: 1``: the checkpoint the earlier attempt proved survives the resumed run's
    corrupt save; a resume from it that saves below the highest step on disk keeps what it wrote; a save into a folder
    that was proven before drops the old marker first; the arguments file keeps the script's limit."""
    out = tmp_path / "out"

    def attempt(max_steps: int, save_steps: int, resume: str | None, faults: dict[str, Any] | None = None) -> None:
        trainer = make_trainer(output_dir=out, max_steps=max_steps, save_strategy="steps", save_steps=save_steps, save_total_limit=1)
        harness.attach(trainer, config={"plugins": ["defaults", FAULTS], "fault_injector": faults or {}})
        trainer.train(resume_from_checkpoint=resume)

    attempt(5, 5, None)
    assert _checkpoints(out) == ["checkpoint-5"] and (out / "checkpoint-5" / MARKER).is_file()
    attempt(10, 5, str(out / "checkpoint-5"), {"truncate_checkpoint_at_step": 10})  # the new attempt's only save is corrupt
    assert _checkpoints(out) == ["checkpoint-5", "checkpoint-10"]
    assert harness_cli("resume-point", str(out)).stdout.strip() == str(out / "checkpoint-5")
    attempt(8, 4, str(out / "checkpoint-5"))  # saves checkpoint-8, below the corrupt checkpoint-10
    assert "checkpoint-8" in _checkpoints(out) and (out / "checkpoint-8" / MARKER).is_file()
    assert harness_cli("resume-point", str(out)).stdout.strip() == str(out / "checkpoint-8")
    import torch

    assert torch.load(out / "checkpoint-8" / "training_args.bin", weights_only=False).save_total_limit == 1

    (out / "checkpoint-8" / MARKER).write_text((out / "checkpoint-8" / MARKER).read_text())  # proven; now saved over, torn
    from harness.lib.proven import forget_proof

    forget_proof(out, out / "checkpoint-8")
    assert not (out / "checkpoint-8" / MARKER).exists()


@pytest.mark.slow  # a real run beyond the quick tier's per-test budget
def test_a_save_after_nan_steps_takes_a_reference_batch_that_compares(make_trainer: Any, tmp_path: Path) -> None:
    """Three NaN batches in a row stop the run at step 7 with a save: the newest batch, the reference a first save took,
    gives NaN with any weights. The proof takes an older batch with a finite loss and proves the checkpoint; before, it
    compared NaN with the loss from disk and called a good checkpoint corrupt, and resume-point found none."""
    out, _ = _run(make_trainer, tmp_path, faults={"nan_batch_at_steps": [5, 6, 7]}, max_steps=20, save_steps=10)
    assert findings_of(out, "CHECKPOINT_CORRUPT") == []
    assert _checkpoints(out) == ["checkpoint-7"]
    record = json.loads((out / "checkpoint-7" / MARKER).read_text())
    assert "reference_loss" in record["checks"] and abs(record["loss_from_disk"] - record["loss_at_save"]) <= 1e-4 * record["loss_at_save"]
    result = harness_cli("resume-point", str(out))
    assert result.returncode == 0 and result.stdout.strip() == str(out / "checkpoint-7")
