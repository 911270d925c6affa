"""mlflow: every number, finding and piece of evidence of a run in MLflow, without slowing or losing the run.

Rank 0 only. The training thread enqueues records (microseconds); a
background writer journals and delivers them (see ``harness.plugins.mlflow.writer``).
When the Trainer reports to MLflow itself (``report_to mlflow``) the plugin
logs into HF's run (``harness.plugins.mlflow.target``): one job, one run.
Otherwise the default store is a SQLite file in the run directory, so
nothing needs a server; ``MLFLOW_TRACKING_URI``/``MLFLOW_EXPERIMENT_NAME``/
``MLFLOW_RUN_ID``/``MLFLOW_TAGS`` and this plugin's options point it
elsewhere, with the same meaning as in transformers' own MLflow integration.
"""
from __future__ import annotations

import logging
import os
import time
from pathlib import Path
from typing import Any

from harness.core.findings import Finding, FindingCode, Severity
from harness.core.hookspecs import hookimpl
from harness.core.plugin import Plugin
from harness.lib.journal import Journal
from harness.core.offline import disable_telemetry
from harness.plugins.mlflow.evidence import SystemMetrics, artifact_records, last_checkpoint
from harness.plugins.mlflow.options import MlflowOptions
from harness.plugins.mlflow.outboxes import leftovers, write_target
from harness.plugins.mlflow.target import JoinedRun, describe_target, end_stale_hold, env_tags, hf_mlflow_callback, join_run
from harness.plugins.mlflow.writer import (
    MlflowWriter,
    RunTarget,
    default_http_settings,
    flatten,
    metric_records,
    truncate,
)

log = logging.getLogger("harness.mlflow")

TRACKING_DEGRADED = FindingCode(
    "TRACKING_DEGRADED",
    Severity.WARNING,
    "The tracker was unreachable or refused records; training went on and records were kept locally.",
    "tracking#tracking_degraded",
)


