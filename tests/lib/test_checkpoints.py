"""Resuming after a kill during a save: ``resume_from_checkpoint=True`` takes the last COMPLETE checkpoint and says
which folders it passed over; a resume that cannot be verified says so (``RESUME_UNCHECKED``).

Real tiny runs with saves; the kill is simulated by removing what an interrupted save would not have written, and,
in the slow test, is a real SIGKILL of a ``harness wrap`` job inside the harness's part of a save.
"""
from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path
from typing import Any

import pytest

import harness
from cli_in_process import harness_in_process
from conftest import EXAMPLE, findings_of, harness_cli, read_jsonl, torchrun, wrapped_example, write_yaml
from harness.lib.checkpoints import resolve_last
from harness.core.errors import NoCompleteCheckpointError


def _run(make_trainer: Any, out: Path, resume: Any = None, **args: Any) -> Any:
    """14 steps with checkpoints at 5 and 10 (a resumed run re-saves those after its resume point)."""
    trainer = make_trainer(output_dir=out, **{"max_steps": 14, "save_strategy": "steps", "save_steps": 5, **args})
    ctx = harness.attach(trainer)
    trainer.train(resume_from_checkpoint=resume)
    return trainer, ctx


def _resume_codes(out: Path) -> list[str]:
    return sorted({f["code"] for f in findings_of(out) if f["code"].startswith("RESUME_")})


def _attempts(out: Path) -> list[dict[str, Any]]:
    return json.loads((out / "harness" / "run.json").read_text(encoding="utf-8"))["attempts"]


def test_a_harness_save_is_marked_complete_last(make_trainer: Any, tmp_path: Path) -> None:
    out = tmp_path / "run"
    _run(make_trainer, out)
    for step in (5, 10, 14):  # the Trainer also saves at the last step
        state = out / f"checkpoint-{step}" / "harness_state"
        assert json.loads((state / "complete.rank-0").read_text()) == {"step": step, "rank": 0, "world_size": 1}
        assert (state / "complete.rank-0").stat().st_mtime_ns >= (state / "rank-0.json").stat().st_mtime_ns
        assert (state / "complete.rank-0").stat().st_mtime_ns >= (state.parent / "trainer_state.json").stat().st_mtime_ns
    assert resolve_last(out).chosen == out / "checkpoint-14"


def test_resume_skips_incomplete_checkpoint(make_trainer: Any, tmp_path: Path) -> None:
    out = tmp_path / "run"
    _run(make_trainer, out)
    shutil.rmtree(out / "checkpoint-14", ignore_errors=True)  # the run "died" during the save at 10
    (out / "checkpoint-10" / "trainer_state.json").unlink()  # HF writes it last: a kill mid-save leaves none
    trainer, ctx = _run(make_trainer, out, resume=True)  # HF alone: FileNotFoundError .../checkpoint-10/trainer_state.json
    assert ctx.resumed_from == out / "checkpoint-5"
    assert trainer.state.global_step == 14 and ctx.status == "completed"
    assert _attempts(out)[-1]["resumed_from"] == str(out / "checkpoint-5")
    (incomplete,) = findings_of(out, "CHECKPOINT_INCOMPLETE")
    assert incomplete["severity"] == "warning" and incomplete["step"] == 10
    assert "checkpoint-10" in incomplete["message"] and "trainer_state.json" in incomplete["message"]
    assert "checkpoint-5" in incomplete["message"]
    assert incomplete["evidence"]["checkpoint"] == str(out / "checkpoint-10")
    assert incomplete["evidence"]["missing"] == ["trainer_state.json"]
    assert incomplete["playbook"] == "resume#checkpoint_incomplete"
    assert _resume_codes(out) == []  # checkpoint-5 is intact: the resume from it verifies clean
    assert (out / "checkpoint-10" / "trainer_state.json").exists()  # the resumed run saved step 10 again
    assert resolve_last(out).chosen == out / "checkpoint-14" and resolve_last(out).skipped == []
    kept = out / "incomplete-checkpoint-10"  # set aside, not deleted: out of the names HF resumes from and rotates
    assert incomplete["evidence"]["renamed_to"] == str(kept) and kept.name in incomplete["message"]
    assert (kept / "model.safetensors").exists() and not (kept / "trainer_state.json").exists()


