"""Findings and harness metrics in the user's own trackers: TensorBoard event files and a W&B offline run, read back.

The trackers are the real ones (``report_to``: TensorBoard's writer, W&B in
offline mode); what they wrote is read back with TensorBoard's own event
reader and by decoding the W&B run file's records with W&B's protobufs.
"""
from __future__ import annotations

import json
import struct
import sys
from pathlib import Path
from typing import Any

import pytest

from conftest import EXAMPLE, FAULTS, findings_of, harness_cli, write_yaml
from harness.core.findings import Finding, Severity
from harness.core.options import TrackerOptions
from harness.hf.tracker_feed import TrackerFeed, TrackerFeedEnd
from mlflow_server import MlflowServer, all_runs, metric_steps, mlflow_server  # noqa: F401 (a fixture)

PY = sys.executable


def _finding(code: str, severity: Severity = Severity.WARNING, step: int = 3) -> Finding:
    return Finding(code=code, severity=severity, plugin="p", message=f"{code} happened", step=step, rank=0)


def test_scalars_carry_the_latest_metrics_skipped_steps_and_a_count_per_code() -> None:
    feed = TrackerFeed(TrackerOptions(), is_main=True)
    feed.note_metrics({"throughput/tokens_per_s": 10.0, "note": "text", "flag": True})
    feed.note_metrics({"throughput/tokens_per_s": 12.5})
    feed.note_step(skipped=True)
    feed.note_step(skipped=False)
    feed.note_finding(_finding("LOSS_SPIKE"))
    feed.note_finding(_finding("LOSS_SPIKE"))
    feed.note_finding(_finding("RUN_CARD", Severity.INFO))  # under the level: not counted
    assert feed.scalars() == {
        "harness/throughput/tokens_per_s": 12.5, "harness/skipped_steps": 1.0,
        "harness/findings/total": 2.0, "harness/findings/LOSS_SPIKE": 2.0,
    }
    quiet = TrackerFeed(TrackerOptions(findings=False, metrics=True), is_main=True)
    quiet.note_finding(_finding("LOSS_SPIKE"))
    assert quiet.scalars() == {"harness/skipped_steps": 0.0}
    assert not TrackerFeed(TrackerOptions(), is_main=False).enabled  # only rank 0 writes to trackers


def test_the_feed_wraps_the_integrations_and_takes_its_keys_back(make_trainer: Any, tmp_path: Path) -> None:
    """Feed, integrations, end: the integrations see the harness keys, the console and the harness's on_log do not."""
    trainer = make_trainer(report_to=["tensorboard"])
    feed = TrackerFeed(TrackerOptions(), is_main=True)
    feed.install(trainer)
    kinds = [type(cb).__name__ for cb in trainer.callback_handler.callbacks]
    at = kinds.index("TrackerFeed")
    assert kinds[at : at + 3] == ["TrackerFeed", "TensorBoardCallback", "TrackerFeedEnd"], kinds
    assert kinds.index("TrackerFeedEnd") < kinds.index("PrinterCallback")  # the console's log line stays as it was
    feed.note_step(skipped=True)
    seen: dict[str, Any] = {}

    class Spy:  # stands where an integration stands: between the feed and its end
        def on_log(self, args: Any, state: Any, control: Any, logs: dict[str, Any], **kwargs: Any) -> None:
            seen.update(logs)

    trainer.callback_handler.callbacks.insert(at + 1, Spy())
    logs = {"loss": 1.0}
    trainer.callback_handler.on_log(trainer.args, trainer.state, trainer.control, logs)
    assert seen["harness/skipped_steps"] == 1.0 and seen["loss"] == 1.0
    assert logs == {"loss": 1.0}
    seen.clear()  # an evaluation's log at the same step: the harness series are not recorded a second time
    trainer.callback_handler.on_log(trainer.args, trainer.state, trainer.control, {"eval_loss": 2.0})
    assert seen == {"eval_loss": 2.0}, seen
    alone = make_trainer(report_to="none")
    none = TrackerFeed(TrackerOptions(), is_main=True)
    none.install(alone)
    assert not none.enabled and not any(isinstance(cb, (TrackerFeed, TrackerFeedEnd)) for cb in alone.callback_handler.callbacks)
    loop = TrackerFeed(TrackerOptions(), is_main=True)
    loop.install(object())  # a Trainer-like loop without a callback handler (tests/e2e/fsdp_driver.py's): no feed
    assert not loop.enabled


