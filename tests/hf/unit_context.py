"""A real run context (real catalog, config, plugin manager) for the bridge's unit tests: no Trainer.

Not a conftest.py: the test modules here import ``conftest`` (the suite's) by name.
"""
from __future__ import annotations

from pathlib import Path
from typing import Any

from harness import FindingCode, Severity, hookimpl
from harness.core.config import Catalog, load_config
from harness.core.context import RunContext
from harness.core.distributed import DistInfo
from harness.core.manager import HarnessPluginManager

PROBE_FAULT = FindingCode("PROBE_FAULT", Severity.ERROR, "the probe was told to report", "harness-core#test_fault")


class Probe:
    """Reports PROBE_FAULT when asked, defers a tensor, and records what the step guard hands it."""

    name = "probe"

    def __init__(self) -> None:
        self.before_step: list[tuple[int, Any, Any, Any]] = []
        self.deferred_seen: list[list[Any]] = []
        self.defer_next: Any = None

    @hookimpl
    def declare_codes(self) -> list[FindingCode]:
        return [PROBE_FAULT]

    @hookimpl
    def on_before_optimizer_step(self, ctx: Any, step: int, grad_norm: Any, loss: Any) -> None:
        self.before_step.append((step, grad_norm, loss, ctx.reads.reads))
        self.deferred_seen.append(ctx.deferred("probe_value"))

    def queue(self, ctx: RunContext, tensor: Any) -> None:
        ctx.defer("probe_value", tensor, owner=self.name)


def run_context(run_dir: Path, policy: dict[str, str] | None = None, world_size: int = 1) -> tuple[RunContext, Probe]:
    """A RunContext in ``run_dir`` with the probe plugin registered and configured (one process unless told)."""
    probe = Probe()
    catalog = Catalog.build(extra=[probe], autoload=False)
    config: dict[str, Any] = {"plugins": [], "policy": dict(policy or {})}
    resolved = load_config(config, catalog, extra_plugins=[catalog.add(probe)])
    manager = HarnessPluginManager(resolved.model.max_plugin_errors)
    for name in resolved.enabled:
        manager.register(catalog.entries[name])
    ctx = RunContext(resolved, catalog.codes, manager, run_dir, DistInfo(rank=0, world_size=world_size, local_rank=0))
    for name in manager.names:
        manager.hooks.configure(name, ctx, resolved.options_for(name))
    return ctx, probe
