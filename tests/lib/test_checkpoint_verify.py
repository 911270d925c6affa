"""Completeness and weight checks on real checkpoint folders, saved once per module by a real Trainer, then damaged."""
from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file, save_file

from harness.lib.checkpoint_loss import reference_batch, take_reference
from harness.lib.checkpoint_layout import layout_problems, memory_layout
from harness.lib.checkpoint_verify import INCOMPLETE_MARKER, Layout, check_complete, expected_shapes, read_weights
from harness.lib.proof_worker import Job, prove
from harness.lib.proven import MARKER, newest_proven, read_proven, rotate


@pytest.fixture(scope="module")
def saved(tmp_path_factory: Any, tokenizer: Any, lm_rows: Any) -> dict[str, Any]:
    """One 2-step run of a real Trainer saving checkpoint-2 (no harness), with the model and a reference taken at the save."""
    from transformers import Trainer, TrainingArguments

    from harness.lib.tiny import build_tiny_llama

    out = tmp_path_factory.mktemp("saved") / "out"
    args = TrainingArguments(output_dir=str(out), max_steps=2, per_device_train_batch_size=4, report_to="none", use_cpu=True,
                             save_strategy="steps", save_steps=2, disable_tqdm=True, seed=0)
    trainer = Trainer(model=build_tiny_llama(tokenizer, seed=0), args=args, train_dataset=lm_rows)
    trainer.train()
    batch = reference_batch({k: torch.tensor([lm_rows[i][k] for i in range(2)]) for k in ("input_ids", "labels")}, 2, 32)
    return {"folder": out / "checkpoint-2", "model": trainer.model, "trainer": trainer, "batch": batch}


@pytest.fixture
def folder(saved: dict[str, Any], tmp_path: Path) -> Path:
    """A fresh copy of the saved checkpoint for one test to damage."""
    target = tmp_path / "out" / "checkpoint-2"
    shutil.copytree(saved["folder"], target)
    return target


def _job(saved: dict[str, Any], folder: Path, **kwargs: Any) -> Job:
    reference = take_reference(saved["model"], saved["trainer"], saved["batch"])
    kwargs.setdefault("wait_for_ranks", False)  # saved without the harness: no save markers to wait for
    return Job(folder.parent, folder, 2, Layout(), reference=reference, expected=expected_shapes(saved["model"]), **kwargs)


def test_a_clean_save_is_complete_and_its_weights_are_the_models(saved: dict[str, Any], folder: Path) -> None:
    assert check_complete(folder, 2, Layout()) == []
    weights = read_weights(folder, keep=False)
    assert weights.problems == [] and weights.files == ["model.safetensors"] and weights.unverified is None
    assert layout_problems(weights.shapes, [memory_layout(expected_shapes(saved["model"]))], "model.safetensors") == ([], None)


def test_prove_writes_the_marker_with_the_matching_loss(saved: dict[str, Any], folder: Path) -> None:
    rng = torch.get_rng_state()
    outcome = prove(_job(saved, folder))
    assert torch.equal(rng, torch.get_rng_state())  # the rebuild draws nothing from the training's RNG (built on meta)
    assert outcome.proven and outcome.problems == [] and outcome.unverified == []
    assert outcome.checks == ["complete", "weights_finite", "shapes", "reference_loss"]
    record = read_proven(folder)
    assert record is not None and record["step"] == 2 and record["loss_from_disk"] == pytest.approx(record["loss_at_save"], rel=1e-5)
    assert newest_proven(folder.parent) == folder


def test_a_batch_without_labels_is_compared_by_the_models_output(saved: dict[str, Any], folder: Path, tokenizer: Any) -> None:
    """DPO-style batches carry no labels: the model returns no loss, so the mean square of its logits is the reference."""
    from harness.lib.tiny import build_tiny_llama

    unlabelled = {"input_ids": saved["batch"]["input_ids"]}
    reference = take_reference(saved["model"], saved["trainer"], unlabelled)
    assert reference is not None and reference.kind == "output" and reference.loss > 0
    job = Job(folder.parent, folder, 2, Layout(), reference=reference, expected=expected_shapes(saved["model"]), wait_for_ranks=False)
    outcome = prove(job)
    assert outcome.proven and outcome.checks == ["complete", "weights_finite", "shapes", "reference_output"]
    other = build_tiny_llama(tokenizer, seed=1)
    save_file({k: v.contiguous() for k, v in other.state_dict().items()}, folder / "model.safetensors", metadata={"format": "pt"})
    (problem,) = prove(job).problems
    assert "gives the reference batch an output mean square of" in problem.what and "not the weights that were training" in problem.what


