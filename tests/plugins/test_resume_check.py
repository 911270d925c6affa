"""resume_check: each thing a resume can fail to restore is named, and a broken resume does not train on.

Every case trains with saves, is interrupted past a checkpoint (or killed, through
``harness wrap``), breaks one part of the checkpoint the way it happens in the
field, and resumes.
"""
from __future__ import annotations

import json
import shutil
from collections import Counter
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file, save_file

import harness
from conftest import FAULTS, REPO, findings_of, read_jsonl, torchrun, wrapped_example, write_yaml
from harness.lib.fingerprints import differing, param_tensors, tensor_sums
from harness.lib.ledger import read_ledger
from harness.lib.stops import EXIT_STOPPED


def _resume_codes(output_dir: Any) -> list[tuple[str, int]]:
    return [(f["code"], f["step"]) for f in findings_of(output_dir) if f["code"].startswith(("RESUME_", "DATA_"))]


def _interrupted(make_trainer: Any, out: Path) -> None:
    """A run that got to step 14 with checkpoints at 5 and 10, as if it had died at 14."""
    first = make_trainer(output_dir=out, max_steps=14, save_strategy="steps", save_steps=5, seed=0)
    harness.attach(first)
    first.train()


def _resume(make_trainer: Any, out: Path, **args: Any) -> Any:
    trainer = make_trainer(output_dir=out, max_steps=14, save_strategy="steps", save_steps=5, **args)
    harness.attach(trainer)
    trainer.train(resume_from_checkpoint=str(out / "checkpoint-10"))
    return trainer


def test_a_correct_resume_is_silent_and_continues_the_curve(make_trainer: Any, tmp_path: Path) -> None:
    out = tmp_path / "run"
    _interrupted(make_trainer, out)
    before = {r["step"]: r["loss"] for r in read_jsonl(out / "harness" / "metrics.jsonl") if "loss" in r}
    _resume(make_trainer, out)
    assert _resume_codes(out) == []
    after = [r for r in read_jsonl(out / "harness" / "metrics.jsonl") if "loss" in r]
    resumed = {r["step"]: r["loss"] for r in after[len(before):]}
    assert sorted(resumed) == [11, 12, 13, 14]
    for step, loss in resumed.items():  # the resumed run retraces the interrupted one
        assert loss == pytest.approx(before[step], rel=1e-4)
    state = __import__("json").loads((out / "checkpoint-10" / "harness_state" / "rank-0.json").read_text())["resume_check"]
    assert state["step"] == 10 and state["reference"]["loss"] > 0 and len(state["loss_window"]) == 10


def test_a_missing_optimizer_state_stops_before_the_first_update(make_trainer: Any, tmp_path: Path) -> None:
    out = tmp_path / "run"
    _interrupted(make_trainer, out)
    (out / "checkpoint-10" / "optimizer.pt").unlink()
    saved = load_file(str(out / "checkpoint-10" / "model.safetensors"))
    trainer = _resume(make_trainer, out)
    (finding,) = findings_of(out, "RESUME_OPTIMIZER_NOT_RESTORED")
    assert finding["step"] == 10 and finding["action"] == "stop" and "empty" in finding["message"]
    assert trainer.state.global_step == 11  # the first step ran its forward pass; its update did not happen
    now = param_tensors(trainer.model)
    assert all(torch.equal(now[name], saved[name]) for name in saved if name in now)


def test_a_missing_scheduler_state(make_trainer: Any, tmp_path: Path) -> None:
    out = tmp_path / "run"
    _interrupted(make_trainer, out)
    (out / "checkpoint-10" / "scheduler.pt").unlink()
    _resume(make_trainer, out)
    (finding,) = findings_of(out, "RESUME_SCHEDULER_MISMATCH")
    assert finding["evidence"]["saved"]["last_epoch"] == 10 and finding["evidence"]["now"]["last_epoch"] == 0


def test_missing_rng_state(make_trainer: Any, tmp_path: Path) -> None:
    out = tmp_path / "run"
    _interrupted(make_trainer, out)
    for rng in (out / "checkpoint-10").glob("rng_state*.pth"):
        rng.unlink()
    _resume(make_trainer, out, seed=1)
    (finding,) = findings_of(out, "RESUME_RNG_NOT_RESTORED")
    assert finding["step"] == 11 and "torch_cpu" in finding["evidence"]["streams"]


