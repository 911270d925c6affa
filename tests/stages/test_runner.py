"""`harness run` on the four example configs, rollback end to end, and config errors before training."""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import yaml

from cli_in_process import harness_in_process
from conftest import REPO, example_config, findings_of, read_jsonl
from harness.core.errors import ConfigError, HarnessError
from harness.stages.runner import run_stage

EXAMPLES = REPO / "examples"




def _losses(output_dir: Path) -> list[float]:
    return [r["loss"] for r in read_jsonl(output_dir / "harness" / "metrics.jsonl") if "loss" in r]


def _assert_trained(output_dir: Path, steps: int) -> None:
    losses = _losses(output_dir)
    assert len(losses) == steps
    head, tail = sum(losses[:3]) / 3, sum(losses[-3:]) / 3
    assert tail < head * 0.95, f"loss did not go down: {losses}"
    assert (output_dir / "harness" / "findings.jsonl").exists()
    assert (output_dir / "harness" / "mlflow" / "mlflow.db").exists()
    assert json.loads((output_dir / "harness" / "mlflow" / "run.json").read_text())["run_id"]
    assert [f for f in findings_of(output_dir) if f["severity"] in ("warning", "error", "critical")] == []


@pytest.mark.slow  # a whole stage run (TRL or packing): the quick tier keeps the continue example
def test_pretrain_example(tmp_path: Path) -> None:
    config = example_config("pretrain", tmp_path, training={"max_steps": 30, "save_steps": 15})
    assert run_stage("pretrain", config) == 0
    _assert_trained(tmp_path / "pretrain", 30)
    assert (tmp_path / "pretrain" / "model.safetensors").exists()
    # the stage's own packing passes packing_check's experiment: a packed row of several documents, none leaking
    (check,) = read_jsonl(tmp_path / "pretrain" / "harness" / "packing_check.jsonl")
    assert check["step"] == 1 and check["documents"] >= 2 and check["boundaries"] == "position_ids"
    assert check["mask_form"] == "position_ids only (no attention_mask)" and check["verdict"] == "separate" and check["leak"] == 0.0


def test_continue_example_from_a_model_directory(tmp_path: Path) -> None:
    from harness.lib.tiny import save_tiny_model_dir

    model_dir = save_tiny_model_dir(tmp_path / "base", vocab_size=512, hidden_size=64, num_layers=2, num_heads=4)
    config = example_config("continue", tmp_path, training={"max_steps": 20}, model={"path": str(model_dir)})
    assert run_stage("continue", config) == 0
    _assert_trained(tmp_path / "continue", 20)


@pytest.mark.slow  # a whole stage run (TRL or packing): the quick tier keeps the continue example
def test_sft_example(tmp_path: Path) -> None:
    config = example_config("sft", tmp_path, training={"max_steps": 20})
    assert run_stage("sft", config) == 0
    _assert_trained(tmp_path / "sft", 20)


@pytest.mark.slow  # a whole stage run (TRL or packing): the quick tier keeps the continue example
def test_dpo_example(tmp_path: Path) -> None:
    config = example_config("dpo", tmp_path, training={"max_steps": 12, "learning_rate": 0.003})
    assert run_stage("dpo", config) == 0
    _assert_trained(tmp_path / "dpo", 12)


@pytest.mark.slow  # a whole DPO run of the shipped example
def test_the_dpo_example_as_shipped_is_a_clean_run(tmp_path: Path) -> None:
    """Its 20 steps used to end in a LOSS_SPIKE at step 18 (batch noise of a preference loss, judged as a token loss's)."""
    config = example_config("dpo", tmp_path)
    assert run_stage("dpo", config) == 0
    out = tmp_path / "dpo"
    assert [(f["code"], f["step"]) for f in findings_of(out) if f["severity"] in ("warning", "error", "critical")] == []
    info = json.loads((out / "harness" / "run.json").read_text())
    assert info["stage"] == "dpo"


def _rolled_back(tmp_path: Path, plugins: list[str]) -> Path:
    """An 8-step pretrain whose step 5 asks for a rollback (checkpoints every 2 steps), run to its end; its output dir."""
    config = example_config(
        "pretrain", tmp_path, training={"max_steps": 8, "save_steps": 2, "per_device_train_batch_size": 4},
        harness={"plugins": [*plugins, "rollback_plugin:BadBatchOnce"]},
    )
    assert run_stage("pretrain", config) == 0
    return tmp_path / "pretrain"