def test_a_truncated_weights_file_is_named(saved: dict[str, Any], folder: Path) -> None:
    path = folder / "model.safetensors"
    with open(path, "r+b") as handle:
        handle.truncate(path.stat().st_size // 2)
    outcome = prove(_job(saved, folder))
    assert not outcome.proven and [p.file for p in outcome.problems] == ["model.safetensors"]
    assert "does not load" in outcome.problems[0].what and not (folder / MARKER).exists()


@pytest.mark.parametrize("damage, file, what", [
    (lambda f: (f / "optimizer.pt").write_bytes(b""), "optimizer.pt", "is empty (0 bytes)"),
    (lambda f: (f / "rng_state.pth").unlink(), "rng_state.pth", "missing"),
    (lambda f: (f / "scheduler.pt").unlink(), "scheduler.pt", "missing"),
    (lambda f: (f / INCOMPLETE_MARKER).write_text("in progress"), INCOMPLETE_MARKER, "HF's in-progress marker"),
    (lambda f: (f / "trainer_state.json").unlink(), "trainer_state.json", "missing"),
    (lambda f: (f / "model.safetensors").unlink(), "model.safetensors", "no weights file"),
])
def test_what_a_save_lacks_is_named(folder: Path, damage: Any, file: str, what: str) -> None:
    damage(folder)
    problems = check_complete(folder, 2, Layout())
    assert [p.file for p in problems] == [file] and what in problems[0].what, problems


def test_save_only_model_and_several_ranks_change_what_is_required(folder: Path) -> None:
    (folder / "optimizer.pt").unlink()
    assert check_complete(folder, 2, Layout(save_only_model=True)) == []
    problems = check_complete(folder, 2, Layout(world_size=2, save_only_model=False))
    assert sorted(p.file for p in problems) == ["optimizer.pt", "rng_state_0.pth", "rng_state_1.pth"]


def test_a_nan_and_a_wrong_shape_are_named_with_the_tensor(saved: dict[str, Any], folder: Path) -> None:
    tensors = load_file(folder / "model.safetensors")
    name = next(k for k in tensors if k.endswith("o_proj.weight"))
    tensors[name] = tensors[name].clone()
    tensors[name][0, 0] = float("nan")
    save_file(tensors, folder / "model.safetensors", metadata={"format": "pt"})
    (problem,) = read_weights(folder, keep=False).problems
    assert problem.file == "model.safetensors" and f"tensor {name} has 1 non-finite" in problem.what
    tensors[name] = torch.zeros(3, 3)
    save_file(tensors, folder / "model.safetensors", metadata={"format": "pt"})
    problems, _ = layout_problems(read_weights(folder, keep=False).shapes, [memory_layout(expected_shapes(saved["model"]))], "model.safetensors")
    assert len(problems) == 1 and f"tensor {name} has shape [3, 3]" in problems[0].what


def test_other_weights_of_the_right_shapes_fail_the_loss_check(saved: dict[str, Any], folder: Path, tokenizer: Any) -> None:
    from harness.lib.tiny import build_tiny_llama

    other = build_tiny_llama(tokenizer, seed=1)  # another run's weights under this checkpoint's name: every tensor fine
    save_file({k: v.contiguous() for k, v in other.state_dict().items()}, folder / "model.safetensors", metadata={"format": "pt"})
    outcome = prove(_job(saved, folder))
    assert not outcome.proven and outcome.checks == ["complete", "weights_finite", "shapes"]
    (problem,) = outcome.problems
    assert problem.file == "model.safetensors" and "not the weights that were training" in problem.what


def _weights_of_another_family(tokenizer: Any, folder: Path, tmp_path: Path) -> None:
    """The checkpoint's model.safetensors replaced by a tiny GPT-2's, as transformers writes it (the folder otherwise kept)."""
    from harness.lib.tiny_zoo import build_tiny_model

    build_tiny_model("gpt2", tokenizer, hidden_size=32).save_pretrained(tmp_path / "gpt2")
    shutil.copyfile(tmp_path / "gpt2" / "model.safetensors", folder / "model.safetensors")


def test_another_models_weights_are_corrupt_and_resume_point_never_names_them(
        saved: dict[str, Any], folder: Path, tokenizer: Any, tmp_path: Path, capsys: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """Names that fit neither the Llama's own nor its saved format (both known) are another model's weights: before, the
    folder got harness_checked as a format the proof could not handle, and resume-point named it (exit 0)."""
    from cli_in_process import harness_in_process
    from harness.lib.proven import CHECKED

    _weights_of_another_family(tokenizer, folder, tmp_path)
    outcome = prove(_job(saved, folder))
    assert not outcome.proven and not outcome.checked and outcome.unverified == []
    (problem,) = outcome.problems
    assert problem.file == "model.safetensors" and problem.what.startswith(
        "the saved names fit none of the model's layouts (the model's own names, transformers' saved format); closest: ")
    assert problem.what.endswith("another model's weights, not those of LlamaForCausalLM"), problem.what
    assert not (folder / MARKER).exists() and not (folder / CHECKED).exists()
    point = harness_in_process(capsys, monkeypatch, "resume-point", str(folder.parent))
    assert (point.returncode, point.stdout) == (1, ""), point


def test_names_fitting_no_layout_stay_checked_when_the_saved_format_is_not_known(
        saved: dict[str, Any], folder: Path, tokenizer: Any, tmp_path: Path) -> None:
    """No transformers model to build the saved format from (a model without a config): the file may be in a format not
    known here, so it is not proven but stays the complete-and-finite fallback."""
    from harness.lib.proven import CHECKED

    _weights_of_another_family(tokenizer, folder, tmp_path)
    job = Job(folder.parent, folder, 2, Layout(), expected=expected_shapes(saved["model"]), no_loss_reason="no config",
              wait_for_ranks=False)
    outcome = prove(job)
    assert outcome.problems == [] and outcome.checked and (folder / CHECKED).is_file()
    assert outcome.unverified[0].startswith("the saved names fit none of the model's layouts (the model's own names); closest: ")


def test_sharded_and_bin_weights_are_read(saved: dict[str, Any], folder: Path) -> None:
    (folder / "model.safetensors").unlink()
    saved["model"].save_pretrained(folder, max_shard_size="100KB")
    assert (folder / "model.safetensors.index.json").is_file()
    assert prove(_job(saved, folder)).proven
    shard = sorted(folder.glob("model-*-of-*.safetensors"))[-1]
    shard.unlink()
    problems = check_complete(folder, 2, Layout())
    assert [p.file for p in problems] == [shard.name] and "named by model.safetensors.index.json" in problems[0].what
    for extra in [*folder.glob("model*.safetensors*")]:
        extra.unlink()
    torch.save(saved["model"].state_dict(), folder / "pytorch_model.bin")
    weights = read_weights(folder, keep=False)
    assert weights.files == ["pytorch_model.bin"] and weights.problems == []


def test_a_rank_that_never_finishes_leaves_it_unverified(saved: dict[str, Any], folder: Path) -> None:
    job = _job(saved, folder, rank_wait_s=0.1, wait_for_ranks=True)
    job.layout = Layout(world_size=2)
    (folder / "harness_state").mkdir()
    (folder / "harness_state" / "complete.rank-0").write_text("{}")
    outcome = prove(job)
    assert not outcome.proven and outcome.problems == [] and "rank(s) [1] did not finish" in outcome.unverified[0]
    assert outcome.loud  # a reason of this save, not of the run's format: reported as a warning


def test_rotation_keeps_the_newest_and_the_protected(tmp_path: Path) -> None:
    for step in (5, 10, 15, 20):
        (tmp_path / f"checkpoint-{step}").mkdir()
    assert rotate(tmp_path, 1, [tmp_path / "checkpoint-10"]) == [tmp_path / "checkpoint-5", tmp_path / "checkpoint-15"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["checkpoint-10", "checkpoint-20"]
    assert rotate(tmp_path, 1, []) == [tmp_path / "checkpoint-10"]
    assert rotate(tmp_path, None, []) == []


def test_a_marker_for_another_step_or_format_is_not_proof(folder: Path) -> None:
    (folder / MARKER).write_text(json.dumps({"format": "train-harness-proven/1", "step": 3}))
    assert read_proven(folder) is None and newest_proven(folder.parent) is None
    (folder / MARKER).write_text(json.dumps({"format": "train-harness-proven/1", "step": 2}))
    assert newest_proven(folder.parent) == folder


def test_a_harness_state_file_being_written_is_not_part_of_the_save(saved: dict[str, Any], folder: Path) -> None:
    """The proof may list a checkpoint while the same step is saved again: the marker's temp file, empty for a moment,
    made a good checkpoint CHECKPOINT_CORRUPT ("harness_state/.complete.rank-0.25530.tmp: is empty")."""
    state = folder / "harness_state"
    state.mkdir(exist_ok=True)
    (state / ".complete.rank-0.25530.tmp").write_bytes(b"")
    assert check_complete(folder, 2, Layout()) == []
    (state / "rank-0.json").write_bytes(b"")  # a finished state file that is empty is still a problem
    assert [p.file for p in check_complete(folder, 2, Layout())] == ["harness_state/rank-0.json"]
