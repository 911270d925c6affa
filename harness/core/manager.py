"""The plugin manager: pluggy under a typed facade, with per-plugin isolation of failures.

Where plugins come from (the built-in list, entry points, ``module:Class``
paths) is :mod:`harness.core.registry`; its names are re-exported here for
code that imported them from this module.
"""
from __future__ import annotations

import inspect
import operator
import traceback
from time import perf_counter
from typing import Any, Callable, Iterable

import pluggy
from pydantic import BaseModel

from harness.core import hookspecs
from harness.core.actions import HarnessStop
from harness.core.errors import PluginError, did_you_mean
from harness.core.findings import FindingCode
from harness.core.hooks import Hooks
from harness.core.registry import (  # noqa: F401 - re-exported: discovery used to live here
    AUTOLOAD_ENV,
    ENTRY_POINT_GROUP,
    PluginEntry,
    discover,
    entry_for,
    import_target,
)

HOOK_NAMES: tuple[str, ...] = tuple(
    name for name, fn in vars(hookspecs).items() if callable(fn) and hasattr(fn, "harness_spec")
)


class ArgNames(tuple):
    """A hook implementation's argument names, with ``pick(kwargs)``: its arguments in order, in C (``itemgetter``).

    Every hook call on the training thread goes through here; a list built in
    Python per call is a measurable part of the harness's time per step.
    """

    pick: Callable[[dict[str, Any]], tuple[Any, ...]]

    def __new__(cls, names: Iterable[str]) -> "ArgNames":
        self = super().__new__(cls, tuple(names))
        if len(self) > 1:
            self.pick = operator.itemgetter(*self)
        elif len(self) == 1:
            self.pick = lambda kwargs, name=self[0]: (kwargs[name],)
        else:
            self.pick = lambda kwargs: ()
        return self


class HookCallError(Exception):
    """Carries an exception raised inside one plugin's hook implementation."""


ErrorSink = Callable[[str, str, BaseException, str], None]
CallMonitor = Callable[[str, str, dict[str, Any], float], None]  # (hook, plugin, the call's keyword arguments, seconds)