def test_an_altered_weight_in_the_saved_model(make_trainer: Any, tmp_path: Path) -> None:
    out = tmp_path / "run"
    _interrupted(make_trainer, out)
    path = out / "checkpoint-10" / "model.safetensors"
    weights = load_file(str(path))
    name = next(n for n in weights if n.endswith("layers.1.mlp.down_proj.weight"))
    weights[name] *= 1.5
    save_file(weights, str(path), metadata={"format": "pt"})
    trainer = _resume(make_trainer, out)
    (finding,) = findings_of(out, "RESUME_MODEL_MISMATCH")
    assert finding["evidence"]["tensors"] == [name] and finding["action"] == "stop" and finding["severity"] == "critical"
    (jump,) = findings_of(out, "RESUME_LOSS_JUMP")
    assert jump["evidence"]["source"] == "reference batch"
    assert trainer.state.global_step == 11


def test_without_data_hash_the_data_position_is_reported_unchecked_once(make_trainer: Any, tmp_path: Path) -> None:
    out = tmp_path / "run"
    config = {"disable": ["data_hash"], "policy": {"RESUME_DATA_POSITION": "continue"}}
    first = make_trainer(output_dir=out, max_steps=14, save_strategy="steps", save_steps=5, seed=0)
    harness.attach(first, config=config)
    first.train()
    trainer = make_trainer(output_dir=out, max_steps=14, save_strategy="steps", save_steps=5, ignore_data_skip=True)
    harness.attach(trainer, config=config)
    trainer.train(resume_from_checkpoint=str(out / "checkpoint-10"))
    (unchecked,) = findings_of(out, "RESUME_UNCHECKED")  # not silent, and said once (not per step or micro-batch)
    assert "data position" in unchecked["message"] and "data_hash" in unchecked["message"]
    assert unchecked["evidence"]["missing"] == ["data_hash"] and unchecked["plugin"] == "resume_check"
    assert findings_of(out, "RESUME_DATA_POSITION") == [] and trainer.state.global_step == 14  # nothing to compare with: trains on


def test_a_new_learning_rate_is_ignored_when_the_scheduler_is_restored(make_trainer: Any, tmp_path: Path) -> None:
    out = tmp_path / "run"
    _interrupted(make_trainer, out)  # learning_rate 1e-3, linear decay over 14 steps
    _resume(make_trainer, out, learning_rate=4e-3)
    (finding,) = findings_of(out, "LR_CHANGE_IGNORED_ON_RESUME")
    ev = finding["evidence"]
    assert finding["step"] == 11 and ev["winner"] == "restored" and ev["restored_base_lr"] == pytest.approx(1e-3)
    assert ev["applied_lr"] == pytest.approx(1e-3 * 4 / 14) and ev["configured_would_give"] == pytest.approx(4e-3 * 4 / 14)
    assert findings_of(out, "RESUME_CONFIG_CHANGED") == []  # the one change is named once, by the finding that says it is not in effect


class _NewPeak:
    """The playbook's fix: after the Trainer restored scheduler.pt, put the configured LR into the restored schedule."""

    def __new__(cls) -> Any:
        from transformers import TrainerCallback

        class NewPeak(TrainerCallback):
            def on_train_begin(self, args: Any, state: Any, control: Any, lr_scheduler: Any = None, optimizer: Any = None, **kw: Any) -> None:
                lr_scheduler.base_lrs = [args.learning_rate] * len(lr_scheduler.base_lrs)
                for group, factor in zip(optimizer.param_groups, lr_scheduler.lr_lambdas):
                    group["initial_lr"], group["lr"] = args.learning_rate, args.learning_rate * factor(lr_scheduler.last_epoch)

        return NewPeak()


def test_a_new_learning_rate_put_into_the_restored_schedule_is_in_effect(make_trainer: Any, tmp_path: Path) -> None:
    out = tmp_path / "run"
    _interrupted(make_trainer, out)
    _resume(make_trainer, out, learning_rate=4e-3, callbacks=[_NewPeak()])
    assert findings_of(out, "LR_CHANGE_IGNORED_ON_RESUME") == []
    (changed,) = findings_of(out, "RESUME_CONFIG_CHANGED")
    assert "learning_rate 0.001 -> 0.004 (in effect" in changed["message"] and changed["step"] == 10
    assert changed["evidence"]["learning_rate"]["applied_lr"] == pytest.approx(4e-3 * 4 / 14)
    assert findings_of(out, "LR_SCHEDULE_MISMATCH") == []