def test_rollback_resumes_from_the_last_good_checkpoint_and_skips_the_bad_rows(tmp_path: Path) -> None:
    out = _rolled_back(tmp_path, ["metrics_log"])
    (performed,) = findings_of(out, "ROLLBACK_PERFORMED")
    assert performed["step"] == 5 and performed["evidence"]["checkpoint"].endswith("checkpoint-4")
    assert performed["evidence"]["skipped_rows"] == [16, 20]
    (taken,) = findings_of(out, "ACTION_TAKEN")
    assert taken["step"] == 5 and "roll back" in taken["message"]
    batches = read_jsonl(out / "harness" / "batches.rank-0.jsonl")
    first = {b["step"]: b["sum"] for b in batches if b["pass"] == 1}
    second = {b["step"]: b["sum"] for b in batches if b["pass"] == 2}
    assert sorted(first) == [1, 2, 3, 4, 5] and sorted(second) == [5, 6, 7, 8]  # resumed after checkpoint-4
    assert json.loads((out / "checkpoint-8" / "trainer_state.json").read_text())["global_step"] == 8
    # a clean run over the same data: the rolled-back run's step 5 is the clean run's step 6 (rows 16-19 skipped)
    reference = example_config(
        "pretrain", tmp_path / "clean", training={"max_steps": 8, "save_steps": 2, "per_device_train_batch_size": 4},
        harness={"plugins": ["rollback_plugin:BatchRecorder"]},
    )
    assert run_stage("pretrain", reference) == 0
    clean = {b["step"]: b["sum"] for b in read_jsonl(tmp_path / "clean" / "pretrain" / "harness" / "batches.rank-0.jsonl")}
    assert [first[s] for s in (1, 2, 3, 4, 5)] == [clean[s] for s in (1, 2, 3, 4, 5)]
    assert [second[s] for s in (5, 6, 7)] == [clean[s] for s in (6, 7, 8)]


def test_rollback_without_a_checkpoint_stops_with_a_clear_message(tmp_path: Path) -> None:
    config = example_config(
        "pretrain", tmp_path, training={"max_steps": 8, "save_strategy": "no"},
        harness={"plugins": ["rollback_plugin:BadBatchOnce"]},
    )
    with pytest.raises(HarnessError, match="rollback at step 5 not possible.*no checkpoint"):
        run_stage("pretrain", config)
    (exhausted,) = findings_of(tmp_path / "pretrain", "ROLLBACK_EXHAUSTED")
    assert exhausted["severity"] == "critical"


def test_typo_in_a_training_key(tmp_path: Path) -> None:
    config = example_config("pretrain", tmp_path, training={"max_step": 3})
    with pytest.raises(ConfigError) as info:
        run_stage("pretrain", config)
    message = str(info.value)
    assert str(config) in message and "training.max_step" in message and "Did you mean 'max_steps'?" in message
    assert not (tmp_path / "pretrain").exists()  # failed before anything was built


def test_typo_in_a_section_key(tmp_path: Path, capsys: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    config = example_config("sft", tmp_path)
    text = config.read_text().replace("tokenizer:", "tokeniser:") if "tokenizer:" in config.read_text() else config.read_text() + "tokeniser: {}\n"
    config.write_text(text)
    result = harness_in_process(capsys, monkeypatch, "run", "sft", "--config", str(config))
    assert result.returncode == 2
    assert "key 'tokeniser'" in result.stderr and "Did you mean 'tokenizer'?" in result.stderr and "Traceback" not in result.stderr


def test_missing_data_file(tmp_path: Path) -> None:
    config = example_config("sft", tmp_path)
    data = yaml.safe_load(config.read_text())
    data["data"]["sources"][0]["path"] = str(tmp_path / "nope.jsonl")
    config.write_text(yaml.safe_dump(data))
    with pytest.raises(HarnessError, match=r"nope.jsonl.*data.sources\[0\].path.*does not exist"):
        run_stage("sft", config)


def test_data_file_without_the_needed_fields(tmp_path: Path) -> None:
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"prompt": "a", "answer": "b"}\n{"prompt": "c", "answer": "d"}\n')
    config = example_config("dpo", tmp_path)
    data = yaml.safe_load(config.read_text())
    data["data"]["sources"][0]["path"] = str(bad)
    config.write_text(yaml.safe_dump(data))
    with pytest.raises(HarnessError) as info:
        run_stage("dpo", config)
    message = str(info.value)
    assert str(bad) in message and "chosen" in message


