"""The core's own options (the top level of the harness YAML file) and a validated config.

The bottom of the config layer: the catalog (:mod:`harness.core.catalog`)
builds the full model on :class:`CoreOptions`, and the run context only needs
:class:`ResolvedConfig`; neither needs the loading and validation in
:mod:`harness.core.config`.
"""
from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field

from harness.core.actions import Action
from harness.core.console import ConsoleOptions
from harness.core.findings import Severity

CONFIG_ENV = "HARNESS_CONFIG"
PLUGINS_ENV = "HARNESS_PLUGINS"
ONLY_ENV = "HARNESS_ONLY"  # what `harness wrap --only a,b` sets: exactly these plugins, none of the defaults
REPORT_PLOTS_ENV = "HARNESS_REPORT_PLOTS"
REFERENCE_HINT = "see `harness plugins --config-reference`"
# Mark an option that names finding codes (a list of codes, a mapping keyed by code, or one code) with
# ``Field(..., json_schema_extra=NAMES_CODES)``: resolve_config checks every such value against the codes the
# catalog's plugins declare, for every plugin alike (core options included), with a did-you-mean.
NAMES_CODES: dict[str, Any] = {"names_codes": True}


class TrackerOptions(BaseModel):
    """The ``trackers:`` section: what the harness adds to the Trainer's own ``report_to`` trackers."""

    model_config = ConfigDict(extra="forbid")

    metrics: bool = Field(
        True, description="Add the harness's metrics (`harness/throughput/...`, `harness/skipped_steps`, ...) to every "
        "log the Trainer makes, so that each `report_to` integration records them on its own step axis.",
    )
    findings: bool = Field(
        True, description="Add a count per finding code (`harness/findings/<CODE>`, `harness/findings/total`) to those "
        "logs, and write each finding where a tracker holds text: a TensorBoard text summary (`harness/findings`), a "
        "W&B table (and an alert for errors), tags on the active MLflow run (`harness.finding.<CODE>`).",
    )
    level: Literal["info", "warning", "error", "critical"] = Field(
        "warning", description="Findings at this severity or above reach the trackers (every finding is in findings.jsonl).",
    )


class CoreOptions(BaseModel):
    """Options of the harness itself (top level of the YAML file)."""

    model_config = ConfigDict(extra="forbid")

    plugins: list[str] | None = Field(
        None,
        description="Plugins to enable: built-in names, entry-point names or 'module:Class' paths; the name "
        "'defaults' stands for every plugin that is on by default (`harness plugins` marks them). Default: [defaults].",
    )
    only: list[str] | None = Field(
        None,
        description="Exactly these plugins, none added by default (unlike 'plugins', which 'defaults' usually heads); "
        "the same names as 'plugins', 'defaults' included. Give 'only' or 'plugins', not both. "
        "`harness wrap --only a,b` (HARNESS_ONLY) wins over both.",
    )
    disable: list[str] = Field(default_factory=list, description="Plugins to switch off, even if listed or on by default.")
    severity: dict[str, Severity] = Field(
        default_factory=dict, description="Severity overrides by finding code, e.g. {LOSS_SPIKE: error}.",
        json_schema_extra=NAMES_CODES,
    )
    policy: dict[str, Action] = Field(
        default_factory=dict,
        description="Action by finding code (continue, skip_step, rollback, save_and_stop, stop); "
        "wins over the plugins' own decisions.",
        json_schema_extra=NAMES_CODES,
    )
    output_dir: str | None = Field(
        None, description="Directory that receives harness/ (default: the Trainer's output_dir)."
    )
    max_plugin_errors: int = Field(
        10, ge=1, description="After this many exceptions a plugin is switched off for the rest of the run."
    )
    report: bool = Field(
        True, description="Write report.md and report.html into the run directory at the end of every train() call "
        "(rank 0; also after a crash or a stop). `harness report <output_dir>` rebuilds them at any time.",
    )
    report_plots: bool = Field(
        default_factory=lambda: os.environ.get(REPORT_PLOTS_ENV, "1") != "0",
        description="Draw the report's plots (loss per token, grad norm, LR, throughput; about a second of matplotlib at run end). "
        f"Default true; {REPORT_PLOTS_ENV}=0 in the environment makes the default false (the test suite does, for speed).",
    )
    recent_batches: int = Field(
        4, ge=0, description="Micro-batches kept by reference in the run context's ring buffer (no copies)."
    )
    on_stop: Literal["return", "raise"] = Field(
        "return",
        description="What trainer.train() does after the harness stopped training (stop, save_and_stop, a rollback without a "
        "stage runner): 'return' returns as the Trainer does (the stop banner on stderr and `harness wrap`'s exit status 75 "
        "still say it); 'raise' raises harness.HarnessStopped (code, step, attempt, output_dir) once the Trainer returned "
        "and the report is written, so that the script cannot go on as if training had completed.",
    )
    trackers: TrackerOptions = Field(
        default_factory=TrackerOptions,
        description="Findings and harness metrics in the trackers the Trainer reports to (`report_to`).",
    )
    console: ConsoleOptions = Field(
        default_factory=ConsoleOptions,
        description="Live console lines: rank 0 prints each finding at `level` or above on stderr as it is made, "
        "`per_code` lines per code at most.",
    )


CORE_KEYS = tuple(CoreOptions.model_fields)


@dataclass
class ResolvedConfig:
    """A validated config: the model instance, where it came from and the plugins it enables."""

    model: CoreOptions
    source: str
    enabled: list[str]
    paths: dict[str, str] = field(default_factory=dict)  # plugins enabled by a 'module:Class' path: name -> path
    notes: list[str] = field(default_factory=list)  # what is valid but takes no effect (a disabled plugin's section)

    def options_for(self, plugin: str) -> BaseModel | None:
        return getattr(self.model, plugin, None)

    def to_yaml(self) -> str:
        data = self.model.model_dump(mode="json")
        data["plugins"] = [self.paths.get(name, name) for name in self.enabled]  # loads back: a path plugin by its path
        data.pop("only", None)  # the plugins that ran are the list above, however they were chosen
        return yaml.safe_dump(data, sort_keys=False)
