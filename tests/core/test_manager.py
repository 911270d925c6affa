"""Plugin discovery, entry points, autoload switch, unknown hooks, per-plugin isolation."""
from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import pytest

from harness.core.actions import HarnessStop
from harness.core.errors import PluginError
from harness.core.hookspecs import hookimpl
from harness.core.manager import AUTOLOAD_ENV, HarnessPluginManager, PluginEntry, discover


def _entry(obj: Any, name: str) -> PluginEntry:
    return PluginEntry(name, "object", lambda: obj)


def test_unknown_hook_names_plugin_hook_and_suggestion() -> None:
    class Typo:
        @hookimpl
        def on_los(self, ctx: Any) -> None: ...

    manager = HarnessPluginManager()
    with pytest.raises(PluginError) as info:
        manager.register(_entry(Typo(), "typo_plugin"))
    message = str(info.value)
    assert "plugin 'typo_plugin'" in message and "unknown hook 'on_los'" in message
    assert "Did you mean 'on_loss'?" in message


def test_wrong_argument_name_is_a_clear_error() -> None:
    class BadArgs:
        @hookimpl
        def on_loss(self, ctx: Any, losss: Any) -> None: ...

    with pytest.raises(PluginError, match="plugin 'bad'.*does not match"):
        HarnessPluginManager().register(_entry(BadArgs(), "bad"))


def test_exception_in_one_plugin_does_not_stop_the_others() -> None:
    seen: list[str] = []

    class Broken:
        @hookimpl
        def on_step_end(self, step: int) -> None:
            raise ValueError("broken on purpose")

    class Healthy:
        @hookimpl
        def on_step_end(self, step: int) -> None:
            seen.append(f"healthy:{step}")

    errors: list[tuple[str, str, str]] = []
    manager = HarnessPluginManager(max_errors_per_plugin=2)
    manager.on_error = lambda plugin, hook, exc, tb: errors.append((plugin, hook, tb))
    manager.register(_entry(Healthy(), "healthy"))
    manager.register(_entry(Broken(), "broken"))
    for step in (1, 2, 3):
        manager.call("on_step_end", ctx=None, step=step, metrics={})
    assert seen == ["healthy:1", "healthy:2", "healthy:3"]
    assert [e[0] for e in errors] == ["broken", "broken"]  # switched off after 2
    assert "broken on purpose" in errors[0][2] and manager.is_disabled("broken")


def test_firstresult_takes_first_non_none() -> None:
    class Abstains:
        @hookimpl
        def decide_action(self, finding: Any) -> None:
            return None

    class Decides:
        @hookimpl
        def decide_action(self, finding: Any) -> str:
            return "stop"

    manager = HarnessPluginManager()
    manager.register(_entry(Decides(), "decides"))
    manager.register(_entry(Abstains(), "abstains"))
    assert manager.call_first("decide_action", ctx=None, finding=None) == ("decides", "stop")


@pytest.fixture
def entry_point_dist(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> str:
    """A real installed distribution (dist-info on sys.path) exposing a plugin through the 'harness' group."""
    (tmp_path / "thirdparty_plugin.py").write_text(
        "from harness import hookimpl\n"
        "class ThirdParty:\n"
        "    '''A third-party plugin found through its entry point.'''\n"
        "    @hookimpl\n"
        "    def on_step_end(self, step):\n"
        "        pass\n",
        encoding="utf-8",
    )
    info = tmp_path / "thirdparty_plugin-1.0.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: thirdparty-plugin\nVersion: 1.0\n", encoding="utf-8")
    (info / "entry_points.txt").write_text("[harness]\nthirdparty = thirdparty_plugin:ThirdParty\n", encoding="utf-8")
    monkeypatch.syspath_prepend(str(tmp_path))
    return "thirdparty"


