"""What the ``mlflow`` plugin uploads at run end, within a size budget, and MLflow's optional system metrics."""
from __future__ import annotations

import logging
import threading
from pathlib import Path
from typing import Any

from harness.plugins.mlflow.writer import MlflowWriter, truncate

log = logging.getLogger("harness.mlflow")

ARTIFACT_FILES = ("findings.jsonl", "config.yaml", "metrics.jsonl", "steps.jsonl", "run.json", "report.md", "report.html", "run_card.json")
ARTIFACT_DIRS = ("captures", "contamination", "report")


def artifact_records(run_dir: Path, max_artifact_mb: float, checkpoint: Path | None = None) -> list[dict[str, Any]]:
    """Journal records for the run directory's evidence (and ``checkpoint``) in order, within the budget, plus a tag naming what did not fit."""
    budget = int(max_artifact_mb * 1024 * 1024)
    candidates = [run_dir / name for name in ARTIFACT_FILES] + [run_dir / name for name in ARTIFACT_DIRS]
    if checkpoint is not None:
        candidates.append(checkpoint)
    records: list[dict[str, Any]] = []
    skipped: list[str] = []
    for path in candidates:
        if not path.exists():
            continue
        size = sum(f.stat().st_size for f in path.rglob("*") if f.is_file()) if path.is_dir() else path.stat().st_size
        if size > budget:
            skipped.append(f"{path.name} ({size / 1e6:.1f} MB)")
            continue
        budget -= size
        artifact_dir = "harness" if path.parent == run_dir else "checkpoint"
        records.append({"k": "a", "path": str(path), "dir": f"{artifact_dir}/{path.name}" if path.is_dir() else artifact_dir})
    if skipped:
        records.append({"k": "t", "key": "harness.artifacts_skipped", "value": truncate(", ".join(skipped), 5000)})
    return records


def last_checkpoint(trainer: Any) -> Path | None:
    from transformers.trainer_utils import get_last_checkpoint

    last = get_last_checkpoint(trainer.args.output_dir)
    return Path(last) if last else None


class SystemMetrics:
    """MLflow's system metrics monitor for the writer's run, started once the run exists (needs psutil)."""

    def __init__(self, writer: MlflowWriter) -> None:
        self.writer = writer
        self.monitor: Any = None
        threading.Thread(target=self._start_when_run_exists, daemon=True, name="harness-mlflow-sysmetrics").start()

    def _start_when_run_exists(self) -> None:
        if not self.writer.run_ready.wait(120):
            return
        try:
            from mlflow.system_metrics.system_metrics_monitor import SystemMetricsMonitor

            self.monitor = SystemMetricsMonitor(self.writer.target.run_id)
            self.monitor.start()
        except Exception as exc:  # noqa: BLE001 - optional extra (psutil), never fatal
            log.warning("harness mlflow: system metrics unavailable: %s", exc)

    def finish(self) -> None:
        if self.monitor is not None:
            self.monitor.finish()
