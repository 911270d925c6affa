"""Which run the mlflow plugin logs into: HF's own (report_to mlflow), the script's, MLFLOW_RUN_ID's, or its own.

Real Trainers with HF's real ``MLflowCallback`` against real SQLite stores;
each test counts the runs in every experiment of the store.
"""
from __future__ import annotations

import gc
import shutil
from contextlib import closing
from pathlib import Path
from typing import Any, Iterator

import pytest
from transformers import TrainerCallback

import harness
from conftest import FAULTS, findings_of
from mlflow_server import all_runs, metric_steps, mlflow_client

pytest.importorskip("mlflow")





def _artifacts(uri: str, run_id: str) -> set[str]:
    return {a.path for a in mlflow_client(uri).list_artifacts(run_id, "harness")}


@pytest.fixture(autouse=True)
def _in_tmp_path(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A SQLite store keeps artifacts under ``./mlruns`` of the working directory: keep them out of the checkout."""
    monkeypatch.chdir(tmp_path)


@pytest.fixture(scope="session")
def empty_store(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """An empty SQLite store, made once: MLflow's schema migrations take seconds per new store, the same each time."""
    root = tmp_path_factory.mktemp("mlflow_template")
    path = root / "store.db"
    client = mlflow_client(f"sqlite:///{path}")
    assert [e.name for e in client.search_experiments()] == ["Default"]  # created, migrated, and no transaction left open
    return path


@pytest.fixture
def store(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, empty_store: Path) -> Iterator[str]:
    """A fresh SQLite store as MLFLOW_TRACKING_URI; no fluent run or URI leaks into the next test.

    A copy of ``empty_store`` whose Default experiment keeps its artifacts under ``tmp_path/mlruns/0``: what MLflow
    itself makes when it creates the store in the working directory ``tmp_path``.
    """
    import sqlite3

    import mlflow
    import mlflow.tracking.fluent as fluent

    from harness.plugins.mlflow import target

    shutil.copyfile(empty_store, tmp_path / "store.db")
    with closing(sqlite3.connect(tmp_path / "store.db")) as db, db:
        db.execute("UPDATE experiments SET artifact_location = ? WHERE experiment_id = 0", (str(tmp_path / "mlruns" / "0"),))
    uri = f"sqlite:///{tmp_path / 'store.db'}"
    monkeypatch.setenv("MLFLOW_TRACKING_URI", uri)
    for key in ("MLFLOW_RUN_ID", "MLFLOW_EXPERIMENT_NAME", "MLFLOW_EXPERIMENT_ID", "MLFLOW_NESTED_RUN", "MLFLOW_TAGS"):
        monkeypatch.delenv(key, raising=False)
    mlflow.set_tracking_uri(uri)
    try:
        yield uri
    finally:
        gc.collect()  # HF's MLflowCallback.__del__ ends whatever run is active: let this test's callbacks go now
        while mlflow.active_run() is not None:
            mlflow.end_run()
        target._last_hold = None
        fluent._active_experiment_id = None  # HF's set_experiment() is process-wide
        mlflow.set_tracking_uri(None)


def _own_store_absent(output_dir: Any) -> bool:
    return not (Path(output_dir) / "harness" / "mlflow" / "mlflow.db").exists()


def test_joins_hf_run_when_hf_starts_first(make_trainer: Any, store: str, monkeypatch: pytest.MonkeyPatch, lm_rows: Any) -> None:
    """report_to mlflow: HF's callback sets up first; the harness logs into that run, its experiment and store."""
    import mlflow

    monkeypatch.setenv("MLFLOW_EXPERIMENT_NAME", "clm-exp")
    trainer = make_trainer(max_steps=3, report_to="mlflow", eval_dataset=lm_rows.select(range(8)))
    harness.attach(trainer, config={"plugins": ["mlflow", FAULTS], "fault_injector": {"report_at_step": 2}})
    trainer.train()
    (run,) = all_runs(store)
    assert mlflow_client(store).get_experiment(run.info.experiment_id).name == "clm-exp"
    assert run.info.status == "RUNNING"  # held open past train(): a later evaluate() logs into it
    assert metric_steps(store, run.info.run_id, "loss") == [1, 2, 3]  # HF's points, once each (the harness does not log them again)
    assert metric_steps(store, run.info.run_id, "harness/findings/TEST_FAULT") == [2]
    assert run.data.tags["harness.finding.TEST_FAULT"].startswith("1 (warning)") and run.data.tags["harness.status"] == "completed"
    assert run.data.params["max_steps"] == "3" and "harness.plugins" in run.data.params
    assert not any(k.startswith(("trainer.", "model.")) for k in run.data.params)  # HF logged those, unprefixed
    assert {"harness/report.md", "harness/findings.jsonl", "harness/config.yaml"} <= _artifacts(store, run.info.run_id)
    assert _own_store_absent(trainer.args.output_dir)
    trainer.evaluate()
    mlflow.end_run()  # what MLflow's exit handler does at the end of a script
    (run,) = all_runs(store)
    assert run.info.status == "FINISHED" and "eval_loss" in run.data.metrics


def test_joins_hf_run_when_the_harness_callback_runs_first(make_trainer: Any, store: str) -> None:
    """HF's callback added after attach: the harness's on_train_begin comes first and sets HF's callback up itself."""
    from transformers.integrations import MLflowCallback

    trainer = make_trainer(max_steps=3)
    harness.attach(trainer, config={"plugins": ["mlflow"]})
    trainer.add_callback(MLflowCallback)
    names = [type(c).__name__ for c in trainer.callback_handler.callbacks]
    assert names.index("HarnessCallback") < names.index("MLflowCallback")
    trainer.train()
    (run,) = all_runs(store)
    assert run.info.experiment_id == "0"  # HF's default experiment, as HF alone would use
    assert metric_steps(store, run.info.run_id, "loss") == [1, 2, 3]
    assert run.data.params["learning_rate"] == "0.001" and "harness.plugins" in run.data.params
    assert "harness/report.md" in _artifacts(store, run.info.run_id)
    assert _own_store_absent(trainer.args.output_dir)


@pytest.mark.slow  # the quick subset keeps the two join orders, the crash and MLFLOW_RUN_ID
def test_without_holding_hf_ends_its_run_and_the_report_still_lands(make_trainer: Any, store: str) -> None:
    """keep_hf_run_open: false: HF ends its run in on_train_end; the report is uploaded into it by id afterwards."""
    trainer = make_trainer(max_steps=2, report_to="mlflow")
    harness.attach(trainer, config={"plugins": ["mlflow"], "mlflow": {"keep_hf_run_open": False}})
    trainer.train()
    (run,) = all_runs(store)
    assert run.info.status == "FINISHED"
    assert "harness/report.md" in _artifacts(store, run.info.run_id)


class _Crash(TrainerCallback):
    def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        if state.global_step == 2:
            raise RuntimeError("the training loop itself failed")


@pytest.mark.slow  # the quick subset keeps the two join orders, the crash and MLFLOW_RUN_ID
def test_a_nested_hf_run_is_joined_but_never_held(make_trainer: Any, store: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """MLFLOW_NESTED_RUN: HF's child run gets the harness records; HF ends it (MLflow's exit handler would end only one run)."""
    import mlflow

    parent = mlflow.start_run(run_name="sweep")
    monkeypatch.setenv("MLFLOW_NESTED_RUN", "1")
    trainer = make_trainer(max_steps=2, report_to="mlflow")
    harness.attach(trainer, config={"plugins": ["mlflow"]})
    trainer.train()
    (child,) = [r for r in all_runs(store) if r.info.run_id != parent.info.run_id]
    assert child.data.tags["mlflow.parentRunId"] == parent.info.run_id and child.info.status == "FINISHED"
    assert "harness/report.md" in _artifacts(store, child.info.run_id) and metric_steps(store, child.info.run_id, "loss") == [1, 2]
    assert mlflow.active_run().info.run_id == parent.info.run_id


def test_a_crash_ends_hf_run_failed(make_trainer: Any, store: str) -> None:
    trainer = make_trainer(max_steps=4, report_to="mlflow", callbacks=[_Crash()])
    harness.attach(trainer, config={"plugins": ["mlflow"]})
    with pytest.raises(RuntimeError, match="training loop itself"):
        trainer.train()
    (run,) = all_runs(store)
    assert run.info.status == "FAILED" and run.data.tags["harness.status"] == "crashed"
    assert metric_steps(store, run.info.run_id, "loss") == [1]
    assert "harness/findings.jsonl" in _artifacts(store, run.info.run_id)


@pytest.mark.slow  # the quick subset keeps the two join orders, the crash and MLFLOW_RUN_ID
def test_the_next_trainer_gets_its_own_run(make_trainer: Any, store: str, tmp_path: Path) -> None:
    """A notebook's second trainer: the first one's held run ends (as HF would have ended it), the second makes its own."""
    first = make_trainer(output_dir=tmp_path / "a", max_steps=2, report_to="mlflow")
    harness.attach(first, config={"plugins": ["mlflow"]})
    first.train()
    second = make_trainer(output_dir=tmp_path / "b", max_steps=2, report_to="mlflow")
    harness.attach(second, config={"plugins": ["mlflow"]})
    second.train()
    runs = sorted(all_runs(store), key=lambda r: r.info.start_time)
    assert [r.info.status for r in runs] == ["FINISHED", "RUNNING"]
    assert [r.data.tags["harness.rank0_output_dir"] for r in runs] == [str(tmp_path / "a"), str(tmp_path / "b")]


@pytest.mark.slow  # the quick subset keeps the two join orders, the crash and MLFLOW_RUN_ID
def test_an_explicit_tracking_uri_keeps_the_harness_run_apart(make_trainer: Any, store: str, tmp_path: Path) -> None:
    own = f"sqlite:///{tmp_path / 'own.db'}"
    trainer = make_trainer(max_steps=2, report_to="mlflow")
    harness.attach(trainer, config={"plugins": ["mlflow"], "mlflow": {"tracking_uri": own}})
    trainer.train()
    (hf_run,) = all_runs(store)
    (harness_run,) = all_runs(own)
    assert "harness/report.md" in _artifacts(own, harness_run.info.run_id)
    assert metric_steps(own, harness_run.info.run_id, "loss") == [1, 2] and "harness.status" not in hf_run.data.tags


def test_mlflow_run_id_without_hf_callback_logs_into_that_run(make_trainer: Any, store: str, monkeypatch: pytest.MonkeyPatch) -> None:
    existing = mlflow_client(store).create_run(mlflow_client(store).create_experiment("pre-made"), run_name="made-before")
    monkeypatch.setenv("MLFLOW_RUN_ID", existing.info.run_id)
    trainer = make_trainer(max_steps=2)
    harness.attach(trainer, config={"plugins": ["mlflow"]})
    trainer.train()
    (run,) = all_runs(store)
    assert run.info.run_id == existing.info.run_id and run.info.status == "FINISHED"
    assert metric_steps(store, run.info.run_id, "loss") == [1, 2]
    assert "harness/report.md" in _artifacts(store, run.info.run_id)
    assert findings_of(trainer.args.output_dir, "TRACKING_DEGRADED") == []


@pytest.mark.slow  # the quick subset keeps the two join orders, the crash and MLFLOW_RUN_ID
def test_mlflow_experiment_name_without_hf_callback(make_trainer: Any, store: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("MLFLOW_EXPERIMENT_NAME", "harness-exp")
    trainer = make_trainer(max_steps=2)
    harness.attach(trainer, config={"plugins": ["mlflow"]})
    trainer.train()
    (run,) = all_runs(store)
    assert mlflow_client(store).get_experiment(run.info.experiment_id).name == "harness-exp"
    assert run.data.params["trainer.max_steps"] == "2" and metric_steps(store, run.info.run_id, "loss") == [1, 2]


@pytest.mark.slow  # the quick subset keeps the two join orders, the crash and MLFLOW_RUN_ID
def test_the_scripts_own_active_run_is_joined_and_left_open(make_trainer: Any, store: str) -> None:
    """No HF callback, but the script called mlflow.start_run(): its run, which the script ends itself."""
    import mlflow

    active = mlflow.start_run(run_name="the-script's")
    trainer = make_trainer(max_steps=2)
    harness.attach(trainer, config={"plugins": ["mlflow"]})
    trainer.train()
    (run,) = all_runs(store)
    assert run.info.run_id == active.info.run_id and run.info.status == "RUNNING"
    assert metric_steps(store, run.info.run_id, "loss") == [1, 2]  # no HF callback: the harness logs the Trainer's metrics


def test_the_console_line_says_which_run_and_why(monkeypatch: pytest.MonkeyPatch) -> None:
    from harness.plugins.mlflow.options import MlflowOptions
    from harness.plugins.mlflow.target import JoinedRun, describe_target
    from harness.plugins.mlflow.writer import RunTarget

    monkeypatch.delenv("MLFLOW_RUN_ID", raising=False)
    known = RunTarget("sqlite:///x.db", "exp", None, {}, run_id="abc")
    assert describe_target(known, None, MlflowOptions(run_id="abc"), None) == "logging into the run_id option's run abc (experiment 'exp', sqlite:///x.db)"
    assert describe_target(known, None, MlflowOptions(), "abc").startswith("logging into the resumed run abc")
    monkeypatch.setenv("MLFLOW_RUN_ID", "abc")
    assert describe_target(known, None, MlflowOptions(), None).startswith("logging into the run of MLFLOW_RUN_ID abc")
    monkeypatch.delenv("MLFLOW_RUN_ID")
    fresh = RunTarget("http://127.0.0.1:5000", "exp", None, {})
    assert describe_target(fresh, None, MlflowOptions(), None).startswith("logging into a new run (id in harness/mlflow/run.json")
    joined = JoinedRun("r1", "sqlite:///x.db", "exp", "HF's (report_to mlflow)")
    assert describe_target(known, joined, MlflowOptions(), None) == "logging into HF's (report_to mlflow) run r1 (experiment 'exp', sqlite:///x.db)"
