"""Hook specifications: the contract between the harness and its plugins.

One optimizer step, in the order the hooks fire (every rank; ``ctx`` is a
:class:`harness.core.context.PluginContext`, everything else plain values)::

    train() ──> configure ─> on_run_start ─> inspect_dataset(train, eval) ─> [on_resume]
    │
    │  for each optimizer step N (1-based, the Trainer's global_step once it ends):
    │    for each micro-batch m of the step (gradient accumulation):
    │      inspect_batch(batch, step=N, micro_step=m)         before forward
    │      forward ─> on_loss(loss, batch, N, m)                before backward (device tensor)
    │      backward                                             (DeepSpeed steps inside the last one)
    │    clip ─> grad_norm
    │    ┌ step guard ───────────────────────────────────────────────────────────────────┐
    │    │ read   every tensor queued with ctx.defer(...), in ONE device-to-host copy   │
    │    │ on_before_optimizer_step(step, model, optimizer, grad_norm, loss,             │
    │    │                          micro_losses)                       host floats      │
    │    │ agree  ONE all-gather: strongest action, findings queued, plugin switch-offs,│
    │    │        payloads of ctx.share(...)  ─> ctx.shared(...) on every rank          │
    │    │ on_step_agreed(step, action, model, optimizer)   every rank, same shared view │
    │    │ step or skip   (skip_step / save_and_stop / stop / rollback, every rank alike)│
    │    └───────────────────────────────────────────────────────────────────────────────┘
    │    lr_scheduler.step ─> on_step_end(step=N, metrics)      metrics are host values
    │    [on_log(logs)]  [on_evaluate(metrics)]  [checkpoint_state ─> on_checkpoint_save]
    │
    └─> on_run_end(status, error)  (always, also after a crash) ─> report_sections ─> on_report

Hooks are called with keyword arguments; a plugin implements any subset,
taking only the arguments it needs (pluggy passes them by name). Built-in
plugins derive from :class:`harness.core.plugin.Plugin`, which implements
the declarations (``add_config``, ``declare_codes``, ``configure``) from
class attributes; plain ``@hookimpl`` classes work alike.

Hooks fire on **every rank** unless a hook says otherwise; ``ctx.rank`` and
``ctx.is_main`` tell a plugin where it runs. An exception raised inside an
observer hook never reaches training: it becomes an ``INTERNAL_PLUGIN_ERROR``
finding (traceback in its evidence) and the run goes on. Only
:class:`harness.core.actions.HarnessStop` propagates.

Tensors passed to per-micro-batch hooks live on the training device; reading
them (``.item()``, ``.tolist()``, ``bool()``) stalls the device queue. Queue
them with ``ctx.defer(key, tensor)`` instead: the guard reads every plugin's
queue in one transfer and ``ctx.deferred(key)`` returns the host values from
``on_before_optimizer_step`` on. Cross-rank data goes the same way: reserve
a slot in ``on_run_start`` (``ctx.reserve``), ``ctx.share`` before the guard,
read ``ctx.shared`` after it; no plugin issues its own collective on an
ordinary step.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Any

import pluggy

if TYPE_CHECKING:
    from pathlib import Path

    import torch
    from pydantic import BaseModel

    from harness.core.actions import Action
    from harness.core.protocols import PluginContext
    from harness.core.findings import Finding, FindingCode

# The report's types live above the core (harness.report); hooks name them in words only.
ReportFiles = ReportSection = RunRecord = Any

PROJECT = "harness"
hookspec = pluggy.HookspecMarker(PROJECT)
hookimpl = pluggy.HookimplMarker(PROJECT)


# --- declaration: called once per process, before any run ---------------------------------


@hookspec
def add_config() -> "type[BaseModel] | None":
    """Return the pydantic model of this plugin's options, or None if it has none.

    Fires: once when the plugin manager is built, on every rank, before the
    config file is validated. The model's fields become the options under the
    plugin's name in the harness YAML; give every field a ``description`` (it
    is printed by ``harness plugins --config-reference``) and set
    ``extra="forbid"`` so that typos are errors.
    """


@hookspec
def declare_codes() -> "list[FindingCode]":
    """Return every finding code this plugin may emit, with default severity and playbook.

    Fires: once when the plugin manager is built. A plugin may only report
    codes it declared; config can override their severities by code.
    """


# --- run lifecycle ----------------------------------------------------------------------------


@hookspec
def configure(ctx: "PluginContext", options: "BaseModel | None") -> None:
    """Receive the validated options of this plugin for this run.

    Fires: once per run at ``attach()``, on every rank, before ``on_run_start``.
    ``options`` is an instance of the model returned by ``add_config`` (None if
    the plugin has none). Store what you need on ``self``.
    """


@hookspec
def on_run_start(ctx: "PluginContext", trainer: Any) -> None:
    """Training is about to start: the optimizer, scheduler and data loader exist.

    Fires: once per ``trainer.train()`` call, on every rank, from the Trainer's
    ``on_train_begin`` event. ``trainer`` is the ``transformers.Trainer`` (or
    TRL subclass); do not call ``train()`` on it.
    """


@hookspec
def inspect_dataset(ctx: "PluginContext", dataset: Any, split: str) -> None:
    """Look at a dataset once, before training consumes it.

    Fires: once per run for ``split="train"`` (and ``"eval"`` when the Trainer
    has an eval dataset), on every rank, right after ``on_run_start``.
    ``dataset`` is whatever the Trainer holds (a ``datasets.Dataset``, a torch
    dataset or an iterable); do not iterate an iterable dataset to the end.
    """


@hookspec
def on_resume(ctx: "PluginContext", checkpoint_dir: "Path", state: "dict[str, Any] | None") -> None:
    """Training resumes from ``checkpoint_dir``; ``state`` is what this plugin stored there.

    Fires: once per run when ``train(resume_from_checkpoint=...)`` resumes,
    on every rank, after ``on_run_start``. ``state`` is the dict this plugin
    returned from ``checkpoint_state`` at save time on the same rank (None if
    the checkpoint has none, e.g. it was written without the harness).
    """


@hookspec
def on_run_end(ctx: "PluginContext", status: str, error: "BaseException | None") -> None:
    """The run is over: ``status`` is ``"completed"``, ``"stopped"`` or ``"crashed"``.

    Fires: exactly once per ``train()`` call, on every rank, also after an
    exception in training (then ``error`` is the exception, which is re-raised
    after this hook). Flush and close files here. No collectives: other ranks
    may be gone.
    """


@hookspec
def report_sections(run: "RunRecord", options: "BaseModel | None") -> "ReportSection | list[ReportSection] | None":
    """Return this plugin's sections of the run report (:class:`harness.report.ReportSection`), or None.

    Fires: on rank 0 whenever a report is built: at the end of every
    ``train()`` call (after every ``on_run_end``), and again whenever
    ``harness report <output_dir>`` rebuilds it, possibly on another machine
    long after the run (then the plugin instance is fresh and was never
    configured). So build the section from the run directory alone:
    ``run`` is a :class:`harness.report.RunRecord` (``run.run_dir``, its
    findings, step records, logged metrics, config), ``options`` this
    plugin's options from the run's config.yaml. Relative links in the
    markdown are relative to the run directory. An exception costs only this
    section (the report notes it).
    """


@hookspec
def on_report(ctx: "PluginContext", report: "ReportFiles | None") -> None:
    """The run's report was written (``report.markdown``, ``report.html``, ``report.report.verdict``).

    Fires: on rank 0 only, once per ``train()`` call, after every
    ``on_run_end`` and the report; ``report`` is None when the report is
    switched off (``report: false``) or could not be built. Trackers upload
    it and close here: nothing is written to the run directory after this.
    """


# --- every micro-batch --------------------------------------------------------------------------


@hookspec
def inspect_batch(ctx: "PluginContext", batch: "dict[str, Any]", step: int, micro_step: int) -> None:
    """A micro-batch is about to go through forward and backward.

    Fires: for every micro-batch on every rank, before the forward pass.
    ``step`` is the 1-based number of the optimizer step this micro-batch
    contributes to (the ``global_step`` the Trainer will have once the step
    ends, the same number ``on_step_end`` gets); ``micro_step`` counts
    micro-batches within that step from 0. ``batch`` is the collated dict the
    Trainer feeds the model; do not modify it.
    """


@hookspec
def on_loss(
    ctx: "PluginContext", loss: "torch.Tensor", batch: "dict[str, Any]", step: int, micro_step: int
) -> None:
    """The loss of one micro-batch, before backward.

    Fires: for every micro-batch on every rank, as soon as ``compute_loss``
    returned and before backward (under DeepSpeed the optimizer steps inside
    backward, so a finding made here can still skip that step). ``loss`` is
    the detached scalar tensor, on the training device, as ``compute_loss``
    returned it: when the Trainer normalises by the token count of the whole
    optimizer step (``num_items_in_batch``, the default for causal LMs with
    gradient accumulation), the micro-batch losses of a step sum to the step
    loss. Reading its value syncs the device; prefer device-side flags.
    """


# --- every optimizer step --------------------------------------------------------------------------


@hookspec
def on_before_optimizer_step(
    ctx: "PluginContext",
    step: int,
    model: Any,
    optimizer: Any,
    grad_norm: "float | None",
    loss: "float | None",
    micro_losses: "list[float]",
) -> None:
    """Gradients are reduced (and clipped) and the optimizer is about to update.

    Fires: once per optimizer step on every rank, inside the step guard, just
    before the harness agrees with the other ranks whether the step happens.
    A finding reported here can still skip this very step. ``grad_norm`` is
    the Trainer's pre-clip norm when known, as a host float (None under
    DeepSpeed, which computes it inside its own step). Under DeepSpeed ZeRO-1/2 gradients live
    in the engine's partitions, not in ``param.grad``. ``loss`` is this rank's
    loss of the step as a host float: its micro-batch losses combined the way
    the Trainer combines them for logging (both read in the guard's one
    transfer, with every tensor plugins queued with ``ctx.defer``, whose
    values ``ctx.deferred`` returns from here on). ``micro_losses`` are the
    losses ``on_loss`` saw this step, one host float per micro-batch in
    order, read in the same transfer (NaN and Inf kept as they are), so
    that no plugin needs to queue a copy of its own. The parameters are still those that
    produced it, so a forward pass here reproduces the step's losses.
    """


@hookspec
def on_step_agreed(ctx: "PluginContext", step: int, action: "Action", model: Any, optimizer: Any) -> None:
    """Every rank agreed on this step's ``action``; the update is not applied or skipped yet.

    Fires: once per optimizer step on every rank, inside the step guard,
    right after the agreement (``ctx.agree()``) and before the optimizer
    updates (or the step is skipped). ``action`` is the agreed
    :class:`harness.core.actions.Action`, the same on every rank (before a
    rollback without a handler becomes ``save_and_stop``). ``ctx.shared(...)``
    holds this step's exchange, identical on every rank, so a plugin may run
    a collective here only when those shared values say that every rank
    runs the same one (e.g. a recomputation on a flagged step); on an
    ordinary step it must not. The parameters and the optimizer state are
    still those of the step: a recomputation here sees what the step saw.
    """


@hookspec
def on_step_end(ctx: "PluginContext", step: int, metrics: "dict[str, Any]") -> None:
    """An optimizer step finished (or was skipped: ``metrics["skipped"]``).

    Fires: once per optimizer step on every rank, after the update and the LR
    scheduler. ``step`` is the step that just ended (1-based, the Trainer's
    new ``global_step``). ``metrics`` holds ``loss`` (host float: the step
    loss as the Trainer accumulates it for logging), ``grad_norm`` (float/None), ``lr``
    (float), ``skipped`` (bool: the harness held the update back),
    ``optimizer_skipped`` (bool: the harness let the update through but the
    optimizer skipped it on its own, as DeepSpeed and fp16 loss scaling do on
    an overflow), ``action`` (the agreed action name), ``micro_batches`` (int), ``tokens`` (token positions of this rank's
    micro-batches, padding included, counted from tensor shapes: no device sync)
    and three host-clock durations in seconds: ``step_time`` (since the
    previous step ended; the first step of a ``train()`` call counts from the
    run start, including the plugins' run-start work), ``data_time`` (waiting
    for this step's batches from the data loader) and ``model_time``
    (forward, backward and the step guard). Collectives inside the model make
    fast ranks wait for slow ones there, so ``data_time`` is usually the part
    that is each rank's own (not with accelerate's ``dispatch_batches``,
    where rank 0 loads for everyone, nor at an epoch's first batch).
    With several ranks averaging tokens, ``loss`` is this rank's own mean
    (the Trainer's cross-rank scaling taken out), and the first step of a
    ``train()`` call whose first micro-batch the bridge recomputed also holds
    ``world_scaling`` (a ``harness.lib.world_scaling.WorldScaling``: that
    micro-batch's loss beside its own mean, and whether the loss ignored
    ``num_items_in_batch``).
    The dict is new every step and shared by every plugin: read it, do not
    change it (``metrics_log`` keeps it by reference until its next write).
    """


@hookspec
def on_log(ctx: "PluginContext", step: int, logs: "dict[str, float]") -> None:
    """The Trainer logged metrics (already host floats: reading them is free).

    Fires: whenever the Trainer logs (every ``logging_steps``, at evaluation
    and at the end), on every rank; only rank 0's ``logs`` are complete.
    """


@hookspec
def on_metrics(ctx: "PluginContext", step: int, metrics: "dict[str, Any]") -> None:
    """A plugin emitted metrics with ``ctx.log_metrics`` (trackers record them).

    Fires: on the rank that called ``ctx.log_metrics``, synchronously, on the
    training thread. Values may be numbers, tensors or anything else; a
    tracker must skip what is not a number rather than fail.
    """


@hookspec
def on_evaluate(ctx: "PluginContext", step: int, metrics: "dict[str, float]") -> None:
    """An evaluation finished with ``metrics``.

    Fires: after each evaluation, on every rank.
    """


# --- checkpoints ---------------------------------------------------------------------------------


@hookspec
def checkpoint_state(ctx: "PluginContext", step: int) -> "dict[str, Any] | None":
    """Return this plugin's state to store beside the checkpoint (JSON-serialisable), or None.

    Fires: at every checkpoint save, on every rank, before ``on_checkpoint_save``.
    The harness writes it to ``<checkpoint>/harness_state/rank-<r>.json``
    keyed by plugin name and hands it back through ``on_resume``.
    """


@hookspec
def on_checkpoint_save(ctx: "PluginContext", step: int, checkpoint_dir: "Path") -> None:
    """A checkpoint was written to ``checkpoint_dir``.

    Fires: after the Trainer saved a checkpoint, on every rank.
    """


# --- findings and actions ---------------------------------------------------------------------


@hookspec
def on_finding(ctx: "PluginContext", finding: "Finding") -> None:
    """A finding was made (after its severity override and decided action were applied).

    Fires: on the rank that made the finding, and again on rank 0 when a
    finding made on another rank arrives there (``finding.rank`` tells which).
    Must not report findings itself.
    """


@hookspec(firstresult=True)
def decide_action(ctx: "PluginContext", finding: "Finding") -> "Action | str | None":
    """Decide what training should do about ``finding``; the first non-None answer wins.

    Fires: on the rank that made the finding, right after it is made, unless
    the config's ``policy`` names its code (the user's word wins). Return None
    to leave the decision to others; with no answer the action is
    ``continue``. Actions that change training are agreed across ranks at the
    next optimizer-step guard (the strongest wins).
    """