def test_without_scheduler_pt_a_new_learning_rate_takes_effect_but_adam_restarts(make_trainer: Any, tmp_path: Path) -> None:
    """HF loads optimizer.pt only together with scheduler.pt: deleting scheduler.pt is no way to change the LR."""
    out = tmp_path / "run"
    _interrupted(make_trainer, out)
    (out / "checkpoint-10" / "scheduler.pt").unlink()
    _resume(make_trainer, out, learning_rate=4e-3)
    assert findings_of(out, "LR_CHANGE_IGNORED_ON_RESUME") == []
    (changed,) = findings_of(out, "RESUME_CONFIG_CHANGED")
    assert "(in effect: the first update after the resume used 0.004)" in changed["message"]
    assert findings_of(out, "RESUME_OPTIMIZER_NOT_RESTORED") and findings_of(out, "RESUME_SCHEDULER_MISMATCH")


def test_one_changed_element_changes_the_fingerprint() -> None:
    weights = {"w": torch.randn(64, 64)}
    saved = tensor_sums(weights)
    weights["w"][3, 7] = torch.nextafter(weights["w"][3, 7], torch.tensor(10.0))  # one ulp
    assert differing(saved, tensor_sums(weights)) == ["w"]
    assert differing(saved, tensor_sums({})) == ["w"]


def test_ignore_data_skip_is_a_wrong_data_position(make_trainer: Any, tmp_path: Path) -> None:
    out = tmp_path / "run"
    _interrupted(make_trainer, out)
    _resume(make_trainer, out, ignore_data_skip=True)
    (position,) = findings_of(out, "RESUME_DATA_POSITION")
    assert position["step"] == 11 and position["action"] == "stop"
    assert findings_of(out, "DATA_REPEATED")[0]["step"] == 11


def test_the_same_samples_in_smaller_micro_batches_are_the_same_data_position(make_trainer: Any, tmp_path: Path) -> None:
    """Resumed with the per-device batch halved and accumulation doubled (a common way to save memory): every step
    trains the same samples in the same order, in two micro-batches. The check compared one hash per (step,
    micro-batch) and stopped the run with RESUME_DATA_POSITION; it compares each step's samples in order now."""
    out = tmp_path / "run"
    _interrupted(make_trainer, out)
    _resume(make_trainer, out, per_device_train_batch_size=2, gradient_accumulation_steps=2)
    codes = _resume_codes(out)
    assert [c for c in codes if c[0] != "RESUME_CONFIG_CHANGED"] == [], codes
    assert ("RESUME_CONFIG_CHANGED", 11) in codes or ("RESUME_CONFIG_CHANGED", 10) in codes, codes  # the change itself is said


def test_a_correct_resume_after_a_wrong_one_the_harness_stopped_is_silent(make_trainer: Any, tmp_path: Path) -> None:
    """The wrong resume (ignore_data_skip) is stopped at its first step; its ledger holds that step's wrong batch. The
    next, correct resume from the same checkpoint was compared with that batch (the newest attempt's) and stopped as
    well; it is compared with the continuation of the attempt that saved the checkpoint now."""
    out = tmp_path / "run"
    _interrupted(make_trainer, out)
    _resume(make_trainer, out, ignore_data_skip=True)
    (stopped,) = findings_of(out, "RESUME_DATA_POSITION")
    assert stopped["step"] == 11 and stopped["action"] == "stop"
    before = len(findings_of(out))
    _resume(make_trainer, out)
    added = [(f["code"], f["step"]) for f in findings_of(out)[before:] if f["severity"] in ("warning", "error", "critical")]
    assert added == [], added
    # the stopped one's evidence: its first sample (the epoch's first, as ignore_data_skip starts over) is none the
    # interrupted run trained after the checkpoint
    assert stopped["evidence"]["first_different"] == 0 and stopped["evidence"]["interrupted_run_step_of_first_different"] is None
    assert "its sample 0 is none the interrupted run trained after the checkpoint" in stopped["message"], stopped["message"]


