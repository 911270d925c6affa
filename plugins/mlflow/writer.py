"""The background writer of the ``mlflow`` plugin: journal first, deliver later, never block training.

The training thread only puts small records on a queue. This thread appends
them to a durable journal (``harness/mlflow/outbox-*.jsonl``) and delivers the
journal to MLflow from a persisted cursor with ``log_batch``. When the
tracker is unreachable, records simply wait in the journal (bounded memory)
and are delivered, in order, once it answers again; re-delivery after a
failure is harmless because MLflow merges identical metric rows and params.
"""
from __future__ import annotations

import json
import logging
import os
import queue
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from harness.lib.journal import Journal
from harness.plugins.mlflow.outboxes import write_target

log = logging.getLogger("harness.mlflow")

# Errors that resending cannot fix (bad value, changed param, missing run): drop the record, say so.
PERMANENT_ERRORS = frozenset(
    {"INVALID_PARAMETER_VALUE", "BAD_REQUEST", "RESOURCE_DOES_NOT_EXIST", "RESOURCE_ALREADY_EXISTS", "INVALID_STATE"}
)
MAX_METRICS, MAX_PARAMS, MAX_TAGS = 1000, 100, 100


def is_permanent(exc: BaseException) -> bool:
    return getattr(exc, "error_code", None) in PERMANENT_ERRORS


@dataclass
class RunTarget:
    """Where the records go: tracking URI, experiment and (once known) run."""

    tracking_uri: str
    experiment_name: str
    run_name: str | None
    tags: dict[str, str]
    artifact_location: str | None = None  # only for a store the harness creates itself
    run_id: str | None = None


