"""The catalog: every available plugin, loaded and validated once, with its option model and codes.

Built from :func:`harness.core.registry.discover` (built-in and entry-point
plugins) plus what the caller adds; the config is validated against
:meth:`Catalog.config_model`.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from pydantic import BaseModel, Field, create_model

from harness.core.codes import CORE_CODES
from harness.core.errors import PluginError
from harness.core.findings import FindingCode
from harness.core.manager import HarnessPluginManager
from harness.core.options import CORE_KEYS, CoreOptions
from harness.core.registry import PluginEntry, discover, entry_for


@dataclass
class Catalog:
    """Every available plugin, loaded and validated, with its option model and codes."""

    entries: dict[str, PluginEntry]
    manager: HarnessPluginManager
    option_models: dict[str, type[BaseModel] | None]
    codes: dict[str, FindingCode]
    code_owner: dict[str, str]
    broken: dict[str, str] = field(default_factory=dict)  # installed plugins that failed to load

    @classmethod
    def build(cls, extra: list[Any] | None = None, autoload: bool | None = None) -> "Catalog":
        entries = discover(autoload)
        for spec in extra or []:
            entry = entry_for(spec, entries)
            entries.setdefault(entry.name, entry)
        manager = HarnessPluginManager()
        option_models: dict[str, type[BaseModel] | None] = {}
        codes: dict[str, FindingCode] = {c.code: c for c in CORE_CODES}
        owner = {c.code: "harness" for c in CORE_CODES}
        broken: dict[str, str] = {}
        for name, entry in list(entries.items()):
            if name in CORE_KEYS:
                raise PluginError(f"plugin '{name}' ({entry.source}) has the name of a core option; rename the plugin.")
            try:
                manager.register(entry)
                option_models[name] = manager.option_model(name)
                declared = manager.declared_codes(name)
            except Exception as exc:  # noqa: BLE001 - a broken third-party plugin must not break every run
                if entry.source == "builtin":
                    raise
                broken[name] = f"plugin '{name}' ({entry.source}) cannot be loaded: {exc!r}"
                del entries[name]
                continue
            for code in declared:
                if code.code in owner and owner[code.code] != name:
                    raise PluginError(
                        f"finding code '{code.code}' is declared by both '{owner[code.code]}' and '{name}'."
                    )
                codes[code.code], owner[code.code] = code, name
        return cls(entries, manager, option_models, codes, owner, broken)

    def add(self, spec: Any) -> str:
        """Make a plugin given as a path or object available; return its name."""
        if isinstance(spec, str) and spec in self.entries:
            return spec
        try:
            entry = entry_for(spec, self.entries)
        except KeyError:
            raise
        if entry.name not in self.entries:
            self.entries[entry.name] = entry
            self.manager.register(entry)
            self.option_models[entry.name] = self.manager.option_model(entry.name)
            for code in self.manager.declared_codes(entry.name):
                self.codes[code.code], self.code_owner[code.code] = code, entry.name
        return entry.name

    def config_model(self) -> type[CoreOptions]:
        fields: dict[str, Any] = {}
        for name, model in self.option_models.items():
            if model is not None:
                fields[name] = (model, Field(default_factory=model, description=self.entries[name].description))
        return create_model("HarnessConfig", __base__=CoreOptions, **fields)  # type: ignore[call-overload]

    @property
    def default_enabled(self) -> list[str]:
        return [name for name, entry in self.entries.items() if entry.default_enabled]