def test_the_harness_mlflow_plugin_keeps_hf_s_mlflow_run_to_itself(make_trainer: Any) -> None:
    trainer = make_trainer(report_to=["mlflow"])
    feed = TrackerFeed(TrackerOptions(), is_main=True, mlflow_plugin=True)
    feed.install(trainer)
    assert not feed.enabled  # nothing else to feed: the plugin writes the curves and tags of that run
    other = TrackerFeed(TrackerOptions(), is_main=True, mlflow_plugin=False)
    other.install(make_trainer(report_to=["mlflow"]))
    assert [type(cb).__name__ for cb in other.covered] == ["MLflowCallback"]


def _wandb_records(run_file: Path) -> list[Any]:
    """Every record of a W&B run file (a LevelDB-style log of 32 KiB blocks after a 7-byte header), decoded."""
    from wandb.proto import wandb_internal_pb2

    data, block, pos, records, partial = run_file.read_bytes(), 32768, 7, [], b""
    while pos + 7 <= len(data):
        if block - pos % block < 7:  # a block's tail too short for a header is padding
            pos += block - pos % block
            continue
        _crc, length, kind = struct.unpack("<IHB", data[pos : pos + 7])
        chunk, pos = data[pos + 7 : pos + 7 + length], pos + 7 + length
        if kind == 0:
            pos += (block - pos % block) % block
            continue
        partial = chunk if kind in (1, 2) else partial + chunk  # full/first start a record, middle/last extend it
        if kind in (1, 4):
            record = wandb_internal_pb2.Record()
            record.ParseFromString(partial)
            records.append(record)
            partial = b""
    return records


