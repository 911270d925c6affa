"""Findings and harness metrics in the user's own trackers (whatever ``report_to`` names).

A user of the Trainer already watches TensorBoard, W&B or MLflow; a finding
that only reaches ``report.html`` is seen days late. So the harness joins the
Trainer's own log stream instead of opening one of its own:

- :class:`TrackerFeed`, a ``TrainerCallback`` placed just before the reporting
  integrations, adds ``harness/...`` scalars to every log the Trainer makes
  (the latest value of each harness metric, ``harness/skipped_steps`` and
  ``harness/findings/<CODE>``, a count per code), so that every integration
  records them with the Trainer's own step axis, and writes the findings made
  since the last log where a tracker can hold text: a TensorBoard text summary,
  a W&B table (and an alert for errors), tags on the active MLflow run;
- :class:`TrackerFeedEnd`, placed after the integrations, takes the added
  keys out again, so the console's log line and the harness's own
  ``on_log`` plugins see the Trainer's logs unchanged.

The integrations are reached through the callbacks the Trainer already made
(their writer, run or module): nothing is imported here, and a tracker that is
not in ``report_to`` costs nothing. Everything runs on rank 0, on the
training thread (findings made on other threads are queued), and never
raises: a tracker's failure is logged once and the feed goes on.
"""
from __future__ import annotations

import logging
import threading
from collections import Counter
from typing import Any

from transformers import TrainerCallback

from harness.core.console import finding_line, playbook_pointer
from harness.core.findings import Finding, Severity
from harness.core.options import TrackerOptions

log = logging.getLogger(__name__)

PREFIX = "harness/"
TABLE_COLUMNS = ["step", "code", "severity", "rank", "plugin", "message", "playbook"]
TABLE_ROWS = 500  # the W&B table keeps the first findings this many; every finding is in findings.jsonl


