"""The mlflow plugin against real MLflow stores: the default SQLite store and a real `mlflow server` on 127.0.0.1."""
from __future__ import annotations

import os
import sys
import time
from pathlib import Path
from typing import Any, Iterator

import pytest

import harness
from conftest import EXAMPLE, FAULTS, findings_of, free_port, harness_cli, read_jsonl, torchrun, wrapped_example, write_yaml
from mlflow_server import MlflowServer, all_runs, metric_steps, mlflow_client, mlflow_server  # noqa: F401 (a fixture)
from harness import hookimpl

PY = sys.executable



def _store(output_dir: Path) -> str:
    return f"sqlite:///{(Path(output_dir) / 'harness' / 'mlflow' / 'mlflow.db').resolve()}"




def _logged_steps(output_dir: Path) -> list[int]:
    return [r["step"] for r in read_jsonl(Path(output_dir) / "harness" / "metrics.jsonl") if "loss" in r]


@pytest.mark.slow  # the quick subset stays under 5 minutes; CI runs it
def test_wrap_logs_a_complete_run_to_the_default_store(tmp_path: Path) -> None:
    out = tmp_path / "run"
    (tmp_path / "quiz.txt").write_text("zqx vlorp mendaq tive kraspo ulm\nfrobnitz quell azimuth dorrow plen\n")
    config = write_yaml(tmp_path / "h.yaml", {"contamination": {"eval_sets": [{"path": str(tmp_path / "quiz.txt")}], "min_length": 2},
                                              "report_plots": True})
    result = harness_cli(
        "wrap", "--config", str(config), "--plugins", f"mlflow,{FAULTS}", "--", PY, str(EXAMPLE), "--output_dir", str(out), "--max_steps", "6",
        env={"HARNESS_CONFIG": ""},
    )
    assert result.returncode == 0, result.stderr[-3000:]
    uri = _store(out)
    (run,) = all_runs(uri)
    assert run.info.status == "FINISHED"
    steps = _logged_steps(out)
    assert steps == [1, 2, 3, 4, 5, 6]
    for key in ("loss", "grad_norm", "learning_rate"):
        assert metric_steps(uri, run.info.run_id, key) == steps, key
    assert run.data.params["trainer.max_steps"] == "6" and "harness.plugins" in run.data.params
    assert run.data.params["model.num_hidden_layers"] == "2"
    paths = [a.path for a in mlflow_client(uri).list_artifacts(run.info.run_id, "harness")]
    assert {"harness/findings.jsonl", "harness/config.yaml", "harness/metrics.jsonl", "harness/contamination", "harness/report.md",
            "harness/report.html", "harness/steps.jsonl", "harness/run.json", "harness/report"} <= set(paths)
    plots = {a.path for a in mlflow_client(uri).list_artifacts(run.info.run_id, "harness/report/plots")}
    assert "harness/report/plots/loss.png" in plots  # what report.md links to travels with it
    lists = {a.path for a in mlflow_client(uri).list_artifacts(run.info.run_id, "harness/contamination")}
    assert {"harness/contamination/clean_ids.rank-0.txt", "harness/contamination/dirty_ids.rank-0.txt"} <= lists  # the clean/dirty lists


class _Emitter:
    """Emits odd metrics through ctx.log_metrics, as any plugin may."""

    name = "emitter"

    @hookimpl
    def on_step_end(self, ctx: Any, step: int) -> None:
        import torch

        ctx.log_metrics({"custom/good": 1.5 * step, "custom/tensor": torch.tensor(2.0), "custom/text": "abc", "custom/none": None})