class MlflowWriter(threading.Thread):
    """Delivers journal records to one MLflow run; reports outages as events for the training thread."""

    def __init__(
        self,
        target: RunTarget,
        journal: Journal,
        run_file: Path | None = None,
        flush_interval_s: float = 1.0,
        retry_interval_s: float = 2.0,
        batch_size: int = 900,
        earlier: list[Journal] | None = None,
    ) -> None:
        super().__init__(name="harness-mlflow-writer", daemon=True)
        self.target = target
        self.journal = journal
        self.run_file = run_file
        self.flush_interval_s = flush_interval_s
        self.retry_interval_s = retry_interval_s
        self.batch_size = batch_size
        self.earlier = list(earlier or [])  # earlier processes' journals for this run: delivered first, oldest first
        self.queue: queue.SimpleQueue[dict[str, Any]] = queue.SimpleQueue()
        self.run_ready = threading.Event()
        self._stop_at: float | None = None
        self._stopping = threading.Event()
        self._events: list[tuple[str, str]] = []
        self._events_lock = threading.Lock()
        self.degraded_since: float | None = None
        self.last_error: str | None = None
        self.delivered = 0
        self.rejected = 0
        self._existing_params: dict[str, str] = {}
        self._client: Any = None

    # -- training-thread side -------------------------------------------------------------------

    def put(self, record: dict[str, Any]) -> None:
        self.queue.put(record)

    def prepare(self) -> None:
        """Create (or reopen) the run now, on the calling thread; on failure the writer retries later."""
        try:
            self._ensure_run()
        except Exception as exc:  # noqa: BLE001 - the background delivery reports and retries
            log.warning("harness mlflow: could not open the run at start: %s", exc)

    def take_events(self) -> list[tuple[str, str]]:
        with self._events_lock:
            events, self._events = self._events, []
        return events

    def close(self, timeout_s: float) -> int:
        """Deliver what is left (waiting up to ``timeout_s`` for an unreachable tracker); return unsent bytes."""
        self._stop_at = time.monotonic() + timeout_s
        self._stopping.set()
        self.join(timeout_s + 30)
        self.journal.close()
        return self.journal.unsent_bytes()

    # -- writer thread ------------------------------------------------------------------------------

    def _event(self, kind: str, message: str) -> None:
        with self._events_lock:
            self._events.append((kind, message))

    def run(self) -> None:
        next_try = 0.0
        while True:
            stopping = self._stopping.is_set()
            self.journal.append(self._drain(0 if stopping else self.flush_interval_s))
            now = time.monotonic()
            delivered_all = False
            if now >= next_try:
                delivered_all = self._deliver()
                if not delivered_all:
                    next_try = now + self.retry_interval_s
            if stopping and self.queue.empty():
                if delivered_all or (self._stop_at is not None and time.monotonic() >= self._stop_at):
                    return
                time.sleep(min(0.2, self.retry_interval_s))

    def _drain(self, timeout: float) -> list[dict[str, Any]]:
        records: list[dict[str, Any]] = []
        try:
            records.append(self.queue.get(timeout=timeout) if timeout > 0 else self.queue.get_nowait())
            while len(records) < 10_000:
                records.append(self.queue.get_nowait())
        except queue.Empty:
            pass
        return records

    def _deliver(self) -> bool:
        """Send everything after the cursor; False when the tracker failed (retry later)."""
        try:
            self._ensure_run()
            while self.earlier:  # before this job's own records, so that the run's history arrives in order
                delivered = self._deliver_journal(self.earlier[0], earlier=True)
                done = self.earlier.pop(0)
                done.close()
                self._event("replayed", f"delivered {delivered} record(s) that an earlier process of this run left "
                                        f"undelivered in {done.path.name}, before this job's own")
            self.delivered += self._deliver_journal(self.journal)
        except Exception as exc:  # noqa: BLE001 - any failure of the tracker is an outage, not a crash
            self.last_error = f"{type(exc).__name__}: {str(exc)[:300]}"
            if self.degraded_since is None:
                self.degraded_since = time.time()
                self._event("degraded", self.last_error)
            return False
        if self.degraded_since is not None:
            self._event("recovered", f"tracker reachable again after {time.time() - self.degraded_since:.1f} s")
            self.degraded_since = None
        return True

    def _deliver_journal(self, journal: Journal, earlier: bool = False) -> int:
        """Send ``journal``'s records after its cursor, committing batch by batch; how many were sent."""
        sent = 0
        while True:
            records, offset = journal.pending(self.batch_size)
            if not records:
                return sent
            if earlier:  # its status and file uploads are its own process's: this job ends the run and uploads the files
                records = [r for r in records if r.get("k") not in ("status", "a")]
            self._send(records)
            journal.commit(offset)
            sent += len(records)

    def client(self) -> Any:
        if self._client is None:
            from mlflow.tracking import MlflowClient

            self._client = MlflowClient(tracking_uri=self.target.tracking_uri)
        return self._client

    def _ensure_run(self) -> None:
        if self.run_ready.is_set():
            return
        client, target = self.client(), self.target
        if target.run_id is None:
            experiment = client.get_experiment_by_name(target.experiment_name)
            experiment_id = (
                experiment.experiment_id
                if experiment is not None
                else client.create_experiment(target.experiment_name, artifact_location=target.artifact_location)
            )
            run = client.create_run(experiment_id, run_name=target.run_name, tags=target.tags)
            target.run_id = run.info.run_id
        else:
            run = client.get_run(target.run_id)
            self._existing_params = dict(run.data.params)
            client.update_run(target.run_id, status="RUNNING")
            if target.tags:
                from mlflow.entities import RunTag

                client.log_batch(target.run_id, tags=[RunTag(k, v) for k, v in target.tags.items()])
        write_target(self.journal.path, target.tracking_uri, target.run_id)
        if self.run_file is not None:
            self.run_file.parent.mkdir(parents=True, exist_ok=True)
            self.run_file.write_text(json.dumps({"run_id": target.run_id, "tracking_uri": target.tracking_uri}), encoding="utf-8")
        self.run_ready.set()

    def _send(self, records: list[dict[str, Any]]) -> None:
        from mlflow.entities import Metric, Param, RunTag

        metrics: list[Any] = []
        params: list[Any] = []
        tags: list[Any] = []
        artifacts: list[dict[str, Any]] = []
        for r in records:
            kind = r.get("k")
            if kind == "m":
                metrics.append(Metric(r["key"], float(r["value"]), r["ts"], r["step"]))  # "nan"/"inf" (strict JSON) too
            elif kind == "p":
                known = self._existing_params.get(r["key"])
                if known is None:
                    params.append(Param(r["key"], r["value"]))
                elif known != r["value"]:  # a resumed run with a changed setting: params are immutable
                    tags.append(RunTag(f"harness.param_changed_on_resume.{r['key']}"[:250], r["value"][:5000]))
            elif kind == "t":
                tags.append(RunTag(r["key"], r["value"]))
            elif kind in ("a", "status"):
                artifacts.append(r)
        run_id = self.target.run_id
        self._log_batches(run_id, metrics, params, tags)
        # one upload per file per delivery round: many findings ask for findings.jsonl many times
        artifacts = list({(r.get("k"), r.get("path"), r.get("dir"), r.get("status")): r for r in artifacts}.values())
        for r in artifacts:
            self._artifact_or_status(run_id, r)
        for p in params:
            self._existing_params[p.key] = p.value

    def _log_batches(self, run_id: str, metrics: list[Any], params: list[Any], tags: list[Any]) -> None:
        client = self.client()
        for start in range(0, len(metrics), MAX_METRICS):
            self._batch(client, run_id, metrics=metrics[start : start + MAX_METRICS])
        for start in range(0, len(params), MAX_PARAMS):
            self._batch(client, run_id, params=params[start : start + MAX_PARAMS])
        for start in range(0, len(tags), MAX_TAGS):
            self._batch(client, run_id, tags=tags[start : start + MAX_TAGS])

    def _batch(self, client: Any, run_id: str, **entities: list[Any]) -> None:
        try:
            client.log_batch(run_id, **entities)
        except Exception as exc:
            if not is_permanent(exc):
                raise
            for kind, items in entities.items():  # salvage what the tracker accepts, one by one
                for item in items:
                    try:
                        client.log_batch(run_id, **{kind: [item]})
                    except Exception as one:
                        if not is_permanent(one):
                            raise
                        self.rejected += 1
                        self._event("rejected", f"{kind[:-1]} {getattr(item, 'key', '?')!r}: {str(one)[:200]}")

    def _artifact_or_status(self, run_id: str, record: dict[str, Any]) -> None:
        client = self.client()
        if record.get("k") == "status":
            client.set_terminated(run_id, status=record["status"])
            return
        path = Path(record["path"])
        if not path.exists():
            return
        try:
            if path.is_dir():
                client.log_artifacts(run_id, str(path), record.get("dir"))
            else:
                client.log_artifact(run_id, str(path), record.get("dir"))
        except OSError as exc:  # a local file problem is not an outage
            self._event("rejected", f"artifact {path}: {exc}")