def test_stage_mismatch_and_unknown_harness_option(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="the file is for 'sft'"):
        run_stage("dpo", example_config("sft", tmp_path))
    config = example_config("pretrain", tmp_path, harness={"max_plugin_error": 2})
    with pytest.raises(ConfigError, match=r"section 'harness'.*max_plugin_error.*Did you mean 'max_plugin_errors'"):
        run_stage("pretrain", config)


def test_runner_refuses_records_without_text_field(tmp_path: Path, capsys: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """A mixed JSON-lines file: half the records lack 'text'. They were dropped in silence (and the tokenizer trained on
    the string 'None'); now the run fails before anything is built, naming the file, the records' lines and the key."""
    mixed = tmp_path / "mixed.jsonl"
    mixed.write_text("".join(
        json.dumps({"text": f"document {i} about the weather and the sea"} if i % 2 == 0 else {"txt": f"document {i}"}) + "\n"
        for i in range(20)
    ), encoding="utf-8")
    config = example_config("pretrain", tmp_path, training={"max_steps": 2, "save_strategy": "no"})
    data = yaml.safe_load(config.read_text())
    data["data"]["sources"] = [{"path": str(mixed)}]
    config.write_text(yaml.safe_dump(data))
    result = harness_in_process(capsys, monkeypatch, "run", "pretrain", "--config", str(config))
    assert result.returncode == 2, result.stderr[-3000:]
    message = " ".join(result.stderr.split())
    assert "Traceback" not in result.stderr
    assert str(mixed) in message and "data.sources[0]" in message and "10 of 20 records have no value for field 'text'" in message
    assert "line 2, line 4, line 6" in message and "Did you mean 'txt'?" in message and "text_field" in message
    assert not (tmp_path / "pretrain").exists()  # failed before tokenizer, model or Trainer were built


def test_runner_refuses_unknown_model_override(tmp_path: Path, capsys: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    config = example_config("pretrain", tmp_path, training={"max_steps": 2, "save_strategy": "no"})
    data = yaml.safe_load(config.read_text())
    data["model"]["overrides"] = {"hidden_sise": 32, "num_layers": 1, "rms_norm_eps": 1e-5}
    config.write_text(yaml.safe_dump(data))
    with pytest.raises(ConfigError) as info:
        run_stage("pretrain", config)
    (problem,) = info.value.problems  # the real LlamaConfig settings (num_layers, rms_norm_eps) pass
    assert str(config) in problem and "model.overrides.hidden_sise" in problem and "Did you mean 'hidden_size'?" in problem
    assert not (tmp_path / "pretrain").exists()
    data["model"]["overrides"] = {"vocab_size": 1000}  # set from the tokenizer: a second value would be a TypeError later
    config.write_text(yaml.safe_dump(data))
    result = harness_in_process(capsys, monkeypatch, "run", "pretrain", "--config", str(config))
    assert result.returncode == 2 and "Traceback" not in result.stderr, result.stderr[-3000:]
    assert "model.overrides.vocab_size" in result.stderr and "from the tokenizer" in result.stderr
    assert not (tmp_path / "pretrain").exists()


def test_a_resume_path_that_does_not_exist_and_no_sources_fail_before_anything_is_built(tmp_path: Path) -> None:
    config = example_config("pretrain", tmp_path)
    with pytest.raises(HarnessError, match=r"--resume .*nock: no such checkpoint folder\. Fix:"):
        run_stage("pretrain", config, resume=str(tmp_path / "nock"))
    assert not (tmp_path / "pretrain").exists()
    empty = example_config("pretrain", tmp_path / "empty")
    data = yaml.safe_load(empty.read_text())
    data["data"]["sources"] = []
    empty.write_text(yaml.safe_dump(data))
    with pytest.raises(ConfigError, match=r"data\.sources"):
        run_stage("pretrain", empty)


@pytest.mark.parametrize(("stage", "key"), [("continue", "model"), ("pretrain", "tokenizer")])
def test_a_model_or_tokenizer_folder_that_is_not_there_fails_before_the_data_is_read(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, stage: str, key: str
) -> None:
    import harness.stages.runner as runner

    def read_data(*args: Any) -> Any:
        raise AssertionError("the data was read before the model and tokenizer folders were checked")

    monkeypatch.setattr(runner, "load_training_data", read_data)
    config = example_config(stage, tmp_path, **{key: {"path": str(tmp_path / "no-such-model")}})
    with pytest.raises(HarnessError, match=rf"{key}\.path '.*no-such-model' in .*: .* is not a directory\. Fix:"):
        run_stage(stage, config)


def test_a_harness_stop_under_harness_run_exits_75_and_the_outcome_is_the_last_word(tmp_path: Path, capsys: Any) -> None:
    from harness.lib.tiny import save_tiny_model_dir

    model_dir = save_tiny_model_dir(tmp_path / "base", vocab_size=512, hidden_size=64, num_layers=2, num_heads=4)
    config = example_config("continue", tmp_path, training={"max_steps": 4}, model={"path": str(model_dir)},
                            harness={"plugins": ["defaults", "harness.testing:FaultInjector"], "fault_injector": {"stop_at_step": 2}})
    assert run_stage("continue", config) == 75  # exit 0 told a launcher the stage had finished
    err = capsys.readouterr().err
    assert "harness run continue: failed: the harness stopped training at step 2" in err, err[-2000:]
    assert f"next: harness explain {tmp_path / 'continue'}" in err


def test_training_values_are_checked_against_their_types(tmp_path: Path) -> None:
    """YAML reads `learning_rate: 1e-3` as text: taken as the number it means; `batch size: four` is an error, not a
    traceback from inside train()."""
    from harness.stages.config import load_run_config

    config = example_config("pretrain", tmp_path, training={"learning_rate": "1e-3", "max_steps": "5", "warmup_steps": 2})
    loaded = load_run_config(config, "pretrain")
    assert loaded.config.training["learning_rate"] == 0.001 and loaded.config.training["max_steps"] == 5
    bad = example_config("pretrain", tmp_path / "bad", training={"per_device_train_batch_size": "four", "num_train_epochs": "abc"})
    with pytest.raises(ConfigError) as info:
        load_run_config(bad, "pretrain")
    message = str(info.value)
    assert "training.per_device_train_batch_size': expected a whole number, got 'four'" in message
    assert "training.num_train_epochs': expected a number, got 'abc'" in message


def test_a_rollback_with_the_default_plugins_trains_on(tmp_path: Path) -> None:
    """The resume checks knew nothing of the rows the rollback left out: RESUME_DATA_CHANGED and RESUME_DATA_POSITION
    stopped the run it had just rolled back (and `harness run` exited 0)."""
    out = _rolled_back(tmp_path, ["defaults"])
    (performed,) = findings_of(out, "ROLLBACK_PERFORMED")
    assert performed["evidence"]["skipped_rows"] == [16, 20]
    codes = {f["code"] for f in findings_of(out)}
    assert not codes & {"RESUME_DATA_CHANGED", "RESUME_DATA_POSITION", "DATA_SKIPPED", "PLUGIN_STOP"}, codes
    assert json.loads((out / "checkpoint-8" / "trainer_state.json").read_text())["global_step"] == 8


def test_a_rollback_after_going_back_takes_a_checkpoint_of_the_history_it_trained(tmp_path: Path) -> None:
    """Attempt 1 saved 30, 40, 50; attempt 2 resumed from 30, saved 40 again, and asks for a rollback at 55 before its
    next save. checkpoint-50 is attempt 1's (a history the resume went back from), not one before the fault of attempt
    2: the rollback takes attempt 2's checkpoint-40."""
    from handmade_runs import rolled_back_run
    from harness.stages.runner import _last_checkpoint_before

    run = rolled_back_run(tmp_path)
    assert _last_checkpoint_before(run, 55) == run / "checkpoint-40"
    assert _last_checkpoint_before(run, 40) == run / "checkpoint-30"