def test_long_params_non_numeric_metrics_and_findings(make_trainer: Any) -> None:
    trainer = make_trainer(max_steps=3, run_name="r" * 10_000)
    harness.attach(
        trainer,
        plugins=[_Emitter()],
        config={"plugins": ["mlflow", FAULTS], "fault_injector": {"report_at_step": 2}, "mlflow": {"max_param_length": 6000}},
    )
    trainer.train()
    uri = _store(trainer.args.output_dir)
    (run,) = all_runs(uri)
    value = run.data.params["trainer.run_name"]
    assert len(value) <= 6000 and value.endswith("chars]") and "truncated" in value
    assert metric_steps(uri, run.info.run_id, "custom/good") == [1, 2, 3]
    assert metric_steps(uri, run.info.run_id, "custom/tensor") == [1, 2, 3]
    assert "custom/text" not in run.data.metrics and "custom/none" not in run.data.metrics
    assert metric_steps(uri, run.info.run_id, "harness/findings/TEST_FAULT") == [2]
    assert metric_steps(uri, run.info.run_id, "harness/findings/total") == [2]  # as report_to's feed names it
    assert run.data.tags["harness.finding.TEST_FAULT"].startswith("1 (warning)")
    assert findings_of(trainer.args.output_dir, "INTERNAL_PLUGIN_ERROR") == []
    assert findings_of(trainer.args.output_dir, "TRACKING_DEGRADED") == []


def test_resume_continues_the_same_run_and_a_fresh_start_makes_a_new_one(make_trainer: Any, tmp_path: Path) -> None:
    out = tmp_path / "resumable"
    config = {"plugins": ["mlflow"]}
    first = make_trainer(output_dir=out, max_steps=4, save_strategy="steps", save_steps=2)
    harness.attach(first, config=config)
    first.train()
    uri = _store(out)
    (run,) = all_runs(uri)
    second = make_trainer(output_dir=out, max_steps=6, save_strategy="steps", save_steps=2)
    harness.attach(second, config=config)
    second.train(resume_from_checkpoint=True)
    (resumed,) = all_runs(uri)
    assert resumed.info.run_id == run.info.run_id
    assert metric_steps(uri, run.info.run_id, "loss") == [1, 2, 3, 4, 5, 6]
    assert resumed.data.tags.get("harness.param_changed_on_resume.trainer.max_steps") == "6"
    third = make_trainer(output_dir=out, max_steps=2)
    harness.attach(third, config=config)
    third.train()
    assert len(all_runs(uri)) == 2


def test_unreachable_server_falls_back_to_the_local_store_with_nothing_lost(make_trainer: Any) -> None:
    dead = f"http://127.0.0.1:{free_port()}"
    trainer = make_trainer(max_steps=4)
    harness.attach(trainer, config={"plugins": ["mlflow"], "mlflow": {"tracking_uri": dead, "final_flush_timeout_s": 1, "retry_interval_s": 0.5}})
    trainer.train()
    assert trainer.state.global_step == 4
    degraded = findings_of(trainer.args.output_dir, "TRACKING_DEGRADED")
    assert degraded and dead in degraded[0]["message"]  # reported at the first step end after the writer's first attempt
    fallback = degraded[-1]
    assert fallback["severity"] == "error" and fallback["evidence"]["local_run_id"]
    uri = _store(trainer.args.output_dir)
    (run,) = all_runs(uri)
    assert run.info.run_id == fallback["evidence"]["local_run_id"]
    assert metric_steps(uri, run.info.run_id, "loss") == [1, 2, 3, 4]
    assert run.data.tags["harness.fallback_for"].startswith(dead)
    # made while the tracker closed, after the report was first written: the local report was rewritten to show it
    report = (Path(trainer.args.output_dir) / "harness" / "report.md").read_text(encoding="utf-8")
    assert "| [TRACKING_DEGRADED](report/playbooks/tracking.md#tracking_degraded) |" in report and "### error" in report



class _ServerFlipper:
    """Kills the tracking server after step `down` and brings it back after step `up`, mid-training."""

    name = "server_flipper"

    def __init__(self, server: MlflowServer, down: int, up: int) -> None:
        self.server, self.down, self.up = server, down, up

    @hookimpl
    def on_step_end(self, step: int) -> None:
        if step == self.down:
            self.server.stop()
        elif step == self.up:
            time.sleep(3)  # let the writer meet the dead server a few times
            self.server.start()