def test_entry_point_plugins_autoload(entry_point_dist: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(AUTOLOAD_ENV, raising=False)
    catalog = discover()
    assert entry_point_dist in catalog
    entry = catalog[entry_point_dist]
    assert "thirdparty-plugin" in entry.source and not entry.default_enabled
    assert entry.description == "A third-party plugin found through its entry point."


def test_autoload_can_be_disabled_by_environment(entry_point_dist: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(AUTOLOAD_ENV, "1")
    catalog = discover()
    assert entry_point_dist not in catalog and "metrics_log" in catalog


def test_bad_module_path_is_clear() -> None:
    from harness.core.manager import import_target

    with pytest.raises(PluginError, match="cannot import plugin module 'no_such_mod'"):
        import_target("no_such_mod:X")
    with pytest.raises(PluginError, match="has no attribute 'FaultInjectr'.*Did you mean 'FaultInjector'"):
        import_target("harness.testing:FaultInjectr")
    assert sys.modules.get("no_such_mod") is None


def test_a_broken_third_party_plugin_only_matters_when_enabled(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from harness.core.config import Catalog, load_config
    from harness.core.errors import ConfigError

    info = tmp_path / "broken_plugin-1.0.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: broken-plugin\nVersion: 1.0\n", encoding="utf-8")
    (info / "entry_points.txt").write_text("[harness]\nbroken = not_installed_module:Plugin\n", encoding="utf-8")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delenv(AUTOLOAD_ENV, raising=False)
    catalog = Catalog.build()
    assert "broken" in catalog.broken and load_config({}, catalog).enabled == catalog.default_enabled
    with pytest.raises(ConfigError, match="plugin 'broken'.*cannot be loaded.*not_installed_module"):
        load_config({"plugins": ["broken"]}, catalog)


@pytest.mark.parametrize("kind", ["wrapper", "hookwrapper"])
def test_wrapper_hookimpl_is_refused(kind: str) -> None:
    """The manager calls each implementation itself, so a pluggy wrapper's body would never run: refused, by name."""
    ran: list[int] = []

    class Wrapping:
        @hookimpl(**{kind: True})
        def on_step_end(self, step: int) -> Any:
            ran.append(step)
            yield

    manager = HarnessPluginManager()
    with pytest.raises(PluginError) as info:
        manager.register(_entry(Wrapping(), "wrapping"))
    message = str(info.value)
    assert "plugin 'wrapping'" in message and "hook 'on_step_end'" in message and f"{kind}=True" in message
    assert "plain @hookimpl" in message
    assert manager.names == [] and manager.plugin("wrapping") is None and not manager.has_impl("on_step_end")

    class Plain:
        @hookimpl
        def on_step_end(self, step: int) -> None:
            ran.append(step)

    manager.register(_entry(Plain(), "wrapping"))  # the name is free again, and a plain hookimpl runs
    manager.call("on_step_end", ctx=None, step=7, metrics={})
    assert ran == [7]


def test_an_idle_hook_is_not_called_until_it_is_woken() -> None:
    """set_idle drops one plugin's implementations of the named hooks from the calls (other hooks and plugins untouched)."""
    seen: list[str] = []

    class Quiet:
        @hookimpl
        def on_step_end(self, step: int) -> None:
            seen.append(f"quiet:{step}")

        @hookimpl
        def on_log(self, step: int) -> None:
            seen.append(f"quiet-log:{step}")

    class Busy:
        @hookimpl
        def on_step_end(self, step: int) -> None:
            seen.append(f"busy:{step}")

    manager = HarnessPluginManager()
    manager.register(_entry(Quiet(), "quiet"))
    manager.register(_entry(Busy(), "busy"))
    manager.call("on_step_end", ctx=None, step=1, metrics={})
    manager.set_idle("quiet", ["on_step_end"])
    assert manager.is_idle("quiet", "on_step_end") and not manager.is_idle("quiet", "on_log")
    manager.call("on_step_end", ctx=None, step=2, metrics={})
    manager.call("on_log", ctx=None, step=2, logs={})
    manager.set_idle("quiet", ["on_step_end"], idle=False)
    manager.call("on_step_end", ctx=None, step=3, metrics={})
    assert seen == ["busy:1", "quiet:1", "busy:2", "quiet-log:2", "busy:3", "quiet:3"]  # pluggy: the last registered first
    with pytest.raises(PluginError, match="on_step_ends"):
        manager.set_idle("quiet", ["on_step_ends"])


@pytest.mark.parametrize("monitored", [False, True], ids=["inline", "monitored"])
def test_call_isolates_names_and_restores_the_current_plugin_on_both_paths(monitored: bool) -> None:
    """``call`` writes ``_call_one``'s isolation out in its loop; a call monitor sends every call through ``_call_one``.
    Both must name the running plugin (nested calls included), isolate errors, pass stops on, and tell the monitor."""
    seen: list[tuple[str, str | None]] = []
    manager = HarnessPluginManager()

    class Outer:
        @hookimpl
        def on_step_end(self, step: int) -> None:
            seen.append(("outer", manager.current_plugin))
            manager.call("on_log", ctx=None, step=step, logs={})  # a nested call (report -> on_finding does this)
            seen.append(("outer after nested", manager.current_plugin))

    class Inner:
        @hookimpl
        def on_log(self, step: int) -> None:
            seen.append(("inner", manager.current_plugin))

    class Failing:
        @hookimpl
        def on_step_end(self, step: int) -> str:
            raise ValueError("failing on purpose")

    class Stopping:
        @hookimpl
        def on_step_end(self, step: int) -> str:
            raise HarnessStop("stop now")

    class Answering:
        @hookimpl
        def on_step_end(self, step: int) -> str:
            return f"answer {step}"

    for plugin, name in ((Answering(), "answering"), (Stopping(), "stopping"), (Failing(), "failing"), (Inner(), "inner"), (Outer(), "outer")):
        manager.register(_entry(plugin, name))
    errors: list[tuple[str, str]] = []
    stops: list[tuple[str, str]] = []
    monitored_calls: list[tuple[str, str, int, float]] = []
    manager.on_error = lambda plugin, hook, exc, tb: errors.append((plugin, hook))
    manager.on_stop = lambda plugin, hook, stop, tb: stops.append((plugin, hook))
    if monitored:
        manager.monitor_calls(lambda hook, plugin, kwargs, seconds: monitored_calls.append((hook, plugin, kwargs["step"], seconds)))
    manager.current_plugin = "the caller"
    results = manager.call("on_step_end", ctx=None, step=7, metrics={})
    assert results == [("answering", "answer 7")]
    assert seen == [("outer", "outer"), ("inner", "inner"), ("outer after nested", "outer")]
    assert errors == [("failing", "on_step_end")] and stops == [("stopping", "on_step_end")]
    assert manager.current_plugin == "the caller"
    manager.on_stop = None  # no handler: the stop reaches the caller, with the current plugin restored
    with pytest.raises(HarnessStop):
        manager.call("on_step_end", ctx=None, step=8, metrics={})
    assert manager.current_plugin == "the caller"
    if monitored:
        assert [(h, p, s) for h, p, s, _ in monitored_calls[:5]] == [
            ("on_log", "inner", 7), ("on_step_end", "outer", 7), ("on_step_end", "failing", 7), ("on_step_end", "stopping", 7),
            ("on_step_end", "answering", 7),
        ]
        assert all(seconds >= 0 for *_, seconds in monitored_calls)
        manager.monitor_calls(None)
        count = len(monitored_calls)
        manager.call("on_log", ctx=None, step=9, logs={})
        assert len(monitored_calls) == count  # switched off
    else:
        assert not monitored_calls