def test_the_newest_checkpoint_named_by_its_path_and_left_incomplete_resumes_from_the_last_complete(make_trainer: Any, tmp_path: Path) -> None:
    """A script that resumes by itself (HF's run_clm: ``get_last_checkpoint``) names the newest folder, which a kill during
    its save left incomplete. Before: the Trainer died on it at every rerun of the same command (ValueError: Can't find a
    valid checkpoint), with no finding and no hint."""
    out = tmp_path / "run"
    _run(make_trainer, out)
    shutil.rmtree(out / "checkpoint-14", ignore_errors=True)
    (out / "checkpoint-10" / "trainer_state.json").unlink()
    trainer, ctx = _run(make_trainer, out, resume=str(out / "checkpoint-10"))
    assert ctx.resumed_from == out / "checkpoint-5" and trainer.state.global_step == 14
    (incomplete,) = findings_of(out, "CHECKPOINT_INCOMPLETE")
    assert "resume_from_checkpoint=checkpoint-10 (the newest checkpoint folder) resumes from checkpoint-5 instead" in incomplete["message"]
    assert incomplete["evidence"]["renamed_to"] == str(out / "incomplete-checkpoint-10")
    assert _resume_codes(out) == []


@pytest.mark.slow  # a second real run; the quick tier has the newest-folder case
def test_a_named_checkpoint_set_aside_as_incomplete_resumes_from_the_last_complete(make_trainer: Any, tmp_path: Path) -> None:
    """The same command again after the resume above, or another rank that looks after rank 0 renamed the folder: the
    name is gone, its incomplete- twin is there. Every rank must judge it alike (one refusing while another resumes
    would leave that one waiting in a collective)."""
    out = tmp_path / "run"
    _run(make_trainer, out)
    shutil.rmtree(out / "checkpoint-14", ignore_errors=True)
    (out / "checkpoint-10" / "trainer_state.json").unlink()
    (out / "checkpoint-10").rename(out / "incomplete-checkpoint-10")  # as rank 0 sets it aside
    trainer, ctx = _run(make_trainer, out, resume=str(out / "checkpoint-10"))
    assert ctx.resumed_from == out / "checkpoint-5" and trainer.state.global_step == 14


@pytest.mark.slow  # a second real run; the quick tier has the newest-folder case
def test_an_older_incomplete_checkpoint_named_by_its_path_is_refused_with_the_fix(make_trainer: Any, tmp_path: Path) -> None:
    out = tmp_path / "run"
    _run(make_trainer, out)
    (out / "checkpoint-5" / "trainer_state.json").unlink()
    trainer = make_trainer(output_dir=out, max_steps=14, save_strategy="steps", save_steps=5)
    harness.attach(trainer)
    with pytest.raises(NoCompleteCheckpointError, match=r"checkpoint-5: that checkpoint is incomplete: it lacks trainer_state.json"
                                                        r".*harness resume-point"):
        trainer.train(resume_from_checkpoint=str(out / "checkpoint-5"))
    assert (out / "checkpoint-5").is_dir()  # named, not the newest: nothing renamed


def test_resume_passes_over_a_checkpoint_without_the_harness_part_of_its_save(make_trainer: Any, tmp_path: Path) -> None:
    """HF's files are all there but the kill came before the harness wrote its state: HF calls it complete, the harness not."""
    out = tmp_path / "run"
    _run(make_trainer, out, max_steps=10)
    shutil.rmtree(out / "checkpoint-10" / "harness_state")
    _, ctx = _run(make_trainer, out, resume="last", max_steps=10)
    assert ctx.resumed_from == out / "checkpoint-5"
    (incomplete,) = findings_of(out, "CHECKPOINT_INCOMPLETE")
    assert incomplete["evidence"]["missing"] == ["harness_state/rank-0.json", "harness_state/complete.rank-0"]
    assert "harness_state/rank-0.json" in incomplete["message"]
    assert _resume_codes(out) == []


def test_resume_without_harness_state_is_unchecked(make_trainer: Any, tmp_path: Path) -> None:
    out = tmp_path / "run"
    _run(make_trainer, out, max_steps=10)
    shutil.rmtree(out / "checkpoint-10" / "harness_state")
    trainer, _ = _run(make_trainer, out, resume=str(out / "checkpoint-10"))  # named: no resolution, resumed as asked
    assert trainer.state.global_step == 14
    (unchecked,) = findings_of(out, "RESUME_UNCHECKED")
    assert unchecked["severity"] == "warning" and unchecked["plugin"] == "resume_check" and unchecked["step"] == 10
    assert unchecked["evidence"] == {"checkpoint": str(out / "checkpoint-10"), "missing": str(out / "checkpoint-10" / "harness_state")}
    assert "harness_state/ is missing" in unchecked["message"] and "not compared" in unchecked["message"]
    assert unchecked["playbook"] == "resume#resume_unchecked"