@pytest.mark.slow
def test_server_outage_mid_run_loses_and_duplicates_nothing(make_trainer: Any, mlflow_server: MlflowServer) -> None:
    trainer = make_trainer(max_steps=12)
    harness.attach(
        trainer,
        plugins=[_ServerFlipper(mlflow_server, down=3, up=7)],
        config={"plugins": ["mlflow"], "mlflow": {"tracking_uri": mlflow_server.uri, "retry_interval_s": 0.5, "flush_interval_s": 0.2}},
    )
    trainer.train()
    degraded = findings_of(trainer.args.output_dir, "TRACKING_DEGRADED")
    assert degraded and 3 <= degraded[0]["step"] <= 12 and mlflow_server.uri in degraded[0]["message"]
    assert all(f["severity"] != "error" for f in degraded)  # recovered: no fallback was needed
    (run,) = all_runs(mlflow_server.uri)
    assert run.info.status == "FINISHED"
    for key in ("loss", "grad_norm", "learning_rate"):
        history = [m.step for m in mlflow_client(mlflow_server.uri).get_metric_history(run.info.run_id, key)]
        assert sorted(history) == list(range(1, 13)), (key, history)  # complete, no duplicates


@pytest.mark.slow
def test_resume_against_a_server_reattaches(make_trainer: Any, mlflow_server: MlflowServer, tmp_path: Path) -> None:
    out = tmp_path / "srv-resume"
    config = {"plugins": ["mlflow"], "mlflow": {"tracking_uri": mlflow_server.uri}}
    first = make_trainer(output_dir=out, max_steps=2, save_strategy="steps", save_steps=2)
    harness.attach(first, config=config)
    first.train()
    second = make_trainer(output_dir=out, max_steps=4, save_strategy="steps", save_steps=2)
    harness.attach(second, config=config)
    second.train(resume_from_checkpoint=True)
    (run,) = all_runs(mlflow_server.uri)
    assert sorted(m.step for m in mlflow_client(mlflow_server.uri).get_metric_history(run.info.run_id, "loss")) == [1, 2, 3, 4]


@pytest.mark.slow
def test_two_processes_make_exactly_one_run(tmp_path: Path) -> None:
    out = tmp_path / "ddp"
    result = harness_cli("wrap", "--plugins", "mlflow", "--", *torchrun(), str(EXAMPLE), "--output_dir", str(out), "--max_steps", "4")
    assert result.returncode == 0, result.stderr[-3000:]
    (run,) = all_runs(_store(out))
    assert metric_steps(_store(out), run.info.run_id, "loss") == [1, 2, 3, 4]
    assert run.data.tags["harness.world_size"] == "2"


def test_a_skipped_step_is_counted_under_the_name_report_to_gives_it(make_trainer: Any) -> None:
    """`harness/skipped_steps` (the running count) whether the mlflow plugin or report_to's feed logs the run."""
    trainer = make_trainer(max_steps=4)
    harness.attach(trainer, config={"plugins": ["mlflow", FAULTS], "fault_injector": {"report_at_step": 2, "action": "skip_step"}})
    trainer.train()
    uri = _store(trainer.args.output_dir)
    (run,) = all_runs(uri)
    history = mlflow_client(uri).get_metric_history(run.info.run_id, "harness/skipped_steps")
    assert [(m.step, m.value) for m in history] == [(2, 1.0)]
    assert metric_steps(uri, run.info.run_id, "harness/skipped_step") == [2]