class TrackerFeed(TrainerCallback):
    """Adds the harness's scalars to each Trainer log and hands the new findings to the trackers that hold text."""

    def __init__(self, options: TrackerOptions, is_main: bool, mlflow_plugin: bool = False) -> None:
        self.options = options
        self.enabled = is_main and (options.metrics or options.findings)
        # the harness's own mlflow plugin already writes into HF's MLflow run (curves, tags, report): leave that one to it
        self.mlflow_plugin = mlflow_plugin
        self.covered: list[Any] = []  # the integrations between the feed and its end
        self.threshold = Severity(options.level).rank
        self.values: dict[str, float] = {}  # latest harness metric values, keys with the prefix
        self.skipped_steps = 0
        self.counts: Counter[str] = Counter()
        self.latest: dict[str, tuple[str, int | None]] = {}  # code -> (worst severity, last step): the MLflow tag's text
        self.rows: list[list[Any]] = []
        self._pending: list[Finding] = []  # findings not yet handed to the text trackers
        self._lock = threading.Lock()  # findings arrive from the watchdog's and the checkers' threads too
        self._added: list[str] = []
        self._trainer: Any = None
        self._failed: set[str] = set()
        self._mlflow_run: tuple[Any, str] | None = None  # (mlflow module, run id) seen while the run was active

    # -- fed by the bridge and the run context ------------------------------------------------------------

    def install(self, trainer: Any) -> None:
        """Gather the reporting integrations where the first one is, between the feed and its end (none: no feed)."""
        self._trainer = trainer
        handler = getattr(trainer, "callback_handler", None)  # a Trainer-like loop of the user's own may have none
        callbacks = getattr(handler, "callbacks", None)
        if not isinstance(callbacks, list):
            self.enabled = False
            return
        self.covered = [cb for cb in callbacks if _is_integration(cb)
                        and not (self.mlflow_plugin and type(cb).__name__ == "MLflowCallback")]
        if not self.enabled or not self.covered:
            self.enabled = False
            return
        first = callbacks.index(self.covered[0])
        for callback in self.covered:
            callbacks.remove(callback)  # every one sits at or after ``first``: the place stays the same
        callbacks[first:first] = [self, *self.covered, TrackerFeedEnd(self)]

    def note_metrics(self, metrics: dict[str, Any]) -> None:
        """A plugin's metrics (``ctx.log_metrics``): the latest value of each joins the next Trainer log."""
        if not (self.enabled and self.options.metrics):
            return
        for key, value in metrics.items():
            if isinstance(value, (int, float)) and not isinstance(value, bool):
                self.values[PREFIX + key] = float(value)

    def note_step(self, skipped: bool) -> None:
        if skipped:
            self.skipped_steps += 1

    def note_finding(self, finding: Finding) -> None:
        """A finding (rank 0 sees every rank's): counted, and queued for the text trackers (any thread)."""
        if not (self.enabled and self.options.findings) or finding.severity.rank < self.threshold:
            return
        with self._lock:
            self.counts[finding.code] += 1
            worst = self.latest.get(finding.code, (finding.severity.value, None))[0]
            if Severity(worst).rank < finding.severity.rank:
                worst = finding.severity.value
            self.latest[finding.code] = (worst, finding.step)
            self._pending.append(finding)
            if len(self.rows) < TABLE_ROWS:
                self.rows.append([finding.step, finding.code, finding.severity.value, finding.rank, finding.plugin,
                                  finding.message, playbook_pointer(finding)])

    # -- the Trainer's log ---------------------------------------------------------------------------------

    def scalars(self) -> dict[str, float]:
        """What joins a Trainer log: the harness metrics, the skipped steps and a count per finding code."""
        added: dict[str, float] = dict(self.values) if self.options.metrics else {}
        if self.options.metrics:
            added[PREFIX + "skipped_steps"] = float(self.skipped_steps)
        if self.options.findings:
            with self._lock:
                counts = dict(self.counts)
            added[PREFIX + "findings/total"] = float(sum(counts.values()))
            added.update({f"{PREFIX}findings/{code}": float(n) for code, n in counts.items()})
        return added

    def on_log(self, args: Any, state: Any, control: Any, logs: dict[str, Any] | None = None, **kwargs: Any) -> Any:
        if not self.enabled or logs is None:
            return control
        try:
            # an evaluation's log (eval_loss ...) at a step whose training log already carried them: the integrations
            # would record every harness series twice at that step (as train/harness/... both times)
            evaluation = any(isinstance(k, str) and k.startswith(("eval_", "test_")) for k in logs)
            added = {} if evaluation else {k: v for k, v in self.scalars().items() if k not in logs}
            logs.update(added)
            self._added = list(added)
            self.flush_findings(state.global_step)
        except Exception as exc:  # noqa: BLE001 - a tracker is never worth a training step
            self._warn_once("log", exc)
        return control

    def take_back(self, logs: dict[str, Any] | None) -> None:
        """Remove the keys the feed added (the integrations have recorded them)."""
        for key in self._added:
            if logs is not None:
                logs.pop(key, None)
        self._added = []

    # -- findings as text ------------------------------------------------------------------------------------

    def flush_findings(self, step: int, final: bool = False) -> None:
        """Hand the findings made since the last call to TensorBoard, W&B and MLflow (each where it is in use)."""
        with self._lock:
            new, self._pending = self._pending, []
            counts = dict(self.counts)
        if not self.enabled or self._trainer is None:
            return
        for callback in self.covered:
            kind = type(callback).__name__
            try:
                if kind == "TensorBoardCallback":
                    self._tensorboard(callback, new, final)
                elif kind == "WandbCallback":
                    self._wandb(callback, new, step, final)
                elif kind == "MLflowCallback":
                    self._mlflow(callback, counts, bool(new) or final)
            except Exception as exc:  # noqa: BLE001
                self._warn_once(kind, exc)

    def _tensorboard(self, callback: Any, new: list[Finding], final: bool) -> None:
        if not new:
            return
        writer = getattr(callback, "tb_writer", None)
        reopened = False
        if writer is None and final and self._trainer is not None:  # run-end findings: the callback closed its writer
            callback._init_summary_writer(self._trainer.args)
            writer, reopened = getattr(callback, "tb_writer", None), True
        if writer is None:
            return
        by_step: dict[int, list[str]] = {}
        for finding in new:
            by_step.setdefault(finding.step or 0, []).append("    " + finding_line(finding))  # markdown code block lines
        for at, lines in sorted(by_step.items()):
            writer.add_text(PREFIX + "findings", "\n".join(lines), global_step=at)
        if final:
            scalars = self.scalars()
            for key, value in scalars.items():
                if key.startswith(PREFIX + "findings/"):
                    writer.add_scalar("train/" + key, value, global_step=max(by_step))  # the tag the log stream uses
        writer.flush()
        if reopened:
            writer.close()
            callback.tb_writer = None

    def _wandb(self, callback: Any, new: list[Finding], step: int, final: bool) -> None:
        module = getattr(callback, "_wandb", None)
        run = getattr(module, "run", None) if module is not None else None
        if not new or run is None:
            return
        with self._lock:
            rows = [list(r) for r in self.rows]
        table = module.Table(columns=TABLE_COLUMNS, data=rows)
        # during training the table rides the row the Trainer's own log commits next; at the end no log follows
        run.log({PREFIX + "findings": table, "train/global_step": step}, commit=final)
        alerts = [f for f in new if f.severity.rank >= Severity.ERROR.rank]
        for finding in alerts[:3]:
            run.alert(title=f"harness: {finding.code} at step {finding.step}", text=finding_line(finding),
                      level=getattr(getattr(module, "AlertLevel", None), "ERROR", "ERROR"), wait_duration=0)

    def _mlflow(self, callback: Any, counts: dict[str, int], changed: bool) -> None:
        module = getattr(callback, "_ml_flow", None)
        active = module.active_run() if module is not None and getattr(callback, "_initialized", False) else None
        if active is not None:
            self._mlflow_run = (module, active.info.run_id)
        if not changed or self._mlflow_run is None:
            return
        module, run_id = self._mlflow_run
        client = module.MlflowClient()
        with self._lock:
            latest = dict(self.latest)
        for code, n in counts.items():  # the tag the mlflow plugin writes: one name whichever of the two logs the run
            severity, step = latest.get(code, ("?", None))
            client.set_tag(run_id, f"harness.finding.{code}", f"{n} ({severity}), last at step {step if step is not None else '?'}")
        client.set_tag(run_id, "harness.findings", str(sum(counts.values())))

    def _warn_once(self, where: str, exc: BaseException) -> None:
        if where not in self._failed:
            self._failed.add(where)
            log.warning("harness: could not write to the %s tracker (%s: %s); training goes on, findings stay in "
                        "findings.jsonl", where, type(exc).__name__, exc)


class TrackerFeedEnd(TrainerCallback):
    """After the reporting integrations: the keys the feed added leave the log again."""

    def __init__(self, feed: TrackerFeed) -> None:
        self.feed = feed

    def on_log(self, args: Any, state: Any, control: Any, logs: dict[str, Any] | None = None, **kwargs: Any) -> Any:
        self.feed.take_back(logs)
        return control


def _is_integration(callback: Any) -> bool:
    """Whether a callback is one of transformers' reporting integrations (``report_to``)."""
    try:
        from transformers.integrations import INTEGRATION_TO_CALLBACK
    except ImportError:  # pragma: no cover - every supported transformers has it
        return False
    classes = tuple(c for c in INTEGRATION_TO_CALLBACK.values() if isinstance(c, type))
    return isinstance(callback, classes)