def test_a_run_saved_without_the_harness_resumes_from_its_last_checkpoint_unchecked(make_trainer: Any, tmp_path: Path) -> None:
    out = tmp_path / "run"
    plain = make_trainer(output_dir=out, max_steps=10, save_strategy="steps", save_steps=5)
    plain.train()  # no harness at all: no harness_state anywhere, so none is expected
    assert not (out / "checkpoint-10" / "harness_state").exists()
    _, ctx = _run(make_trainer, out, resume=True)
    assert ctx.resumed_from == out / "checkpoint-10"
    assert findings_of(out, "CHECKPOINT_INCOMPLETE") == []
    assert [f["step"] for f in findings_of(out, "RESUME_UNCHECKED")] == [10]


def test_no_complete_checkpoint_is_a_clear_error(make_trainer: Any, tmp_path: Path) -> None:
    out = tmp_path / "run"
    _run(make_trainer, out, max_steps=5)
    (out / "checkpoint-5" / "trainer_state.json").unlink()
    trainer = make_trainer(output_dir=out, max_steps=10, save_strategy="steps", save_steps=5)
    harness.attach(trainer)
    with pytest.raises(NoCompleteCheckpointError, match=r"no complete checkpoint in .*checkpoint-5 lacks trainer_state.json"):
        trainer.train(resume_from_checkpoint=True)
    assert [f["evidence"]["checkpoint"] for f in findings_of(out, "CHECKPOINT_INCOMPLETE")] == [str(out / "checkpoint-5")]