class HarnessPluginManager:
    """Registers plugins, validates them, and calls hooks with per-plugin isolation.

    pluggy stops a hook call at the first exception; we call each
    implementation ourselves so one broken plugin cannot silence the others or
    reach the training loop.
    """

    def __init__(self, max_errors_per_plugin: int = 10) -> None:
        self._pm = pluggy.PluginManager(hookspecs.PROJECT)
        self._pm.add_hookspecs(hookspecs)
        self._entries: dict[str, PluginEntry] = {}
        self._impls: dict[str, list[tuple[str, Callable[..., Any], tuple[str, ...]]]] = {}
        self._error_counts: dict[str, int] = {}
        self._disabled: set[str] = set()
        self._idle: set[tuple[str, str]] = set()  # (plugin, hook) pairs not called for now: nothing to do in this run
        self._version = 0  # bumped by every change to what is called: a list built across a change is not kept
        self._wants_disabling: set[str] = set()  # past the error limit, waiting for the ranks to agree (several processes)
        self.max_errors_per_plugin = max_errors_per_plugin
        self.defer_disabling = False  # set when several processes train: a plugin is switched off on every rank together
        self.on_error: ErrorSink | None = None
        self.on_stop: ErrorSink | None = None
        self.current_plugin: str | None = None
        self._monitor: CallMonitor | None = None
        self.hooks = Hooks(self)  # the typed way in: one method per hook

    # -- registration -------------------------------------------------------------------

    def register(self, entry: PluginEntry) -> Any:
        plugin = entry.instance()
        if entry.name in self._entries:
            raise PluginError(f"two plugins are named '{entry.name}' ({self._entries[entry.name].source} and {entry.source}).")
        try:
            self._pm.register(plugin, name=entry.name)
        except pluggy.PluginValidationError as exc:
            raise PluginError(
                f"plugin '{entry.name}' ({entry.source}) has a hook implementation that does not match its "
                f"specification: {exc}. Fix: use only argument names listed in harness.core.hookspecs."
            ) from exc
        self._refuse_wrappers(entry, plugin)
        self._entries[entry.name] = entry
        try:
            plugin.registered_name = entry.name  # an entry point may register a class under another name than its own
        except AttributeError:  # a plugin object with __slots__: set_idle then needs its registered name from the caller
            pass
        self._check_unknown_hooks(entry)
        self._impls.clear()
        self._version += 1
        return plugin

    def _refuse_wrappers(self, entry: PluginEntry, plugin: Any) -> None:
        """pluggy wrappers (``wrapper=True`` / ``hookwrapper=True``) never run here: the manager calls each implementation
        itself (for isolation), so a wrapper's body would be skipped in silence. Refused at registration instead."""
        for caller in self._pm.get_hookcallers(plugin) or []:
            for impl in caller.get_hookimpls():
                if impl.plugin is plugin and (getattr(impl, "wrapper", False) or getattr(impl, "hookwrapper", False)):
                    kind = "wrapper=True" if getattr(impl, "wrapper", False) else "hookwrapper=True"
                    self._pm.unregister(plugin)
                    raise PluginError(
                        f"plugin '{entry.name}' ({entry.source}) implements hook '{caller.name}' with @hookimpl({kind}); "
                        "the harness calls every implementation itself, one by one (so one failing plugin cannot affect "
                        "the others), and does not run pluggy wrappers. Fix: use a plain @hookimpl (optionally with "
                        "tryfirst=True or trylast=True for ordering)."
                    )

    def _check_unknown_hooks(self, entry: PluginEntry) -> None:
        """pluggy's check_pending(), turned into a message naming the plugin and the hook."""
        try:
            self._pm.check_pending()
        except pluggy.PluginValidationError:
            unknown = [
                name
                for name, caller in vars(self._pm.hook).items()
                if isinstance(caller, pluggy.HookCaller)
                and not caller.has_spec()
                and any(impl.plugin_name == entry.name for impl in caller.get_hookimpls())
            ]
            self._pm.unregister(name=entry.name)
            hook = unknown[0] if unknown else "?"
            raise PluginError(
                f"plugin '{entry.name}' ({entry.source}) implements unknown hook '{hook}'."
                f"{did_you_mean(hook, HOOK_NAMES)} Fix: rename the method to one of: {', '.join(HOOK_NAMES)} "
                "(see harness/core/hookspecs.py), or drop its @hookimpl marker."
            ) from None

    @property
    def names(self) -> list[str]:
        return list(self._entries)

    def plugin(self, name: str) -> Any:
        return self._pm.get_plugin(name)

    # -- calling --------------------------------------------------------------------------

    def _implementations(self, hook: str) -> list[tuple[str, Callable[..., Any], tuple[str, ...]]]:
        impls = self._impls.get(hook)
        if impls is None:
            version = self._version
            caller = getattr(self._pm.hook, hook)
            impls = [
                (impl.plugin_name, impl.function, ArgNames(impl.argnames))
                for impl in reversed(caller.get_hookimpls())
                if impl.plugin_name not in self._disabled and (impl.plugin_name, hook) not in self._idle
            ]
            if version == self._version:  # else a signal handler woke a hook while this list was built: build it anew next call
                self._impls[hook] = impls
        return impls

    def set_idle(self, plugin_name: str, hooks: Iterable[str], idle: bool = True) -> None:
        """Stop (``idle``) or resume calling one plugin's implementations of ``hooks``.

        A plugin with nothing to do in a run (a check across ranks in one
        process, a DPO check outside DPO, a poll with nothing pending) then
        costs no call per step: every call is paid on the training thread.
        """
        for hook in hooks:
            if hook not in HOOK_NAMES:
                raise PluginError(f"plugin '{plugin_name}' asked to idle unknown hook '{hook}'.{did_you_mean(hook, HOOK_NAMES)}")
            pair = (plugin_name, hook)
            if (pair in self._idle) != idle:
                (self._idle.add if idle else self._idle.discard)(pair)
                self._version += 1
                self._impls.pop(hook, None)

    def is_idle(self, plugin_name: str, hook: str) -> bool:
        return (plugin_name, hook) in self._idle

    def has_impl(self, hook: str) -> bool:
        return bool(self._implementations(hook))

    def call(self, hook: str, **kwargs: Any) -> list[tuple[str, Any]]:
        """Call every implementation of ``hook``; return ``(plugin, result)`` for non-None results.

        The per-step path: ``_call_one``'s isolation written out in one loop
        (no call frame per implementation, the cached list read directly), as
        every frame on the training thread runs with cold caches between two
        steps. With a call monitor (``monitor_calls``) each goes through
        ``_call_one`` instead.
        """
        impls = self._impls.get(hook)
        if impls is None:
            impls = self._implementations(hook)
        results: list[tuple[str, Any]] = []
        if self._monitor is not None:
            for plugin_name, function, argnames in impls:
                value = self._call_one(hook, plugin_name, function, argnames, kwargs)
                if value is not None:
                    results.append((plugin_name, value))
            return results
        caller = self.current_plugin  # hooks nest (report -> on_finding): restored when this call is done
        try:
            for plugin_name, function, argnames in impls:
                self.current_plugin = plugin_name
                try:
                    value = function(*argnames.pick(kwargs))
                except HarnessStop as stop:
                    if self.on_stop is None:
                        raise
                    self.on_stop(plugin_name, hook, stop, "")  # stopped at the next step guard, on every rank alike
                    continue
                except Exception as exc:  # noqa: BLE001 - isolation is the point
                    self.record_error(plugin_name, hook, exc)
                    continue
                if value is not None:
                    results.append((plugin_name, value))
        finally:
            self.current_plugin = caller
        return results

    def monitor_calls(self, monitor: CallMonitor | None) -> None:
        """Have ``monitor(hook, plugin, kwargs, seconds)`` told of every implementation call from now on (None: stop).

        For profilers and benchmarks (as pluggy's ``add_hookcall_monitoring``):
        a monitored call goes through ``_call_one`` and the clock, an
        unmonitored one costs nothing for the seam.
        """
        self._monitor = monitor

    def call_first(self, hook: str, **kwargs: Any) -> tuple[str, Any] | None:
        """firstresult semantics: ``(plugin, result)`` of the first non-None result, with the same isolation."""
        for plugin_name, function, argnames in self._implementations(hook):
            value = self._call_one(hook, plugin_name, function, argnames, kwargs)
            if value is not None:
                return plugin_name, value
        return None

    def call_plugin(self, name: str, hook: str, **kwargs: Any) -> Any:
        """Call one plugin's implementation of ``hook`` (None when it has none)."""
        for plugin_name, function, argnames in self._implementations(hook):
            if plugin_name == name:
                return self._call_one(hook, plugin_name, function, argnames, kwargs)
        return None

    def call_plugin_unisolated(self, name: str, hook: str, **kwargs: Any) -> Any:
        """One plugin's implementation with its exceptions left to the caller (for work outside training, like reports)."""
        for plugin_name, function, argnames in self._implementations(hook):
            if plugin_name == name:
                return function(*[kwargs[a] for a in argnames])
        return None

    def _call_one(
        self, hook: str, plugin_name: str, function: Callable[..., Any], argnames: ArgNames, kwargs: dict[str, Any]
    ) -> Any:
        monitor = self._monitor
        began = perf_counter() if monitor is not None else 0.0
        caller, self.current_plugin = self.current_plugin, plugin_name  # hooks nest (report -> decide_action)
        try:
            return function(*argnames.pick(kwargs))
        except HarnessStop as stop:
            if self.on_stop is None:
                raise
            self.on_stop(plugin_name, hook, stop, "")  # stopped at the next step guard, on every rank alike
            return None
        except Exception as exc:  # noqa: BLE001 - isolation is the point
            self.record_error(plugin_name, hook, exc)
            return None
        finally:
            self.current_plugin = caller
            if monitor is not None:
                monitor(hook, plugin_name, kwargs, perf_counter() - began)

    def record_error(self, plugin_name: str, hook: str, exc: BaseException) -> None:
        """Count an exception against a plugin (switching it off past the limit) and report it.

        In one process the plugin is switched off at once. With several, a
        plugin switched off on one rank only would skip collectives the other
        ranks enter; so it is only marked, keeps being called (its guarded
        collectives keep every rank in step), and the ranks switch it off
        together where they next agree (``disabling_votes`` /
        ``apply_disabling_votes``, riding on the step guard's all-reduce).
        """
        count = self._error_counts.get(plugin_name, 0) + 1
        self._error_counts[plugin_name] = count
        if count >= self.max_errors_per_plugin and plugin_name not in self._disabled:
            if self.defer_disabling:
                self._wants_disabling.add(plugin_name)
            else:
                self._disabled.add(plugin_name)
                self._impls.clear()
                self._version += 1
        if self.on_error is not None:
            tb = "".join(traceback.format_exception(type(exc), exc, exc.__traceback__))
            self.on_error(plugin_name, hook, exc, tb)

    def error_count(self, plugin_name: str) -> int:
        return self._error_counts.get(plugin_name, 0)

    def is_disabled(self, plugin_name: str) -> bool:
        return plugin_name in self._disabled

    def wants_disabling(self, plugin_name: str) -> bool:
        """Past its error limit on this rank, not yet switched off (several processes: waiting for the next agreement)."""
        return plugin_name in self._wants_disabling

    def has_disabling_votes(self) -> bool:
        return bool(self._wants_disabling)

    def disabling_votes(self) -> list[int]:
        """One slot per registered plugin, in registration order (the same on every rank): 1 to switch it off."""
        return [int(name in self._wants_disabling) for name in self._entries]

    def apply_disabling_votes(self, votes: list[int]) -> list[str]:
        """Switch off every plugin some rank voted off (the element-wise maximum of all ranks' votes); returns the new ones."""
        names = [name for name, vote in zip(self._entries, votes) if vote and name not in self._disabled]
        self._wants_disabling.difference_update(name for name, vote in zip(self._entries, votes) if vote)
        if names:
            self._disabled.update(names)
            self._impls.clear()
            self._version += 1
        return names

    # -- declarations ------------------------------------------------------------------------

    def _declaration(self, name: str, hook: str) -> Any:
        """Declaration hooks run at set-up, where an exception is a plugin bug to show, not isolate."""
        for plugin_name, function, _ in self._implementations(hook):
            if plugin_name == name:
                try:
                    return function()
                except Exception as exc:
                    raise PluginError(f"plugin '{name}' failed in {hook}(): {exc!r}.") from exc
        return None

    def option_model(self, name: str) -> type[BaseModel] | None:
        model = self._declaration(name, "add_config")
        if model is not None and not (inspect.isclass(model) and issubclass(model, BaseModel)):
            raise PluginError(f"plugin '{name}': add_config() must return a pydantic BaseModel class, got {model!r}.")
        return model

    def declared_codes(self, name: str) -> list[FindingCode]:
        codes = self._declaration(name, "declare_codes") or []
        if not isinstance(codes, (list, tuple)) or not all(isinstance(c, FindingCode) for c in codes):
            raise PluginError(f"plugin '{name}': declare_codes() must return a list of harness.FindingCode, got {codes!r}.")
        return list(codes)


def build_manager(entries: Iterable[PluginEntry], max_errors_per_plugin: int = 10) -> HarnessPluginManager:
    manager = HarnessPluginManager(max_errors_per_plugin)
    for entry in entries:
        manager.register(entry)
    return manager
