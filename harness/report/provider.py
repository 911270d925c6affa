"""Where the plugins' report sections come from: a small protocol, so the report never builds plugins itself.

The live run hands :class:`PluginSections` over its own plugin manager and
config; ``harness report`` (:mod:`harness.tools.report`) rebuilds the plugins
from the run directory and hands the same kind of provider over. The report
only calls ``sections(run)``.
"""
from __future__ import annotations

import dataclasses

from collections.abc import Sequence
from typing import Any, Protocol

from pydantic import BaseModel

from harness.report.model import ReportSection
from harness.report.record import RunRecord


class SectionsProvider(Protocol):
    """Supplies the plugins' sections of one run's report, and notes on what was left out or failed."""

    def sections(self, run: RunRecord) -> tuple[list[ReportSection], list[str]]: ...


class ReportHooks(Protocol):
    """What :class:`PluginSections` uses of the plugin manager's typed facade (``manager.hooks``)."""

    def report_sections(self, name: str, run: Any, options: BaseModel | None) -> Any: ...


class PluginManagerLike(Protocol):
    """What :class:`PluginSections` uses of a plugin manager: its plugin names and its typed hooks."""

    @property
    def names(self) -> list[str]: ...

    @property
    def hooks(self) -> ReportHooks: ...


class ConfigLike(Protocol):
    """What :class:`PluginSections` uses of a resolved config."""

    def options_for(self, plugin: str) -> BaseModel | None: ...


class NoSections:
    """No plugin sections (a report from the run directory's own files only)."""

    def sections(self, run: RunRecord) -> tuple[list[ReportSection], list[str]]:
        return [], []


class PluginSections:
    """Every plugin's ``report_sections``; a failing plugin costs its section, noted, never the report.

    ``notes`` are put before the sections' own notes (e.g. the offline
    command's notes on plugins it left out).
    """

    def __init__(self, manager: PluginManagerLike, config: ConfigLike | None = None, notes: Sequence[str] = ()) -> None:
        self.manager = manager
        self.config = config
        self.notes = list(notes)

    def sections(self, run: RunRecord) -> tuple[list[ReportSection], list[str]]:
        found: list[ReportSection] = []
        notes = list(self.notes)
        for name in self.manager.names:
            options = self.config.options_for(name) if self.config is not None else None
            try:  # unisolated: a failed section must not count against the plugin's error budget
                result = self.manager.hooks.report_sections(name, run, options)
            except Exception as exc:  # noqa: BLE001
                notes.append(f"plugin '{name}' failed in report_sections: {type(exc).__name__}: {exc}")
                continue
            for section in result if isinstance(result, (list, tuple)) else [result] if result is not None else []:
                if isinstance(section, ReportSection):
                    found.append(section if section.plugin else dataclasses.replace(section, plugin=name))  # keeps its plots
                else:
                    notes.append(f"plugin '{name}' returned {type(section).__name__} from report_sections; expected ReportSection.")
        return found, notes