class MlflowTracker(Plugin):
    """Logs params, metrics, findings and evidence of the run to MLflow from rank 0, in the background."""

    name = "mlflow"
    Options = MlflowOptions
    CODES = (TRACKING_DEGRADED,)

    def __init__(self) -> None:
        self.options = MlflowOptions()
        self.writer: MlflowWriter | None = None
        self.training_thread_seconds = 0.0  # per-step time on the training thread, start-up excluded (benchmarks read it)
        self._finding_counts: dict[str, int] = {}
        self._skipped_steps = 0  # optimizer steps the harness skipped in this run (harness/skipped_steps)
        self._skipped_keys: set[str] = set()
        self._trainer: Any = None
        self._tracking_uri = ""
        self._status = "crashed"
        self._joined: JoinedRun | None = None
        self._system_metrics: SystemMetrics | None = None

    def setup(self, ctx: Any) -> None:
        if ctx.is_main:
            end_stale_hold(getattr(ctx, "trainer", None))

    # -- start -----------------------------------------------------------------------------

    def _default_store(self, ctx: Any) -> tuple[str, str]:
        store = ctx.run_dir / "mlflow"
        store.mkdir(parents=True, exist_ok=True)
        return f"sqlite:///{(store / 'mlflow.db').resolve()}", (store / "artifacts").resolve().as_uri()

    def _start(self, ctx: Any, resumed_run: str | None, joined: JoinedRun | None = None) -> None:
        # no usage telemetry from the harness's tracking (also under wrap/attach); effective when this imports mlflow first
        disable_telemetry()
        o = self.options
        default_uri, default_artifacts = self._default_store(ctx)
        self._joined = joined
        if joined is not None:  # HF's (or the script's) run: its store, experiment and name
            uri, run_id, experiment, run_name = joined.tracking_uri, joined.run_id, joined.experiment_name, None
        else:
            uri = o.tracking_uri or os.environ.get("MLFLOW_TRACKING_URI") or default_uri
            run_id = o.run_id or os.environ.get("MLFLOW_RUN_ID") or resumed_run
            experiment = o.experiment_name or os.environ.get("MLFLOW_EXPERIMENT_NAME") or "train-harness"
            run_name = truncate(str(o.run_name or getattr(getattr(self._trainer, "args", None), "run_name", None) or ""), 250) or None
        self._tracking_uri = uri
        if uri.startswith("http"):
            default_http_settings(o.http_timeout_s)
        tags = {**env_tags(), **o.tags, "harness.rank0_output_dir": str(ctx.run_dir.parent), "harness.world_size": str(ctx.world_size)}
        target = RunTarget(
            tracking_uri=uri,
            experiment_name=experiment,
            run_name=run_name,
            tags=tags,
            artifact_location=default_artifacts if uri == default_uri else None,
            run_id=run_id,
        )
        session = f"{time.strftime('%Y%m%d-%H%M%S')}-{os.getpid()}"
        journal = Journal(ctx.run_dir / "mlflow" / f"outbox-{session}.jsonl")
        write_target(journal.path, uri, run_id)
        earlier = self._earlier_journals(journal.path, uri, run_id, resumed=ctx.resumed_from is not None)
        self.writer = MlflowWriter(
            target, journal, run_file=ctx.run_dir / "mlflow" / "run.json",
            flush_interval_s=o.flush_interval_s, retry_interval_s=o.retry_interval_s, batch_size=o.batch_size,
            earlier=earlier,
        )
        if not uri.startswith(("http://", "https://", "databricks")):
            # A local store costs seconds of CPU once (imports, schema migrations): pay them here, before
            # the first step, rather than in the writer thread competing with training for the cores.
            self.writer.prepare()
        self.writer.start()
        log.info("harness mlflow: %s", describe_target(target, joined, o, resumed_run))
        self._queue_params(ctx)
        if o.system_metrics:
            self._system_metrics = SystemMetrics(self.writer)

    def _earlier_journals(self, current: Path, uri: str, run_id: str | None, resumed: bool) -> list[Journal]:
        """The journals earlier processes of this run directory left undelivered (killed while the tracker was down):
        those for this run, to deliver before this job's own; the others named in a finding (they wait for a job that
        logs to their run)."""
        found = leftovers(current.parent, current)
        mine = [one for one in found if one.belongs_to(uri, run_id, resumed)]
        others = [one for one in found if one not in mine]
        if mine:
            log.info("harness mlflow: %d journal(s) of earlier processes hold records MLflow never got; delivering "
                     "them first: %s", len(mine), ", ".join(one.describe() for one in mine))
        if others:
            self.report(
                TRACKING_DEGRADED.code,
                f"{len(others)} journal(s) of earlier processes in {current.parent} hold records MLflow never got, for "
                f"another run than this job's ({', '.join(one.describe() for one in others[:5])}"
                f"{' ...' if len(others) > 5 else ''}): they stay there, and a job that resumes that run from a checkpoint "
                "of this output_dir with the same tracking URI delivers them.",
                evidence={"journals": [str(one.path) for one in others],
                          "unsent_bytes": {one.path.name: one.unsent_bytes for one in others}, "tracking_uri": uri},
            )
        return [Journal(one.path, writable=False) for one in mine]

    def _join(self, trainer: Any) -> JoinedRun | None:
        """HF's run (``report_to mlflow``) or the script's active run, unless the options point elsewhere."""
        o = self.options
        if not o.join_hf_run:
            return None
        if o.tracking_uri or o.run_id:
            if hf_mlflow_callback(trainer) is not None:
                log.info("harness mlflow: HF's MLflowCallback keeps its own run; the harness logs where mlflow.%s says "
                         "(leave tracking_uri and run_id unset to log into HF's run)", "tracking_uri" if o.tracking_uri else "run_id")
            return None
        joined = join_run(trainer)
        if joined is not None and o.keep_hf_run_open:
            joined.hold()
        return joined

    def _queue_params(self, ctx: Any) -> None:
        params: dict[str, str] = {}
        args = getattr(self._trainer, "args", None)
        hf_logs_them = self._joined is not None and self._joined.from_hf  # HF logged the arguments and model config itself
        if args is not None and not hf_logs_them:
            params.update(flatten(args.to_dict(), "trainer."))
        model = getattr(self._trainer, "model", None)
        config = getattr(model, "config", None)
        if config is not None and hasattr(config, "to_dict") and not hf_logs_them:
            params.update(flatten(config.to_dict(), "model."))
        params.update(flatten(ctx.config.model.model_dump(mode="json"), "harness."))
        params["harness.plugins"] = ",".join(ctx.config.enabled)
        limit = self.options.max_param_length
        for key, value in params.items():
            self.writer.put({"k": "p", "key": key[:250], "value": truncate(value, limit)})  # type: ignore[union-attr]

    @hookimpl
    def on_run_start(self, ctx: Any, trainer: Any) -> None:
        if not ctx.is_main:
            return
        self._trainer = trainer
        joined = self._join(trainer)
        if joined is not None or ctx.resumed_from is None:
            self._start(ctx, None, joined)  # a resume of its own run waits for on_resume, which knows the run to continue

    @hookimpl
    def on_resume(self, ctx: Any, checkpoint_dir: Path, state: dict[str, Any] | None) -> None:
        if not ctx.is_main or self.writer is not None:
            return
        stored = state or {}
        same_store = stored.get("tracking_uri") in (None, self.options.tracking_uri or os.environ.get("MLFLOW_TRACKING_URI") or self._default_store(ctx)[0])
        self._start(ctx, stored.get("run_id") if same_store else None)

    # -- every log / metric / finding ----------------------------------------------------------

    def _put_metrics(self, values: dict[str, Any], step: int) -> None:
        began = time.perf_counter()
        records, skipped = metric_records(values, step)
        for record in records:
            self.writer.put(record)  # type: ignore[union-attr]
        for key in skipped:
            if key not in self._skipped_keys:
                self._skipped_keys.add(key)
                log.info("harness mlflow: metric %r is not a number; not logged", key)
        self.training_thread_seconds += time.perf_counter() - began

    @hookimpl
    def on_log(self, ctx: Any, step: int, logs: dict[str, Any]) -> None:
        if self.writer is not None and not (self._joined is not None and self._joined.from_hf):  # HF logs the Trainer's logs itself
            self._put_metrics(logs, step)

    @hookimpl
    def on_metrics(self, ctx: Any, step: int, metrics: dict[str, Any]) -> None:
        if self.writer is not None:
            self._put_metrics(metrics, step)

    @hookimpl
    def on_step_end(self, ctx: Any, step: int, metrics: dict[str, Any]) -> None:
        if self.writer is None:
            return
        if metrics.get("skipped"):
            self._skipped_steps += 1  # the event, and the running count under the name report_to's feed gives it
            self._put_metrics({"harness/skipped_step": 1.0, "harness/skipped_steps": float(self._skipped_steps)}, step)
        self._report_events(ctx)

    @hookimpl
    def on_finding(self, ctx: Any, finding: Finding) -> None:
        if self.writer is None:
            return
        began = time.perf_counter()
        count = self._finding_counts.get(finding.code, 0) + 1
        self._finding_counts[finding.code] = count
        step = finding.step if finding.step is not None else ctx.step
        self.writer.put({"k": "m", "key": f"harness/findings/{finding.code}", "value": float(count), "ts": int(finding.time * 1000), "step": int(step)})
        total = sum(self._finding_counts.values())
        self.writer.put({"k": "m", "key": "harness/findings/total", "value": float(total), "ts": int(finding.time * 1000), "step": int(step)})
        self.writer.put({"k": "t", "key": f"harness.finding.{finding.code}", "value": f"{count} ({finding.severity.value}), last at step {step}"})
        self.writer.put({"k": "a", "path": str(ctx.run_dir / "findings.jsonl"), "dir": "harness"})
        self.training_thread_seconds += time.perf_counter() - began

    def _report_events(self, ctx: Any) -> None:
        for kind, message in self.writer.take_events() if self.writer else []:
            if kind == "degraded":
                self.report(
                    TRACKING_DEGRADED.code,
                    f"MLflow tracker at {self._tracking_uri} is unreachable ({message}); training goes on, "
                    "records wait in the local journal and are replayed in order when it answers.",
                    evidence={"tracking_uri": self._tracking_uri, "error": message, "journal": str(self.writer.journal.path) if self.writer else None},
                )
            elif kind == "rejected":
                self.report(
                    TRACKING_DEGRADED.code,
                    f"MLflow refused a record ({message}); it is skipped, the rest is logged.",
                    evidence={"tracking_uri": self._tracking_uri, "rejected": message},
                    severity=Severity.INFO,
                )
            else:
                log.warning("harness mlflow: %s", message)

    # -- checkpoints and end -----------------------------------------------------------------------

    @hookimpl
    def checkpoint_state(self, ctx: Any, step: int) -> dict[str, Any] | None:
        if not ctx.is_main or self.writer is None:
            return None
        self.writer.run_ready.wait(5)  # the run is normally created within a second of the start
        return {"run_id": self.writer.target.run_id, "tracking_uri": self._tracking_uri}

    @hookimpl
    def on_run_end(self, status: str) -> None:
        self._status = status

    @hookimpl
    def on_report(self, ctx: Any) -> None:
        """The report exists now: upload it with the other artifacts, then finish the MLflow run."""
        writer = self.writer
        if writer is None:
            return
        self._queue_artifacts(ctx)
        if self._joined is None:
            writer.put({"k": "status", "status": {"completed": "FINISHED", "stopped": "FINISHED"}.get(self._status, "FAILED")})
        else:  # someone else's run: its owner ends it (see JoinedRun.release)
            writer.put({"k": "t", "key": "harness.status", "value": self._status})
        unsent = writer.close(self.options.final_flush_timeout_s)
        if self._joined is not None:
            self._joined.release(self._status)
        self._report_events(ctx)
        if writer.earlier:
            self.report(
                TRACKING_DEGRADED.code,
                f"the journals earlier processes left undelivered ({', '.join(j.path.name for j in writer.earlier)}) could "
                f"not be delivered to {writer.target.tracking_uri} either ({writer.last_error}); they stay in "
                f"{writer.journal.path.parent}, and the next job that resumes this run delivers them.",
                evidence={"journals": [str(j.path) for j in writer.earlier], "error": writer.last_error},
            )
        if unsent:
            self._replay_locally(ctx, writer)
        if self._system_metrics is not None:
            self._system_metrics.finish()
            self._system_metrics = None
        self.writer = None

    def _queue_artifacts(self, ctx: Any) -> None:
        checkpoint = last_checkpoint(self._trainer) if self.options.log_checkpoints and self._trainer is not None else None
        for record in artifact_records(ctx.run_dir, self.options.max_artifact_mb, checkpoint):
            self.writer.put(record)  # type: ignore[union-attr]

    def _replay_locally(self, ctx: Any, writer: MlflowWriter) -> None:
        """The tracker never came back: replay the whole journal into the local store, so nothing is lost."""
        uri, artifacts = self._default_store(ctx)
        if writer.target.tracking_uri == uri:
            self.report(
                TRACKING_DEGRADED.code,
                f"the local MLflow store {uri} could not take every record; the rest is in {writer.journal.path}.",
                evidence={"journal": str(writer.journal.path), "error": writer.last_error},
                severity=Severity.ERROR,
            )
            return
        target = RunTarget(
            tracking_uri=uri,
            experiment_name=writer.target.experiment_name,
            run_name=writer.target.run_name,
            tags={**writer.target.tags, "harness.fallback_for": f"{writer.target.tracking_uri} run {writer.target.run_id}"},
            artifact_location=artifacts,
        )
        local = MlflowWriter(target, Journal(writer.journal.path, cursor="local-cursor"), run_file=ctx.run_dir / "mlflow" / "local-run.json")
        local.start()
        unsent = local.close(self.options.final_flush_timeout_s)
        self.report(
            TRACKING_DEGRADED.code,
            f"MLflow tracker {writer.target.tracking_uri} stayed unreachable to the end ({writer.last_error}); the complete run "
            f"was written to the local store {uri} (run {target.run_id})" + (f"; {unsent} bytes remain in {writer.journal.path}" if unsent else "."),
            evidence={"tracking_uri": writer.target.tracking_uri, "local_uri": uri, "local_run_id": target.run_id, "journal": str(writer.journal.path)},
            severity=Severity.ERROR,
        )
