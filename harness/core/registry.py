"""Where plugins come from: the built-in list, entry points, ``module:Class`` paths.

The built-in plugins are named here as plain ``"module:Class"`` strings, so
the core reaches a built-in plugin only through this list and never imports
the ``harness.plugins`` package (a layer above it). Plugins come from three
places: this list, the ``harness`` entry-point group (skipped when
``HARNESS_DISABLE_PLUGIN_AUTOLOAD=1``) and objects or ``"module:Class"`` paths
handed to ``attach()``/the config. A plugin is any object whose methods are
marked with ``harness.core.hookspecs.hookimpl`` (usually a ``Plugin`` subclass).
"""
from __future__ import annotations

import importlib
import inspect
import os
from dataclasses import dataclass, field
from importlib.metadata import entry_points
from typing import Any, Callable, NamedTuple

from harness.core.errors import PluginError, did_you_mean

AUTOLOAD_ENV = "HARNESS_DISABLE_PLUGIN_AUTOLOAD"
ENTRY_POINT_GROUP = "harness"


class BuiltinPlugin(NamedTuple):
    """A built-in plugin: where its class is and whether it is on when the config lists no ``plugins``."""

    target: str
    default_enabled: bool


BUILTIN_PLUGINS: dict[str, BuiltinPlugin] = {
    "metrics_log": BuiltinPlugin("harness.plugins.metrics_log:MetricsLog", True),
    "nan_guard": BuiltinPlugin("harness.plugins.nan_guard:NanGuard", True),
    "loss_baseline": BuiltinPlugin("harness.plugins.loss_baseline:LossBaseline", True),
    "spike_capture": BuiltinPlugin("harness.plugins.spike_capture:SpikeCapture", True),
    "rerun": BuiltinPlugin("harness.plugins.rerun:Rerun", True),
    "data_hash": BuiltinPlugin("harness.plugins.data_hash:DataHash", True),
    "resume_check": BuiltinPlugin("harness.plugins.resume_check:ResumeCheck", True),
    "grad_sync": BuiltinPlugin("harness.plugins.grad_sync:GradSync", True),
    "packing_check": BuiltinPlugin("harness.plugins.packing_check:PackingCheck", True),
    "contamination": BuiltinPlugin("harness.plugins.contamination:Contamination", True),
    "lr_schedule": BuiltinPlugin("harness.plugins.lr_schedule:LrSchedule", True),
    "throughput": BuiltinPlugin("harness.plugins.throughput:Throughput", True),
    "run_card": BuiltinPlugin("harness.plugins.run_card:RunCard", True),
    "dpo_health": BuiltinPlugin("harness.plugins.dpo_health:DpoHealth", True),
    "grpo_health": BuiltinPlugin("harness.plugins.grpo_health:GrpoHealth", True),
    "oom": BuiltinPlugin("harness.plugins.oom:OomForensics", True),
    "watchdog": BuiltinPlugin("harness.plugins.watchdog:Watchdog", True),
    "rank_rng": BuiltinPlugin("harness.plugins.rank_rng:RankRng", True),
    "checkpoint_proof": BuiltinPlugin("harness.plugins.checkpoint_proof:CheckpointProof", True),
    "preemption": BuiltinPlugin("harness.plugins.preemption:Preemption", True),
    "layer_stats": BuiltinPlugin("harness.plugins.layer_stats:LayerStats", False),
    "mlflow": BuiltinPlugin("harness.plugins.mlflow.tracker:MlflowTracker", False),
}


@dataclass
class PluginEntry:
    """One available plugin: where it comes from and how to make it (made once, on first use)."""

    name: str
    source: str  # "builtin", "entry point <dist>", "config", "object"
    factory: Callable[[], Any]
    default_enabled: bool = False
    _instance: Any = field(default=None, repr=False)

    def instance(self) -> Any:
        if self._instance is None:
            self._instance = self.factory()
        return self._instance

    @property
    def description(self) -> str:
        doc = inspect.getdoc(self.instance()) or ""
        return doc.strip().splitlines()[0] if doc.strip() else "(no description)"


def import_target(target: str) -> Any:
    """Import ``"pkg.module:Attr"`` (or a bare module path) and return the object."""
    module_name, _, attr = target.partition(":")
    try:
        obj = importlib.import_module(module_name)
    except ImportError as exc:
        raise PluginError(
            f"cannot import plugin module '{module_name}' (from '{target}'): {exc}. "
            "Fix: install the package that provides it, or correct the 'module:Class' path."
        ) from exc
    for part in filter(None, attr.split(".")):
        try:
            obj = getattr(obj, part)
        except AttributeError as exc:
            raise PluginError(
                f"plugin module '{module_name}' has no attribute '{part}' (from '{target}')."
                f"{did_you_mean(part, dir(obj))} Fix: correct the 'module:Class' path."
            ) from exc
    return obj


def _instantiate(obj: Any) -> Any:
    return obj() if inspect.isclass(obj) else obj


def autoload_enabled() -> bool:
    """Entry-point plugins load unless ``HARNESS_DISABLE_PLUGIN_AUTOLOAD`` says no."""
    return os.environ.get(AUTOLOAD_ENV, "") not in ("1", "true", "yes")


def discover(autoload: bool | None = None) -> dict[str, PluginEntry]:
    """Built-in plugins plus, unless disabled by environment, entry-point plugins (nothing is imported yet)."""
    catalog: dict[str, PluginEntry] = {}
    for name, spec in BUILTIN_PLUGINS.items():
        catalog[name] = PluginEntry(
            name, "builtin", lambda t=spec.target: _instantiate(import_target(t)), spec.default_enabled
        )
    if autoload is None:
        autoload = autoload_enabled()
    if autoload:
        for ep in entry_points(group=ENTRY_POINT_GROUP):
            if ep.name in catalog:
                continue
            dist = getattr(ep.dist, "name", "?")
            catalog[ep.name] = PluginEntry(
                ep.name, f"entry point of '{dist}'", lambda e=ep: _instantiate(e.load()), False
            )
    return catalog


def entry_for(spec: str | object, catalog: dict[str, PluginEntry]) -> PluginEntry:
    """The catalog entry for a plugin name, a ``module:Class`` path or a plugin object."""
    if not isinstance(spec, str):
        name = getattr(spec, "name", None) or type(spec).__name__
        return PluginEntry(str(name), "object", lambda s=spec: _instantiate(s))
    if spec in catalog:
        return catalog[spec]
    if ":" in spec:
        obj = _instantiate(import_target(spec))
        name = getattr(obj, "name", None) or spec
        return PluginEntry(str(name), "config", lambda o=obj: o)
    raise KeyError(spec)
