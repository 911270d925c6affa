"""Which MLflow run the ``mlflow`` plugin logs into: HF's own run when the Trainer reports to MLflow.

Why: with ``report_to mlflow`` HF's ``MLflowCallback`` starts a fluent run in
``on_train_begin``, and ``mlflow.start_run()`` consumes (unsets)
``MLFLOW_RUN_ID``; a tracker that read the environment afterwards made a
second run in a store of its own, with the same curves. So the plugin first
looks for that callback (and sets it up itself when the harness's callback
happens to run first: HF's ``on_train_begin`` then finds it done), then for a
run the script started itself; only without either does it resolve a run of
its own from its options, ``MLFLOW_*`` variables and defaults, as HF does.

HF ends its run in ``on_train_end``, before the harness's report exists, and
a ``trainer.evaluate()`` after ``train()`` then makes MLflow start yet another
run. So the plugin holds HF's run open past ``train()`` (HF's own
``_auto_end_run`` flag) and hands it back once its report is uploaded: HF's
``__del__`` or MLflow's exit handler ends it, as they would have. One job,
one run.
"""
from __future__ import annotations

import json
import logging
import os
import sys
from dataclasses import dataclass
from typing import Any

log = logging.getLogger("harness.mlflow")

HF_CALLBACK_MODULE = "transformers.integrations.integration_utils"


def env_tags() -> dict[str, str]:
    """``MLFLOW_TAGS`` (a JSON object), as HF reads it."""
    raw = os.environ.get("MLFLOW_TAGS")
    if not raw:
        return {}
    try:
        return {str(k): str(v) for k, v in json.loads(raw).items()}
    except (ValueError, AttributeError):
        log.warning("harness mlflow: MLFLOW_TAGS is not a JSON object; ignored")
        return {}


def hf_mlflow_callback(trainer: Any) -> Any | None:
    """The Trainer's ``MLflowCallback`` (or a subclass such as DagsHub's), if it reports to MLflow."""
    cls = getattr(sys.modules.get(HF_CALLBACK_MODULE), "MLflowCallback", None)  # not imported: no such callback exists
    if cls is None:
        return None
    for callback in getattr(getattr(trainer, "callback_handler", None), "callbacks", ()):
        if isinstance(callback, cls):
            return callback
    return None


@dataclass
class JoinedRun:
    """A run someone else started in this process (HF's callback, or the script) that the plugin logs into."""

    run_id: str
    tracking_uri: str
    experiment_name: str
    source: str  # whose run, for the console line: "HF's (report_to mlflow)" or "the script's active"
    callback: Any = None  # HF's MLflowCallback when it owns the run
    held: bool = False

    @property
    def from_hf(self) -> bool:
        return self.callback is not None

    def hold(self) -> None:
        """Keep HF from ending its run in ``on_train_end``; :meth:`release` hands it back.

        Not a nested run (``MLFLOW_NESTED_RUN``): MLflow's exit handler ends
        only the innermost run, so the parent would stay open forever.
        """
        global _last_hold
        callback = self.callback
        if callback is not None and getattr(callback, "_auto_end_run", False) and not getattr(callback, "_nested_run", False):
            callback._auto_end_run = False
            if hasattr(callback, "_harness_async_log"):  # a second train(): HF's own logging mode again
                callback._async_log = callback._harness_async_log
            self.held = True
            _last_hold = self

    def release(self, status: str) -> None:
        """After the report upload: HF (``__del__``) or MLflow's exit handler ends the run; a crashed ``train()`` ends it FAILED now.

        MLflow's exit handler runs after the interpreter stopped accepting
        thread-pool work, so asynchronous logs queued after ``train()`` (a
        later ``evaluate()``) would be lost: HF logs synchronously from here on.
        """
        if not self.held:
            return
        self.held = False
        callback, mlflow = self.callback, self.callback._ml_flow
        callback._auto_end_run = True
        active = mlflow.active_run()
        if active is None or active.info.run_id != self.run_id:
            return
        if status == "crashed":
            mlflow.end_run(status="FAILED")
            return
        callback._harness_async_log = getattr(callback, "_async_log", False)
        callback._async_log = False
        flush = getattr(mlflow, "flush_async_logging", None)
        if callable(flush):
            flush()


_last_hold: JoinedRun | None = None  # the run held for the last trainer: a later trainer must not inherit it


def end_stale_hold(trainer: Any) -> None:
    """A new trainer is attached (a notebook's next run): end the run held for an earlier one, as HF would have at its train end."""
    global _last_hold
    held, _last_hold = _last_hold, None
    if held is None or held.callback is hf_mlflow_callback(trainer):
        _last_hold = held
        return
    mlflow = held.callback._ml_flow
    active = mlflow.active_run()
    if active is not None and active.info.run_id == held.run_id:
        mlflow.end_run()
        log.info("harness mlflow: ended MLflow run %s of the previous trainer, so that this one gets its own", held.run_id)


def join_run(trainer: Any) -> JoinedRun | None:
    """HF's MLflow run (its callback set up now if it has not run yet), else the script's own active run, else None."""
    callback = hf_mlflow_callback(trainer)
    mlflow = sys.modules.get("mlflow")
    if callback is not None:
        mlflow = callback._ml_flow
        if not getattr(callback, "_initialized", False):
            try:
                callback.setup(trainer.args, trainer.state, trainer.model)
            except Exception as exc:  # noqa: BLE001 - HF's own on_train_begin will meet (and raise) the same error
                log.warning("harness mlflow: HF's MLflowCallback could not start its run (%s); the harness logs to its own", exc)
                return None
    if mlflow is None or not callable(getattr(mlflow, "active_run", None)):
        return None
    active = mlflow.active_run()
    if active is None:
        return None
    experiment_id = active.info.experiment_id
    try:
        experiment_name = mlflow.get_experiment(experiment_id).name
    except Exception:  # noqa: BLE001 - only a label for the console and the fallback store
        experiment_name = str(experiment_id)
    return JoinedRun(
        run_id=active.info.run_id,
        tracking_uri=mlflow.get_tracking_uri(),
        experiment_name=experiment_name,
        source="HF's (report_to mlflow)" if callback is not None else "the script's active",
        callback=callback,
    )


def describe_target(target: Any, joined: JoinedRun | None, options: Any, resumed_run: str | None) -> str:
    """The console line that says which run the harness logs to, and why that one."""
    where = f"experiment '{target.experiment_name}', {target.tracking_uri}"
    if joined is not None:
        return f"logging into {joined.source} run {joined.run_id} ({where})"
    if options.run_id:
        why = "the run_id option's run"
    elif os.environ.get("MLFLOW_RUN_ID"):
        why = "the run of MLFLOW_RUN_ID"
    elif resumed_run and target.run_id == resumed_run:
        why = "the resumed run"
    else:
        why = "a new run"
    run = target.run_id or "(id in harness/mlflow/run.json once created)"
    return f"logging into {why} {run} ({where})"