def metric_records(values: dict[str, Any], step: int, ts_ms: int | None = None) -> tuple[list[dict[str, Any]], list[str]]:
    """Journal records for numeric values; the keys of values that are not numbers (skipped)."""
    ts = int(time.time() * 1000) if ts_ms is None else ts_ms
    records, skipped = [], []
    for key, value in values.items():
        number = as_number(value)
        if number is None:
            skipped.append(str(key))
            continue
        records.append({"k": "m", "key": str(key)[:250], "value": number, "ts": ts, "step": int(step)})
    return records, skipped


def as_number(value: Any) -> float | None:
    if isinstance(value, bool):
        return float(value)
    if isinstance(value, (int, float)):
        return float(value)
    if hasattr(value, "numel") and getattr(value, "numel")() == 1:
        return float(value.item())
    if hasattr(value, "item") and not isinstance(value, (str, bytes)):
        try:
            return float(value.item())
        except (TypeError, ValueError):
            return None
    return None


def flatten(data: Any, prefix: str = "") -> dict[str, str]:
    """Nested dicts as ``a.b.c`` keys with string values (lists as JSON)."""
    out: dict[str, str] = {}
    if isinstance(data, dict):
        for key, value in data.items():
            out.update(flatten(value, f"{prefix}{key}."))
        return out
    key = prefix[:-1]
    if isinstance(data, (list, tuple)):
        try:
            out[key] = json.dumps(data, default=str)
        except (TypeError, ValueError):
            out[key] = str(data)
    else:
        out[key] = str(getattr(data, "value", data))
    return out


def truncate(value: str, limit: int) -> str:
    """Cut a value to ``limit`` characters, saying how much was cut (MLflow rejects long values)."""
    if len(value) <= limit:
        return value
    if limit <= 40:
        return value[:limit]
    kept = limit - 40  # room for the marker, which is never longer than 40 characters
    return value[:kept] + f"...[truncated {len(value) - kept} chars]"


def default_http_settings(timeout_s: int) -> None:
    """Fail fast on an unreachable server (the journal retries); never override the user's own settings."""
    os.environ.setdefault("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "0")
    os.environ.setdefault("MLFLOW_HTTP_REQUEST_TIMEOUT", str(timeout_s))