def test_a_resume_into_a_new_output_dir_is_checked_against_the_saving_run(make_trainer: Any, tmp_path: Path) -> None:
    """Resuming another output_dir's checkpoint starts a run directory without a ledger: the data position went
    unchecked and a wrong one (the loader started the epoch over) passed as healthy. The saving run's ledger, beside
    the checkpoint, says what it trained next."""
    source, new = tmp_path / "first", tmp_path / "second"
    _interrupted(make_trainer, source)
    trainer = make_trainer(output_dir=new, max_steps=14, save_strategy="steps", save_steps=5, ignore_data_skip=True)
    harness.attach(trainer)
    trainer.train(resume_from_checkpoint=str(source / "checkpoint-10"))
    (position,) = findings_of(new, "RESUME_DATA_POSITION")
    assert position["step"] == 11 and position["action"] == "stop"
    correct = make_trainer(output_dir=tmp_path / "third", max_steps=14, save_strategy="steps", save_steps=5)
    harness.attach(correct)
    correct.train(resume_from_checkpoint=str(source / "checkpoint-10"))
    assert _resume_codes(tmp_path / "third") == [] and correct.state.global_step == 14


def _as_two_ranks(out: Path) -> None:
    """Rewrite a 1 x 4 run as the 2 x 2 run that trains the same samples at the same steps would have left it: each step's
    4 samples split over ``rank-0`` and ``rank-1`` ledgers (the distributed loader gives rank r the r-th half), and the
    checkpoint's state saved with 2 processes x 2 per device (the global batch, 4, is the same)."""
    ledger = out / "harness" / "ledger"
    ranks: dict[int, list[str]] = {0: [], 1: []}
    for record in read_jsonl(ledger / "rank-0.jsonl"):
        for rank, lines in ranks.items():
            if record.get("event") == "start":
                lines.append(json.dumps({**record, "world_size": 2}))
                continue
            half = len(record["sample_hashes"]) // 2
            cut = slice(rank * half, (rank + 1) * half)
            ids = record["sample_ids"][cut] if record["sample_ids"] else None
            lines.append(json.dumps({**record, "sample_hashes": record["sample_hashes"][cut], "sample_ids": ids}))
    for rank, lines in ranks.items():
        (ledger / f"rank-{rank}.jsonl").write_text("".join(line + "\n" for line in lines), encoding="utf-8")
    path = out / "checkpoint-10" / "harness_state" / "rank-0.json"
    state = json.loads(path.read_text(encoding="utf-8"))
    state["resume_check"]["world_size"] = 2
    state["resume_check"]["config"]["per_device_train_batch_size"] = 2
    path.write_text(json.dumps(state), encoding="utf-8")


def test_a_resume_on_another_world_size_compares_each_step_as_one_set_over_all_ranks(make_trainer: Any, tmp_path: Path) -> None:
    """Saved by 2 processes x 2 per device, resumed on 1 x 4 (the global batch kept, as RESUME_WORLD_SIZE_CHANGED's
    playbook advises): step 11 trains exactly the 4 samples both ranks trained there. Rank 0's ledger alone was taken
    for the whole step and RESUME_DATA_POSITION (error) stopped the run at its sample 2. Now the step's samples are one
    set, the resume trains on, and the world-size change is said at info. A wrong resume, 1 x 2 (the global batch
    halved), is still stopped, with the world-size change named as its cause."""
    out = tmp_path / "run"
    _interrupted(make_trainer, out)
    _as_two_ranks(out)
    before = len(findings_of(out))
    trainer = _resume(make_trainer, out)
    added = findings_of(out)[before:]
    assert trainer.state.global_step == 14
    assert [(f["code"], f["severity"]) for f in added if f["code"].startswith(("RESUME_", "DATA_"))] == [
        ("RESUME_WORLD_SIZE_CHANGED", "info")], added  # no RESUME_CONFIG_CHANGED: the per-device batch keeps the global one
    (changed,) = [f for f in added if f["code"] == "RESUME_WORLD_SIZE_CHANGED"]
    assert changed["evidence"]["saved_global_batch"] == changed["evidence"]["global_batch"] == 4
    assert "keeping the global batch" in changed["message"]

    before = len(findings_of(out))
    wrong = _resume(make_trainer, out, per_device_train_batch_size=2)
    (position,) = [f for f in findings_of(out)[before:] if f["code"] == "RESUME_DATA_POSITION"]
    assert position["step"] == 11 and position["action"] == "stop" and wrong.state.global_step == 11
    assert position["evidence"]["interrupted_run_samples_at_step"] == 4 and position["evidence"]["interrupted_run_world_size"] == 2
    assert position["evidence"]["cause"] == "world_size_changed"
    assert (position["evidence"]["saved_global_batch"], position["evidence"]["global_batch"]) == (4, 2)
    message = position["message"]
    assert "The cause is the world-size change: 2 processes x 2 per device x 1 accumulation = global batch 4 then" in message
    assert "the 10 steps before the checkpoint are 20 samples now and were 40" in message
    assert "--per_device_train_batch_size 4 with --gradient_accumulation_steps 1" in message, message


