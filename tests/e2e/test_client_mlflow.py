"""Issue 18 item 6: `run_clm.py --report_to mlflow` under `harness wrap` with the mlflow plugin makes ONE MLflow run.

HF's ``MLflowCallback`` starts the run (and consumes ``MLFLOW_RUN_ID``); the
harness logs its findings, metrics and report into that same run, which
also holds HF's own curves (``loss``) and the ``evaluate()`` after
``train()``. Every test counts the runs in all experiments of the store.
"""
from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path
from typing import Any, Iterator

import pytest

from conftest import EXAMPLES, FAULTS, harness_cli, torchrun, write_yaml
from mlflow_server import MlflowServer, all_runs, metric_steps, mlflow_client, mlflow_server  # noqa: F401 (a fixture)

PY = sys.executable
RUN_CLM = EXAMPLES / "run_clm.py"
CONSOLE = re.compile(r"harness mlflow: logging into HF's \(report_to mlflow\) run ([0-9a-f]{32}) \(experiment '([^']+)'")





def _run_clm(tmp_path: Path, env: dict[str, str], steps: int = 4, launcher: list[str] | None = None) -> tuple[Path, subprocess.CompletedProcess[str]]:
    """The unmodified client script, trained and evaluated under `harness wrap`, HF reporting to MLflow."""
    data = tmp_path / "data"
    subprocess.run([PY, str(EXAMPLES / "clm_data.py"), "--out", str(data)], check=True, capture_output=True)
    out = tmp_path / "out"
    config = write_yaml(tmp_path / "h.yaml", {"plugins": ["mlflow", FAULTS], "fault_injector": {"report_at_step": 2, "report_on_rank": 0}})
    result = harness_cli(
        "wrap", "--config", str(config), "--", *(launcher or [PY]), str(RUN_CLM),
        "--train_file", str(data / "train.txt"), "--validation_file", str(data / "validation.txt"),
        "--do_train", "--do_eval", "--report_to", "mlflow", "--output_dir", str(out), "--max_steps", str(steps),
        "--logging_steps", "1", "--save_strategy", "no", "--per_device_train_batch_size", "4", "--use_cpu", "true",
        "--config_overrides", "hidden_size=64,num_layers=2",
        env={"HARNESS_CONFIG": "", **env}, cwd=tmp_path,
    )
    assert result.returncode == 0, result.stderr[-4000:]
    return out, result


def _assert_one_joined_run(uri: str, out: Path, result: subprocess.CompletedProcess[str], steps: int) -> Any:
    (run,) = all_runs(uri)  # one job, one run: not HF's + a harness run + HF's evaluate() run
    run_id = run.info.run_id
    assert CONSOLE.search(result.stdout + result.stderr).group(1) == run_id  # the console line names it
    assert run.info.status == "FINISHED"  # MLflow's exit handler ended it, after the report upload
    assert metric_steps(uri, run_id, "loss") == list(range(1, steps + 1))  # HF's curve, each point once
    assert "eval_loss" in run.data.metrics  # the evaluate() after train() went into the same run
    assert metric_steps(uri, run_id, "harness/findings/TEST_FAULT") == [2]
    assert run.data.tags["harness.finding.TEST_FAULT"].startswith("1 (warning)")
    assert run.data.tags["harness.status"] == "completed" and "harness.plugins" in run.data.params
    assert run.data.params["max_steps"] == str(steps)  # HF's own params
    artifacts = {a.path for a in mlflow_client(uri).list_artifacts(run_id, "harness")}
    assert {"harness/report.md", "harness/report.html", "harness/findings.jsonl", "harness/config.yaml"} <= artifacts
    assert not (out / "harness" / "mlflow" / "mlflow.db").exists()  # no second store of the harness's own
    return run


@pytest.mark.slow  # a wrapped client run (tests/plugins/test_mlflow_target.py checks the same in process, quickly)
def test_report_to_mlflow_makes_one_run_with_hf_and_harness_records(tmp_path: Path) -> None:
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    out, result = _run_clm(tmp_path, {"MLFLOW_TRACKING_URI": uri})
    run = _assert_one_joined_run(uri, out, result, steps=4)
    assert run.info.experiment_id == "0"  # HF's default experiment, as without the harness


@pytest.mark.slow  # a second wrapped client run
def test_mlflow_run_id_consumed_by_hf_still_gets_the_harness_records(tmp_path: Path) -> None:
    """MLFLOW_RUN_ID: HF's start_run resumes that run and unsets the variable; the harness follows HF into it."""
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    experiment = mlflow_client(uri).create_experiment("made-before", artifact_location=(tmp_path / "artifacts").as_uri())  # not ./mlruns
    made = mlflow_client(uri).create_run(experiment, run_name="pre-made")
    out, result = _run_clm(tmp_path, {"MLFLOW_TRACKING_URI": uri, "MLFLOW_RUN_ID": made.info.run_id}, steps=3)
    run = _assert_one_joined_run(uri, out, result, steps=3)
    assert run.info.run_id == made.info.run_id
    assert CONSOLE.search(result.stdout + result.stderr).group(2) == "made-before"



@pytest.mark.slow
def test_two_processes_against_a_server_make_one_run_in_the_named_experiment(tmp_path: Path, mlflow_server: MlflowServer) -> None:
    """torchrun, 2 ranks, a real `mlflow server`, MLFLOW_EXPERIMENT_NAME: rank 0's HF run holds everything."""
    env = {"MLFLOW_TRACKING_URI": mlflow_server.uri, "MLFLOW_EXPERIMENT_NAME": "clm-server"}
    out, result = _run_clm(tmp_path, env, steps=4, launcher=torchrun())
    run = _assert_one_joined_run(mlflow_server.uri, out, result, steps=4)
    assert mlflow_client(mlflow_server.uri).get_experiment(run.info.experiment_id).name == "clm-server"
    assert run.data.tags["harness.world_size"] == "2"