@pytest.mark.slow  # a long end-to-end run (subprocesses or hundreds of steps): CI runs it, the quick subset does not
def test_harness_run_resume_skips_incomplete_checkpoint(tmp_path: Path, capsys: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    import yaml

    from conftest import REPO
    from harness.stages.runner import run_stage

    data = yaml.safe_load((REPO / "examples" / "pretrain.yaml").read_text())
    data["output_dir"] = str(tmp_path / "pretrain")
    for source in data["data"]["sources"]:
        source["path"] = str((REPO / "examples" / source["path"]).resolve())
    data["training"].update({"max_steps": 6, "save_steps": 2, "warmup_steps": 0})
    config = write_yaml(tmp_path / "pretrain.yaml", data)
    out = tmp_path / "pretrain"
    assert run_stage("pretrain", config) == 0
    (out / "checkpoint-6" / "trainer_state.json").unlink()
    resumed = harness_in_process(capsys, monkeypatch, "run", "pretrain", "--config", str(config), "--resume")  # HF alone: FileNotFoundError
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    (incomplete,) = findings_of(out, "CHECKPOINT_INCOMPLETE")
    assert incomplete["evidence"]["checkpoint"] == str(out / "checkpoint-6") and incomplete["evidence"]["missing"] == ["trainer_state.json"]
    assert _attempts(out)[-1]["resumed_from"] == str(out / "checkpoint-4") and _attempts(out)[-1]["status"] == "completed"
    assert _resume_codes(out) == []


KILLER = '''
"""Kills its own process with SIGKILL in on_checkpoint_save of one step: a kill during the harness's part of a save."""
import os
import signal

from harness import hookimpl


class KillInSave:
    name = "kill_in_save"

    @hookimpl
    def on_checkpoint_save(self, ctx, step, checkpoint_dir):
        if step == int(os.environ["KILL_IN_SAVE_AT"]) and not (ctx.run_dir / "killed-in-save").exists():
            (ctx.run_dir / "killed-in-save").touch()
            os.kill(os.getpid(), signal.SIGKILL)
'''


@pytest.mark.slow
def test_a_real_kill_during_a_save_then_resume_last_through_wrap(tmp_path: Path) -> None:
    (tmp_path / "killsave.py").write_text(KILLER, encoding="utf-8")
    config = write_yaml(tmp_path / "h.yaml", {"plugins": ["defaults", "killsave:KillInSave"]})
    out = tmp_path / "run"
    env = {"PYTHONPATH": str(tmp_path), "KILL_IN_SAVE_AT": "10", "DS_ACCELERATOR": "cpu"}

    def wrapped(*extra: str) -> Any:
        script = [str(EXAMPLE), "--output_dir", str(out), "--max_steps", "14", "--save_steps", "5", *extra]
        return harness_cli("wrap", "--config", str(config), "--", sys.executable, *script, env=env)

    killed = wrapped()
    assert killed.returncode == 128 + 9, killed.stderr[-3000:]  # SIGKILL inside on_save of step 10
    state = out / "checkpoint-10" / "harness_state"
    assert (out / "checkpoint-10" / "trainer_state.json").exists() and (state / "rank-0.json").exists()
    assert not (state / "complete.rank-0").exists()  # HF's part and the plugin state are there; the save did not finish
    resumed = wrapped("--resume_from_checkpoint", "last")
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    (incomplete,) = findings_of(out, "CHECKPOINT_INCOMPLETE")
    assert incomplete["evidence"]["checkpoint"] == str(out / "checkpoint-10")
    assert incomplete["evidence"]["missing"] == ["harness_state/complete.rank-0"]
    attempts = _attempts(out)
    assert attempts[-1]["resumed_from"] == str(out / "checkpoint-5") and attempts[-1]["status"] == "completed"
    assert _resume_codes(out) == []
    assert (state / "complete.rank-0").exists()  # saved again, completely, by the resumed run
    assert max(r["step"] for r in read_jsonl(out / "harness" / "metrics.jsonl") if "loss" in r) == 14


@pytest.mark.slow
def test_two_processes_each_mark_their_part_of_the_save(tmp_path: Path) -> None:
    out = tmp_path / "run"
    config = write_yaml(tmp_path / "h.yaml", {"plugins": ["defaults"], "policy": {"RESUME_DATA_POSITION": "continue"}})
    first = wrapped_example(out, config, launcher=torchrun(), steps=10, save_steps=5)
    assert first.returncode == 0, first.stderr[-3000:]
    for rank in (0, 1):
        marker = json.loads((out / "checkpoint-10" / "harness_state" / f"complete.rank-{rank}").read_text())
        assert marker == {"step": 10, "rank": rank, "world_size": 2}
    (out / "checkpoint-10" / "harness_state" / "complete.rank-1").unlink()  # rank 1 was killed before it finished
    found = resolve_last(out)
    assert found.chosen == out / "checkpoint-5" and found.skipped == [(out / "checkpoint-10", ["harness_state/complete.rank-1"])]
    resumed = wrapped_example(out, config, "--resume_from_checkpoint", "last", launcher=torchrun(), steps=10, save_steps=5)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    (incomplete,) = findings_of(out, "CHECKPOINT_INCOMPLETE")  # reported once, by rank 0; both ranks resumed from checkpoint-5
    assert incomplete["rank"] == 0 and incomplete["evidence"]["missing"] == ["harness_state/complete.rank-1"]
    assert _attempts(out)[-1]["resumed_from"] == str(out / "checkpoint-5")
    assert (out / "checkpoint-10" / "harness_state" / "complete.rank-1").exists()


@pytest.mark.parametrize(
    "files, complete",
    [
        (["model.safetensors"], True),
        (["pytorch_model-00001-of-00002.bin", "pytorch_model.bin.index.json"], True),
        (["pytorch_model_fsdp_rank0.bin"], True),  # FSDP LOCAL_STATE_DICT
        (["adapter_model.safetensors"], True),  # PEFT
        (["global_step10/"], True),  # DeepSpeed
        (["custom_weights.npz", "harness_state/complete.rank-0"], True),  # a Trainer subclass's own _save, then the harness
        (["custom_weights.npz"], False),  # unknown format, no harness marker: not provably complete
        (["training_args.bin", "optimizer.pt", "scheduler.pt"], False),  # no weights
    ],
)
def test_weights_are_recognised_in_every_format(tmp_path: Path, files: list[str], complete: bool) -> None:
    from harness.lib.checkpoints import trainer_missing

    checkpoint = tmp_path / "checkpoint-10"
    checkpoint.mkdir()
    (checkpoint / "trainer_state.json").write_text("{}")
    for name in files:
        target = checkpoint / name
        target.parent.mkdir(parents=True, exist_ok=True)
        target.mkdir() if name.endswith("/") else target.write_text("x")
    assert (trainer_missing(checkpoint) == []) is complete


def test_a_checkpoint_still_marked_incomplete_by_hf_is_passed_over(tmp_path: Path) -> None:
    """transformers' JIT checkpoint leaves ``checkpoint-is-incomplete.txt`` until its save ended; its own get_last_checkpoint
    ignores it, ``resolve_last`` (``resume_from_checkpoint=True``) must not."""
    from harness.lib.checkpoints import INCOMPLETE_MARKER

    for step in (5, 10):
        checkpoint = tmp_path / f"checkpoint-{step}"
        checkpoint.mkdir()
        (checkpoint / "trainer_state.json").write_text("{}")
        (checkpoint / "model.safetensors").write_text("x")
    (tmp_path / "checkpoint-10" / INCOMPLETE_MARKER).write_text("in progress")
    resolution = resolve_last(tmp_path)
    assert resolution.chosen == tmp_path / "checkpoint-5"
    assert [(p.name, INCOMPLETE_MARKER in " ".join(why)) for p, why in resolution.skipped] == [("checkpoint-10", True)]


def test_resume_true_after_going_back_takes_the_newest_checkpoint_of_the_current_history(make_trainer: Any, tmp_path: Path,
                                                                                        capsys: Any, monkeypatch: Any,
                                                                                        caplog: Any) -> None:
    """Attempt 1 saved 5, 10 and 14; attempt 2 resumed from checkpoint-5 (a rollback by hand) and saved checkpoint-7. The
    newest folder by name, checkpoint-14, is of the history attempt 2 went back from: resume_from_checkpoint=True (what the
    stage runner's --resume passes) and `harness resume-point` take checkpoint-7, and leave the older line's folders be."""
    import os

    out = tmp_path / "run"
    _run(make_trainer, out)
    for step in (5, 10, 14):  # attempt 1 was killed and relaunched a minute later (in this process it is milliseconds)
        state = out / f"checkpoint-{step}" / "trainer_state.json"
        os.utime(state, (state.stat().st_atime - 60, state.stat().st_mtime - 60))
    _run(make_trainer, out, resume=str(out / "checkpoint-5"), max_steps=7)  # ends at 7 with its last save
    assert (out / "checkpoint-7").is_dir() and _attempts(out)[-1]["start_step"] == 5

    found = resolve_last(out)
    assert found.chosen == out / "checkpoint-7" and found.skipped == []
    assert [p.name for p, _ in found.abandoned] == ["checkpoint-14", "checkpoint-10"]
    point = harness_in_process(capsys, monkeypatch, "resume-point", str(out))
    assert (point.returncode, point.stdout.strip()) == (0, str(out / "checkpoint-7")), point
    assert "passed over checkpoint-14: written before the resume from checkpoint-5 (attempt 2): a history the run went back " \
           "from" in point.stderr, point.stderr

    caplog.set_level("WARNING", logger="harness")
    trainer, ctx = _run(make_trainer, out, resume=True, max_steps=9)
    assert ctx.resumed_from == out / "checkpoint-7" and _attempts(out)[-1]["resumed_from"] == str(out / "checkpoint-7")
    said = [r.getMessage() for r in caplog.records if "passed over checkpoint-" in r.getMessage()]
    assert said == ["harness: resume_from_checkpoint=True passed over checkpoint-14: written before the resume from checkpoint-5 "
                    "(attempt 2): a history the run went back from.",
                    "harness: resume_from_checkpoint=True passed over checkpoint-10: written before the resume from checkpoint-5 "
                    "(attempt 2): a history the run went back from."], said
    assert trainer.state.global_step == 9 and ctx.status == "completed"
    assert findings_of(out, "CHECKPOINT_INCOMPLETE") == []  # passed over, not taken for a broken save
    assert (out / "checkpoint-10").is_dir() and (out / "checkpoint-14").is_dir()  # nothing renamed or deleted


def test_a_checkpoint_saved_again_by_fewer_processes_drops_the_wider_run_s_harness_state(tmp_path: Path) -> None:
    """A 2-rank run saved checkpoint-15; a 1-process resume from checkpoint-10 saves checkpoint-15 again into the same folder:
    rank 1's state and marker of the first save must not pass for the second's. The Trainer's own files stay."""
    from harness.lib.checkpoints import STATE_DIR, drop_other_ranks

    state = tmp_path / "checkpoint-15" / STATE_DIR
    state.mkdir(parents=True)
    for name in ("rank-0.json", "rank-1.json", "complete.rank-0", "complete.rank-1", "rank-10.json", "notes.txt"):
        (state / name).write_text("{}")
    (tmp_path / "checkpoint-15" / "rng_state_1.pth").write_bytes(b"x")
    outside = tmp_path / "outside.json"
    outside.write_text("keep")
    (state / "rank-2.json").symlink_to(outside)
    assert sorted(drop_other_ranks(tmp_path / "checkpoint-15", 1)) == ["complete.rank-1", "rank-1.json", "rank-10.json", "rank-2.json"]
    assert sorted(p.name for p in state.iterdir()) == ["complete.rank-0", "notes.txt", "rank-0.json"]
    assert outside.read_text() == "keep" and (tmp_path / "checkpoint-15" / "rng_state_1.pth").exists()
    assert drop_other_ranks(tmp_path / "missing", 1) == []


def _linked_state(checkpoint: Path, outside: Path) -> None:
    """``<checkpoint>/harness_state`` made a link to a folder outside the run (a received run is data), holding files of
    the names the harness writes and removes there."""
    from harness.lib.checkpoints import STATE_DIR

    outside.mkdir()
    for name in ("rank-0.json", "rank-1.json", "complete.rank-1", "notes.txt"):
        (outside / name).write_text("keep")
    checkpoint.mkdir(parents=True)
    (checkpoint / STATE_DIR).symlink_to(outside, target_is_directory=True)


def test_a_linked_state_folder_is_neither_listed_nor_emptied_through(tmp_path: Path) -> None:
    """``drop_other_ranks`` listed ``harness_state`` through a link and unlinked rank-1.json there: a file outside the
    run directory was deleted. A link is left alone now; a link inside the folder is removed, never followed."""
    from harness.lib.checkpoints import drop_other_ranks

    outside = tmp_path / "elsewhere"
    _linked_state(tmp_path / "run" / "checkpoint-15", outside)
    assert drop_other_ranks(tmp_path / "run" / "checkpoint-15", 1) == []
    assert sorted(p.name for p in outside.iterdir()) == ["complete.rank-1", "notes.txt", "rank-0.json", "rank-1.json"]
    assert all(p.read_text() == "keep" for p in outside.iterdir())


def test_the_harness_save_is_not_written_through_a_linked_state_folder(make_trainer: Any, tmp_path: Path) -> None:
    """A run directory whose ``checkpoint-5/harness_state`` is a link to another folder: the save wrote rank-0.json and
    its completion marker there, and dropped the wider run's rank-1 files there. Nothing outside is touched now; the save
    is not marked complete for the harness, and says why."""
    from harness.lib.checkpoints import write_marker, write_state_file
    from harness.lib.safe_paths import UnsafePathError

    out, outside = tmp_path / "run", tmp_path / "elsewhere"
    _linked_state(out / "checkpoint-5", outside)
    for write in (lambda: write_state_file(out / "checkpoint-5", "rank-0.json", "{}"), lambda: write_marker(out / "checkpoint-5", 0, 1, 5)):
        with pytest.raises(UnsafePathError):
            write()
    trainer, ctx = _run(make_trainer, out, max_steps=5)
    assert trainer.state.global_step == 5 and (out / "checkpoint-5" / "trainer_state.json").is_file()
    assert sorted(p.name for p in outside.iterdir()) == ["complete.rank-1", "notes.txt", "rank-0.json", "rank-1.json"]
    assert all(p.read_text() == "keep" for p in outside.iterdir())
    (said,) = findings_of(out, "HARNESS_STATE_NOT_SAVED")  # said as a finding (it was one stderr line)
    assert said["step"] == 5 and "could not write its plugin state" in said["message"] and "symlink" in said["message"], said


def test_the_proof_of_a_save_with_a_linked_state_folder_says_so_without_waiting_for_markers(make_trainer: Any, tmp_path: Path) -> None:
    """No marker can come through a refused link: the proof says why at once (it waited rank_wait_s, 120 s, before)."""
    out, outside = tmp_path / "run", tmp_path / "elsewhere"
    _linked_state(out / "checkpoint-5", outside)
    _run(make_trainer, out, max_steps=5)
    said = [f for f in findings_of(out) if f["plugin"] == "checkpoint_proof" and f["step"] == 5]
    assert said and all("folder is a link" in f["message"] for f in said), said
