"""The contracts between the core's pieces, as protocols at the bottom of the core.

Hooks and plugins see a :class:`PluginContext`, never the run context class;
the typed hook facade needs only a :class:`HookCaller`, never the manager
class. Both sit here, below ``context``, ``hookspecs``, ``hooks`` and
``manager``, so those modules import no one above them (no cycle, not even
under ``TYPE_CHECKING``).
"""
from __future__ import annotations

from collections import deque
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Callable, Protocol

from harness.core.findings import Finding, Severity


class PluginContext(Protocol):
    """What a hook may use of the run context: the contract between the core and the plugins.

    Hooks get this, never the implementation class: a plugin depends on these
    names only, so the core can change behind them.
    """

    rank: int
    world_size: int
    is_main: bool
    run_dir: Path
    step: int
    micro_step: int
    trainer: Any
    resumed_from: Path | None
    recent_batches: deque[tuple[int, int, dict[str, Any]]]
    step_batches: list[tuple[int, dict[str, Any]]]
    stage: str | None

    def path(self, *parts: str) -> Path: ...
    def report(self, code: str, message: str, *, step: int | None = None, evidence: dict[str, Any] | None = None,
               severity: Severity | str | None = None, plugin: str | None = None) -> Finding: ...
    def log_metrics(self, metrics: dict[str, Any], step: int | None = None) -> None: ...
    def defer(self, key: str, tensor: Any, *, owner: str | None = None) -> None: ...
    def deferred(self, key: str, *, owner: str | None = None) -> list[Any]: ...
    def reserve(self, key: str, capacity: int, *, owner: str | None = None) -> None: ...
    def share(self, key: str, values: Sequence[int], *, owner: str | None = None) -> None: ...
    def shared(self, key: str, *, owner: str | None = None) -> list[list[int] | None] | None: ...
    def shared_cut(self, key: str, *, owner: str | None = None) -> list[int]: ...
    def stop_after_update(self, save: bool = True, cause: Finding | None = None) -> None: ...


class HookCaller(Protocol):
    """What the typed facade (:class:`harness.core.hooks.Hooks`) uses of the plugin manager."""

    def call(self, hook: str, **kwargs: Any) -> list[tuple[str, Any]]: ...
    def call_first(self, hook: str, **kwargs: Any) -> tuple[str, Any] | None: ...
    def call_plugin(self, name: str, hook: str, **kwargs: Any) -> Any: ...
    def call_plugin_unisolated(self, name: str, hook: str, **kwargs: Any) -> Any: ...
