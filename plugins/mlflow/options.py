"""Options of the ``mlflow`` plugin (their own module: ``harness wrap`` validates them without loading the tracker)."""
from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field


class MlflowOptions(BaseModel):
    """Options of the ``mlflow`` plugin."""

    model_config = ConfigDict(extra="forbid")

    tracking_uri: str | None = Field(
        None,
        description="Tracking URI. Default: HF's run's when the Trainer reports to MLflow, else $MLFLOW_TRACKING_URI, "
        "else a SQLite store at <output_dir>/harness/mlflow/mlflow.db.",
    )
    experiment_name: str | None = Field(None, description="Experiment. Default: $MLFLOW_EXPERIMENT_NAME, else 'train-harness'.")
    run_name: str | None = Field(None, description="Run name. Default: the Trainer's run_name.")
    run_id: str | None = Field(
        None, description="Log into this existing run. Default: HF's active run, else $MLFLOW_RUN_ID, else the resumed run or a new one."
    )
    join_hf_run: bool = Field(
        True,
        description="When the Trainer reports to MLflow (report_to mlflow) or the script has an active run, log into "
        "that run, its experiment and tracking URI (not when tracking_uri or run_id is set).",
    )
    keep_hf_run_open: bool = Field(
        True,
        description="Keep HF's run open after train() until the process exits (HF's __del__ or MLflow's exit handler "
        "ends it), so that a later evaluate() logs into it too; false: HF ends it at train end, as without the harness.",
    )
    tags: dict[str, str] = Field(default_factory=dict, description="Run tags, added to those of $MLFLOW_TAGS (a JSON object).")
    flush_interval_s: float = Field(1.0, gt=0, description="How often the background writer sends queued records.")
    retry_interval_s: float = Field(2.0, gt=0, description="Wait between attempts while the tracker is unreachable.")
    final_flush_timeout_s: float = Field(
        30.0, ge=0, description="At run end, how long to wait for an unreachable tracker before replaying into the local store."
    )
    http_timeout_s: int = Field(10, ge=1, description="HTTP timeout per request (sets MLFLOW_HTTP_REQUEST_TIMEOUT unless already set).")
    max_param_length: int = Field(6000, ge=50, description="Longer parameter values are cut, with a '...[truncated N chars]' marker.")
    max_artifact_mb: float = Field(100.0, ge=0, description="Upload cap for evidence artifacts (captures, reports) per run, in MB.")
    log_checkpoints: bool = Field(False, description="Also upload the last checkpoint directory at run end (never by default).")
    system_metrics: bool = Field(False, description="Log MLflow system metrics (CPU, memory, GPU) for the run (needs psutil).")
    batch_size: int = Field(900, ge=1, le=1000, description="Records per delivery round.")