@pytest.mark.slow  # a long end-to-end run (subprocesses or hundreds of steps): CI runs it, the quick subset does not
def test_a_long_ledger_over_five_epochs_reads_back_into_one_dataframe(make_trainer: Any, lm_rows: Any) -> None:
    """Five epochs of a 24-row set (the ledger's epochs and steps, not the step count, are what is checked)."""
    trainer = make_trainer(max_steps=100, per_device_train_batch_size=1, logging_steps=50, train_dataset=lm_rows.select(range(24)))
    harness.attach(trainer, config={"only": ["data_hash"]})  # the ledger is data_hash's; the other plugins only cost time here
    trainer.train()
    ledger = read_ledger(trainer.args.output_dir)
    assert len(ledger) == 100 and ledger["step"].tolist() == list(range(1, 101))
    assert ledger.groupby("epoch").size().tolist() == [24] * 4 + [4]


def _wrapped(out: Path, config: Path, *extra: str, launcher: list[str] | None = None) -> Any:
    # with dropout every step draws from the RNG, so a stream that was not restored really differs
    return wrapped_example(out, config, "--dropout", "0.1", *extra, launcher=launcher)


def _break(checkpoint: Path, what: str) -> None:
    """Break one part of a checkpoint the way it happens in the field."""
    if what in ("optimizer", "scheduler"):
        (checkpoint / f"{what}.pt").unlink()
    elif what == "rng":
        for rng in checkpoint.glob("rng_state*.pth"):
            rng.unlink()
    elif what == "model":
        weights = load_file(str(checkpoint / "model.safetensors"))
        name = next(n for n in weights if n.endswith("layers.0.self_attn.o_proj.weight"))
        weights[name][0, 0] += 1e-2
        save_file(weights, str(checkpoint / "model.safetensors"), metadata={"format": "pt"})


# what a resume through `harness wrap` reports after each breakage (the Trainer restores optimizer and scheduler
# only when both files are there, so losing either loses both)
EXPECTED = {
    "nothing": [],
    "optimizer": ["RESUME_OPTIMIZER_NOT_RESTORED", "RESUME_SCHEDULER_MISMATCH"],
    "scheduler": ["RESUME_OPTIMIZER_NOT_RESTORED", "RESUME_SCHEDULER_MISMATCH"],
    "rng": ["RESUME_RNG_NOT_RESTORED"],
    "model": ["RESUME_MODEL_MISMATCH"],
    "ignore_data_skip": ["DATA_REPEATED", "DATA_SKIPPED", "RESUME_DATA_POSITION", "RESUME_RNG_NOT_RESTORED"],
}


@pytest.mark.slow  # a long end-to-end run (subprocesses or hundreds of steps): CI runs it, the quick subset does not
def test_a_killed_run_resumed_through_wrap(tmp_path: Path) -> None:
    killed = tmp_path / "killed"
    config = write_yaml(tmp_path / "h.yaml", {"plugins": ["defaults", FAULTS], "fault_injector": {"kill_at_step": 13}})
    assert _wrapped(killed, config).returncode != 0 and (killed / "checkpoint-10").is_dir()
    from concurrent.futures import ThreadPoolExecutor

    def resume(what: str) -> Any:
        out = tmp_path / what
        shutil.copytree(killed, out)
        shutil.rmtree(out / "harness" / "ranks", ignore_errors=True)
        _break(out / "checkpoint-10", what)
        flags = ["--ignore_data_skip"] if what == "ignore_data_skip" else []
        return _wrapped(out, config, "--resume_from_checkpoint", str(out / "checkpoint-10"), *flags)

    with ThreadPoolExecutor(max_workers=2) as pool:  # independent single-process runs: two at a time on two cores
        results = dict(zip(EXPECTED, pool.map(resume, EXPECTED)))
    for what, expected in EXPECTED.items():
        out = tmp_path / what
        resumed = results[what]
        stops = expected and expected[0] in ("RESUME_OPTIMIZER_NOT_RESTORED", "RESUME_MODEL_MISMATCH", "DATA_REPEATED")
        assert resumed.returncode == (EXIT_STOPPED if stops else 0), (what, resumed.stderr[-3000:])  # a harness stop is loud
        assert sorted({c for c, _ in _resume_codes(out)}) == expected, what
        if what == "nothing":  # the ledger keeps what the killed process trained past the checkpoint
            ledger = read_ledger(out)
            assert sorted(ledger[ledger["superseded"]]["step"].unique()) == [11, 12]
        assert (out / "checkpoint-14").exists() != bool(stops), what  # a stopping mismatch never reaches the next save


