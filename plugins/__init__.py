"""Built-in plugins, as an explicit list: the harness core imports them only through this registry.

Each entry maps the plugin's public name to ``"module:Class"`` and says whether
the plugin is on when the config does not list ``plugins``.
"""
from __future__ import annotations

from typing import NamedTuple


class BuiltinPlugin(NamedTuple):
    target: str
    default_enabled: bool


BUILTIN_PLUGINS: dict[str, BuiltinPlugin] = {
    "metrics_log": BuiltinPlugin("harness.plugins.metrics_log:MetricsLog", True),
    "nan_guard": BuiltinPlugin("harness.plugins.nan_guard:NanGuard", True),
    "loss_baseline": BuiltinPlugin("harness.plugins.loss_baseline:LossBaseline", True),
    "spike_capture": BuiltinPlugin("harness.plugins.spike_capture:SpikeCapture", True),
    "data_hash": BuiltinPlugin("harness.plugins.data_hash:DataHash", True),
    "resume_check": BuiltinPlugin("harness.plugins.resume_check:ResumeCheck", True),
    "grad_sync": BuiltinPlugin("harness.plugins.grad_sync:GradSync", True),
    "packing_check": BuiltinPlugin("harness.plugins.packing_check:PackingCheck", True),
    "contamination": BuiltinPlugin("harness.plugins.contamination:Contamination", True),
    "lr_schedule": BuiltinPlugin("harness.plugins.lr_schedule:LrSchedule", True),
    "throughput": BuiltinPlugin("harness.plugins.throughput:Throughput", True),
    "run_card": BuiltinPlugin("harness.plugins.run_card:RunCard", True),
    "dpo_health": BuiltinPlugin("harness.plugins.dpo_health:DpoHealth", True),
    "mlflow": BuiltinPlugin("harness.plugins.mlflow_tracker:MlflowTracker", False),
}