@pytest.mark.slow
def test_a_killed_process_records_reach_mlflow_when_its_run_resumes(tmp_path: Path) -> None:
    """Issue 44 item 6: the tracker down from the first step, the process killed at step 9, the tracker back, the run
    resumed from checkpoint-5: the killed process's journal is delivered into the run before the resumed job's own,
    so its loss history starts at step 1 and its TRACKING_DEGRADED reached MLflow (before: steps 1-5 and the finding
    never arrived, and the resumed job said nothing)."""
    server = MlflowServer(tmp_path)  # its port is reserved; nothing listens there until start()
    out = tmp_path / "run"
    config = write_yaml(tmp_path / "h.yaml", {
        "plugins": ["mlflow", FAULTS], "fault_injector": {"kill_at_step": 9},
        "mlflow": {"tracking_uri": server.uri, "retry_interval_s": 0.5, "final_flush_timeout_s": 1, "http_timeout_s": 2}})
    killed = wrapped_example(out, config, steps=12, save_steps=5)
    assert killed.returncode != 0 and (out / "checkpoint-5").is_dir(), killed.stderr[-3000:]
    assert findings_of(out, "TRACKING_DEGRADED")
    server.start()
    try:
        resumed = wrapped_example(out, config, "--resume_from_checkpoint", str(out / "checkpoint-5"), steps=12, save_steps=5)
        assert resumed.returncode == 0, resumed.stderr[-3000:]
        assert "an earlier process of this run left undelivered" in resumed.stderr + resumed.stdout
        (run,) = all_runs(server.uri)
        assert sorted(set(metric_steps(server.uri, run.info.run_id, "loss"))) == list(range(1, 13))
        assert run.data.tags.get("harness.finding.TRACKING_DEGRADED", "").startswith("1 (warning)")
        assert run.info.status == "FINISHED"  # the killed process's journal holds no status to undo it
    finally:
        server.stop()


@pytest.mark.slow
def test_records_of_a_process_killed_during_an_outage_reach_its_run_on_resume(tmp_path: Path) -> None:
    """Issue 44 item 6, as the audit did it: the tracker goes down at step 3 of a run it already holds, the process is
    killed at step 9, the tracker comes back, the run resumes from checkpoint-5 into the same MLflow run: the killed
    process's journal (steps 3-8, its TRACKING_DEGRADED) is delivered there first (before: steps 3-5 never arrived)."""
    from conftest import EXAMPLE, REPO

    server = MlflowServer(tmp_path)
    server.start()
    out = tmp_path / "run"
    config = write_yaml(tmp_path / "h.yaml", {
        "plugins": ["mlflow", FAULTS, "stop_server:StopServerAtStep"], "fault_injector": {"kill_at_step": 9},
        "mlflow": {"tracking_uri": server.uri, "retry_interval_s": 0.5, "final_flush_timeout_s": 1, "http_timeout_s": 2}})
    assert server.proc is not None
    env = {"PYTHONPATH": os.pathsep.join([str(REPO / "tests"), os.environ.get("PYTHONPATH", "")]), "DS_ACCELERATOR": "cpu",
           "STOP_SERVER_AT_STEP": "3", "STOP_SERVER_PGID": str(server.proc.pid)}
    script = [sys.executable, str(EXAMPLE), "--output_dir", str(out), "--max_steps", "12", "--save_steps", "5"]
    killed = harness_cli("wrap", "--config", str(config), "--", *script, env=env)
    assert killed.returncode != 0 and (out / "checkpoint-5").is_dir(), killed.stderr[-3000:]
    server.start()
    try:
        resumed = harness_cli("wrap", "--config", str(config), "--", *script, "--resume_from_checkpoint", str(out / "checkpoint-5"),
                              env={**env, "STOP_SERVER_AT_STEP": "0"})
        assert resumed.returncode == 0, resumed.stderr[-3000:]
        (run,) = all_runs(server.uri)  # one run: the resume continued the run the killed process made
        assert sorted(set(metric_steps(server.uri, run.info.run_id, "loss"))) == list(range(1, 13))
        assert run.data.tags.get("harness.finding.TRACKING_DEGRADED", "").startswith("1 (warning)")
    finally:
        server.stop()