ZERO2 = ["--deepspeed", str(REPO / "examples" / "ds_zero2.json")]


@pytest.mark.slow
def test_deepspeed_zero2_two_processes(tmp_path: Path) -> None:
    killed = tmp_path / "killed"
    config = write_yaml(tmp_path / "h.yaml", {"plugins": ["defaults", FAULTS], "fault_injector": {"kill_at_step": 13}})
    assert _wrapped(killed, config, *ZERO2, launcher=torchrun()).returncode != 0 and (killed / "checkpoint-10").is_dir()
    from concurrent.futures import ThreadPoolExecutor

    def resume(ignore_data_skip: bool) -> Any:
        out = tmp_path / f"ignore_data_skip={ignore_data_skip}"
        shutil.copytree(killed, out)
        extra = ["--resume_from_checkpoint", str(out / "checkpoint-10"), *(["--ignore_data_skip"] if ignore_data_skip else [])]
        return _wrapped(out, config, *ZERO2, *extra, launcher=torchrun())

    with ThreadPoolExecutor(max_workers=2) as pool:  # the two resumes are independent jobs
        results = list(pool.map(resume, (False, True)))
    for ignore_data_skip, resumed in zip((False, True), results):
        out = tmp_path / f"ignore_data_skip={ignore_data_skip}"
        assert resumed.returncode == (EXIT_STOPPED if ignore_data_skip else 0), resumed.stderr[-3000:]  # the data position stops it
        if ignore_data_skip:
            positions = findings_of(out, "RESUME_DATA_POSITION")
            assert {f["rank"] for f in positions} == {0, 1} and {f["step"] for f in positions} == {11}
        else:
            assert _resume_codes(out) == []


def _per_device(n: int) -> list[str]:
    return ["--per_device_train_batch_size", str(n)]


def _step_sets(out: Path, attempt: int, steps: range) -> dict[int, list[str]]:
    """step -> the samples every rank of ``attempt`` trained at it (sorted: a step is one set, whatever the world size)."""
    ledger = read_ledger(out)
    mine = ledger[(ledger["attempt"] == attempt) & ledger["step"].isin(list(steps))]
    return {int(step): sorted(group["sample_hash"]) for step, group in mine.groupby("step")}


def _edit_ledger(out: Path, rank: int, edit: Any) -> None:
    """Rewrite one rank's ledger: ``edit(record)`` returns the record to keep (changed or not) or None to drop it."""
    path = out / "harness" / "ledger" / f"rank-{rank}.jsonl"
    kept = [edit(record) if record.get("event") is None else record for record in read_jsonl(path)]
    path.write_text("".join(json.dumps(r) + "\n" for r in kept if r is not None), encoding="utf-8")


def test_a_step_is_compared_as_one_set_so_a_sample_no_rank_trains_again_is_a_wrong_position(
        make_trainer: Any, tmp_path: Path) -> None:
    """The interrupted 2 x 2 run trained 5 samples at step 11 (rank 1 one more than rank 0); the resume on 1 x 4 trains 4 of
    them. Each of its samples is among the interrupted run's, so the check of each rank's samples let it pass, though the
    step does not train what the interrupted one did. The step's samples are compared as one set now: one is missing."""
    out = tmp_path / "run"
    _interrupted(make_trainer, out)
    _as_two_ranks(out)
    _edit_ledger(out, 1, lambda r: {**r, "sample_hashes": r["sample_hashes"] + ["00000000deadbeef"]} if r["step"] == 11 else r)
    before, saved = len(findings_of(out)), load_file(str(out / "checkpoint-10" / "model.safetensors"))
    trainer = _resume(make_trainer, out)
    (position,) = [f for f in findings_of(out)[before:] if f["code"] == "RESUME_DATA_POSITION"]
    assert position["step"] == 11 and position["action"] == "stop" and trainer.state.global_step == 11
    now = param_tensors(trainer.model)  # one process: the step's samples are all known before its update, which is held back
    assert all(torch.equal(now[name], saved[name]) for name in saved if name in now)
    assert (position["evidence"]["missing"], position["evidence"]["extra"]) == (1, 0)
    assert position["evidence"]["missing_hashes"] == ["00000000deadbeef"] and position["evidence"]["step_samples"] == 4
    assert "compared as one set, 1 of them no rank trained" in position["message"], position["message"]
    assert "training stops before this step's update" in position["message"]