@pytest.mark.slow  # a run through `harness wrap` (a subprocess): CI runs it, the quick tier does not
def test_a_wrapped_report_to_script_puts_findings_and_metrics_in_tensorboard_and_wandb(tmp_path: Path) -> None:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    out = tmp_path / "run"
    config = write_yaml(tmp_path / "h.yaml", {"fault_injector": {"nonfinite_loss_at_steps": [2]}})
    result = harness_cli(
        "wrap", "--config", str(config), "--plugins", FAULTS, "--", PY, str(EXAMPLE), "--output_dir", str(out),
        "--max_steps", "5", "--report_to", "tensorboard,wandb",
        env={"WANDB_MODE": "offline", "WANDB_DIR": str(tmp_path), "WANDB_SILENT": "true"},
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert [f["step"] for f in findings_of(out, "NONFINITE_LOSS")] == [2]

    (events,) = (out / "runs").iterdir()  # TensorBoard, read back with its own reader
    tb = EventAccumulator(str(events))
    tb.Reload()
    scalars = {tag: [(e.step, e.value) for e in tb.Scalars(tag)] for tag in tb.Tags()["scalars"]}
    assert scalars["train/harness/findings/NONFINITE_LOSS"][0] == (2, 1.0)  # counted at the step it was made
    assert scalars["train/harness/skipped_steps"][:2] == [(1, 0.0), (2, 1.0)]  # the update of step 2 was skipped
    assert scalars["train/harness/findings/total"][0] == (1, 0.0)
    assert "train/loss" in scalars  # the Trainer's own curve, beside them
    peak = scalars["train/harness/throughput/peak_memory_gb"]  # a plugin's own metric (ctx.log_metrics), not the feed's
    assert peak and all(value > 0.05 for _, value in peak)  # a process that imported torch holds more than 50 MB
    (text,) = [e for e in tb.Tensors("harness/findings/text_summary")]
    assert text.step == 2 and "NONFINITE_LOSS error: loss is nan at step 2" in text.tensor_proto.string_val[0].decode()

    (offline,) = (tmp_path / "wandb").glob("offline-run-*")  # W&B offline: the run file's records and the table file
    records = _wandb_records(next(offline.glob("run-*.wandb")))
    rows = [{"/".join(i.nested_key) or i.key: json.loads(i.value_json) for i in r.history.item}
            for r in records if r.WhichOneof("record_type") == "history"]
    assert any(row.get("train/harness/findings/NONFINITE_LOSS") == 1 and row.get("train/global_step") == 2 for row in rows)
    assert any(row.get("train/harness/skipped_steps") == 1 for row in rows)
    assert [row["train/harness/throughput/peak_memory_gb"] for row in rows if "train/harness/throughput/peak_memory_gb" in row] \
        == pytest.approx([value for _, value in peak], rel=1e-6)  # the same values in both trackers (TensorBoard's are float32)
    alerts = [r.alert for r in records if r.WhichOneof("record_type") == "alert"]
    assert [a.title for a in alerts] == ["harness: NONFINITE_LOSS at step 2"]
    (table_file,) = offline.glob("files/media/table/harness/findings_*.table.json")
    table = json.loads(table_file.read_text())
    assert table["columns"][:3] == ["step", "code", "severity"]
    assert [row[:3] for row in table["data"]][0] == [2, "NONFINITE_LOSS", "error"]


@pytest.mark.slow  # a run through `harness wrap` (a subprocess): CI runs it, the quick tier does not
def test_a_clean_run_gives_the_trackers_zero_counts_and_no_finding_text(tmp_path: Path) -> None:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    out = tmp_path / "run"
    result = harness_cli("wrap", "--", PY, str(EXAMPLE), "--output_dir", str(out), "--max_steps", "4", "--report_to", "tensorboard")
    assert result.returncode == 0, result.stderr[-3000:]
    (events,) = (out / "runs").iterdir()
    tb = EventAccumulator(str(events))
    tb.Reload()
    tags = tb.Tags()
    assert [e.value for e in tb.Scalars("train/harness/findings/total")] == [0.0] * len(tb.Scalars("train/harness/findings/total"))
    assert not [t for t in tags["scalars"] if t.startswith("train/harness/findings/") and not t.endswith("/total")]
    assert "harness/findings/text_summary" not in tags["tensors"]
    assert "Trainer is attempting to log" not in result.stderr  # every added value is a number the integration takes


@pytest.mark.slow  # a real `mlflow server`: CI runs it, the quick tier does not
def test_report_to_mlflow_without_the_plugin_gets_counts_and_tags(make_trainer: Any, mlflow_server: MlflowServer,
                                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    """HF's MLflowCallback alone (the harness's mlflow plugin off): the counts join its curves, the codes tag its run."""
    import harness

    monkeypatch.setenv("MLFLOW_TRACKING_URI", mlflow_server.uri)
    trainer = make_trainer(report_to=["mlflow"], max_steps=4)
    harness.attach(trainer, config={"fault_injector": {"report_at_step": 2}}, plugins=[FAULTS])
    trainer.train()
    (run,) = all_runs(mlflow_server.uri)
    assert run.data.tags["harness.finding.TEST_FAULT"] == "1 (warning), last at step 2" and run.data.tags["harness.findings"] == "1"
    steps = {key: sorted(set(metric_steps(mlflow_server.uri, run.info.run_id, key)))  # step 4 is logged twice (the summary)
             for key in ("harness/findings/TEST_FAULT", "harness/skipped_steps")}
    assert steps == {"harness/findings/TEST_FAULT": [2, 3, 4], "harness/skipped_steps": [1, 2, 3, 4]}