def test_a_step_only_some_ranks_of_the_killed_run_wrote_is_not_compared(make_trainer: Any, tmp_path: Path) -> None:
    """The 2 x 2 run was killed at step 12 after rank 0 wrote its line of the step and before rank 1 did. Step 12's set
    held rank 0's 2 samples only, and the resume on 1 x 4 (the global batch kept) was stopped there as a wrong position.
    A step that not every rank of the interrupted run wrote is not compared."""
    out = tmp_path / "run"
    _interrupted(make_trainer, out)
    _as_two_ranks(out)
    _edit_ledger(out, 0, lambda r: r if r["step"] <= 12 else None)
    _edit_ledger(out, 1, lambda r: r if r["step"] <= 11 else None)
    before = len(findings_of(out))
    trainer = _resume(make_trainer, out)
    assert trainer.state.global_step == 14
    added = [(f["code"], f["severity"]) for f in findings_of(out)[before:] if f["code"].startswith(("RESUME_", "DATA_"))]
    assert added == [("RESUME_WORLD_SIZE_CHANGED", "info")], added


class _MainRank:
    """Rank 0's run context as the step-set check reads it: the step exchange's shares and the findings made."""

    def __init__(self, world_size: int, shared: list[list[int] | None] | None, cut: list[int] | None = None) -> None:
        self.rank, self.world_size, self.is_main, self.data_edit = 0, world_size, True, None
        self._shared, self._cut, self.reports = shared, cut or [], []

    def shared(self, key: str, *, owner: str) -> Any:
        return self._shared if (owner, key) == ("data_hash", "hashes") else None

    def shared_cut(self, key: str, *, owner: str) -> list[int]:
        return self._cut

    def report(self, code: str, message: str, **kwargs: Any) -> None:
        self.reports.append({"code": code, "message": message, **kwargs})


def test_two_ranks_that_each_train_part_of_the_step_but_not_the_step_are_a_wrong_position() -> None:
    """Rank 0 of 2 judges the step's samples of every rank, from data_hash's share of the step exchange (no collective of
    its own): ranks training [a, b] and [a, c] where the interrupted run trained [a, b, c, d] each pass the check of
    their own samples, but a comes twice and d never. Not judged when a rank's share arrived cut or not at all; not
    reported again when a rank's own samples were already wrong (that rank said it), nor for a sample the interrupted run
    had twice (an epoch's padded last round on more processes) that came once."""
    from harness.lib.hashing import hex64
    from harness.plugins.resume_check import ResumeCheck

    a, b, c, d = 11, 12, 13, 14

    def judged(shared: list[list[int] | None] | None, cut: list[int] | None = None, want: tuple[int, ...] = (a, b, c, d)
               ) -> list[dict[str, Any]]:
        plugin, ctx = ResumeCheck(), _MainRank(2, shared, cut)
        plugin.__dict__["ctx"] = ctx
        plugin._resume_step, plugin._interrupted_world = 10, 2
        plugin._expected = {11: [hex64(h) for h in want]}
        plugin._seen_in_step = {11: Counter([hex64(a), hex64(b)])}
        plugin._exchange_step = 11
        plugin.on_step_end(ctx=ctx, step=11, metrics={})
        return ctx.reports

    (finding,) = judged([[a, b], [a, c]])
    assert finding["code"] == "RESUME_DATA_POSITION" and finding["step"] == 11
    assert (finding["evidence"]["missing"], finding["evidence"]["extra"]) == (1, 1)
    assert finding["evidence"]["missing_hashes"] == [hex64(d)] and finding["evidence"]["extra_hashes"] == [hex64(a)]
    assert "1 of them no rank trained and 1 came on more than one rank" in finding["message"]
    assert "training stops before the next update" in finding["message"], finding["message"]
    assert judged([[a, b], [c, d]]) == [] and judged([[b, a], [d, c]]) == []  # the same set, in any order or split
    assert judged([[a, b], [a, c]], cut=[1]) == [] and judged([[a, b], None]) == [] and judged(None) == []
    assert judged([[a, b], [a, a]]) == []  # rank 1's own samples hold a twice: rank 1 reported it at its micro-batch
    # the interrupted run on more processes had c twice (the sampler's padding of the epoch's last round): once is all
    assert judged([[a, b], [c]], want=(a, b, c, c)) == []


def _serious(findings: list[dict[str, Any]]) -> list[tuple[str, int, int]]:
    return [(f["code"], f["step"], f["rank"]) for f in findings if f["severity"] in ("warning", "error", "critical")]


@pytest.mark.slow
def test_resumes_across_a_world_size_change_through_wrap(tmp_path: Path) -> None:
    """A run on 2 processes x 8 per device, resumed from checkpoint-10 on 1 x 16 (the global batch kept): its steps train
    exactly the samples both ranks trained, and it trains on (RESUME_DATA_POSITION stopped it, wrap exited 75). The
    reverse, that 1 x 16 attempt resumed from its checkpoint-15 on 2 x 8, trains every sample at the same steps (DATA_SKIPPED
    counted rank 0's share only; rank 1 reported RESUME_UNCHECKED, and numbered its ledger attempt as an earlier one). A
    wrong resume, 2 x 8 on 1 x 8 (the global batch halved), is still stopped, with the world-size change named as its cause."""
    config = write_yaml(tmp_path / "h.yaml", {"plugins": ["defaults"]})
    base = tmp_path / "2x8"
    run = lambda out, *extra, launcher=None: wrapped_example(out, config, *extra, launcher=launcher, steps=20, save_steps=5)  # noqa: E731
    first = run(base, *_per_device(8), launcher=torchrun())
    assert first.returncode == 0, first.stderr[-3000:]
    one, wrong = tmp_path / "1x16", tmp_path / "1x8"
    for out in (one, wrong):
        shutil.copytree(base, out)
    from concurrent.futures import ThreadPoolExecutor

    with ThreadPoolExecutor(max_workers=2) as pool:  # two independent single-process resumes, one per core
        resumed, stopped = pool.map(lambda job: run(job[0], *_per_device(job[1]), "--resume_from_checkpoint", str(job[0] / "checkpoint-10")),
                                    [(one, 16), (wrong, 8)])

    assert resumed.returncode == 0, resumed.stderr[-3000:]
    base_findings = len(findings_of(base))
    added = findings_of(one)[base_findings:]
    assert _serious(added) == [], added
    assert [(f["code"], f["severity"], f["evidence"]["saved"], f["evidence"]["now"]) for f in added
            if f["code"] == "RESUME_WORLD_SIZE_CHANGED"] == [("RESUME_WORLD_SIZE_CHANGED", "info", 2, 1)]
    assert _step_sets(one, 2, range(11, 21)) == _step_sets(one, 1, range(11, 21))  # what both ranks trained, step by step
    assert len(_step_sets(one, 2, range(11, 12))[11]) == 16

    assert stopped.returncode == EXIT_STOPPED, stopped.stderr[-3000:]
    (position,) = findings_of(wrong, "RESUME_DATA_POSITION")
    assert position["step"] == 11 and position["action"] == "stop" and position["evidence"]["cause"] == "world_size_changed"
    assert "The cause is the world-size change: 2 processes x 8 per device" in position["message"], position["message"]
    (changed,) = findings_of(wrong, "RESUME_WORLD_SIZE_CHANGED")  # DDP: the replicas' state is still compared
    assert changed["severity"] == "warning" and changed["evidence"] == {
        "saved": 2, "now": 1, "sharded": False, "optimizer_sharded": False, "saved_global_batch": 16, "global_batch": 8}

    # the reverse: the 1 x 16 attempt (2) saved checkpoint-15 and trained up to 20; resumed from 15 on 2 x 8
    before = len(findings_of(one))
    grown = run(one, *_per_device(8), "--resume_from_checkpoint", str(one / "checkpoint-15"), launcher=torchrun())
    assert grown.returncode == 0, grown.stderr[-3000:]
    added = findings_of(one)[before:]
    assert _serious(added) == [], added
    assert [(f["code"], f["rank"], f["severity"]) for f in added if f["code"].startswith(("RESUME_", "DATA_"))] == [
        ("RESUME_WORLD_SIZE_CHANGED", 0, "info")]
    ledger = read_ledger(one)
    assert sorted(set(zip(ledger["rank"], ledger["attempt"]))) == [(0, 1), (0, 2), (0, 3), (1, 1), (1, 3)]  # the run's numbers
    assert _step_sets(one, 3, range(16, 21)) == _step_sets(one, 2, range(16, 21))
