"""The harness config: one YAML file, validated with pydantic, errors that say how to fix them.

Top-level keys are the core options below plus one section per plugin, named
after the plugin, holding that plugin's options (its ``add_config`` model).
Options of plugins that are not enabled are still validated, so a typo never
waits for the day the plugin is switched on.
"""
from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, create_model

from harness.actions import Action
from harness.errors import ConfigError, PluginError, did_you_mean
from harness.findings import FindingCode, Severity
from harness.manager import HarnessPluginManager, PluginEntry, discover, entry_for

CONFIG_ENV = "HARNESS_CONFIG"
PLUGINS_ENV = "HARNESS_PLUGINS"
REPORT_PLOTS_ENV = "HARNESS_REPORT_PLOTS"
REFERENCE_HINT = "see `harness plugins --config-reference`"
# Mark an option that names finding codes (a list of codes, a mapping keyed by code, or one code) with
# ``Field(..., json_schema_extra=NAMES_CODES)``: resolve_config checks every such value against the codes the
# catalog's plugins declare, for every plugin alike (core options included), with a did-you-mean.
NAMES_CODES: dict[str, Any] = {"names_codes": True}


class CoreOptions(BaseModel):
    """Options of the harness itself (top level of the YAML file)."""

    model_config = ConfigDict(extra="forbid")

    plugins: list[str] | None = Field(
        None,
        description="Plugins to enable: built-in names, entry-point names or 'module:Class' paths; the name "
        "'defaults' stands for every plugin that is on by default (`harness plugins` marks them). Default: [defaults].",
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


CORE_KEYS = tuple(CoreOptions.model_fields)


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
        from harness.core_codes import CORE_CODES

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


@dataclass
class ResolvedConfig:
    """A validated config: the model instance, where it came from and the plugins it enables."""

    model: CoreOptions
    source: str
    enabled: list[str]

    def options_for(self, plugin: str) -> BaseModel | None:
        return getattr(self.model, plugin, None)

    def to_yaml(self) -> str:
        data = self.model.model_dump(mode="json")
        data["plugins"] = self.enabled
        return yaml.safe_dump(data, sort_keys=False)


def read_yaml(path: Path) -> dict[str, Any]:
    """Read a YAML mapping, with errors that name the file and the line."""
    path = Path(path)
    if not path.exists():
        raise ConfigError([f"harness config file '{path}' does not exist. Fix: pass an existing YAML file with --config (or HARNESS_CONFIG)."])
    try:
        data = yaml.safe_load(path.read_text(encoding="utf-8"))
    except yaml.YAMLError as exc:
        where = ""
        mark = getattr(exc, "problem_mark", None)
        if mark is not None:
            where = f" at line {mark.line + 1}, column {mark.column + 1}"
        raise ConfigError([f"harness config file '{path}' is not valid YAML{where}: {getattr(exc, 'problem', exc)}. Fix: correct the YAML syntax there."]) from None
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ConfigError([f"harness config file '{path}' must hold a mapping of options at the top level, got {type(data).__name__}. Fix: write `key: value` lines ({REFERENCE_HINT})."])
    return data


def _owner(loc: tuple[Any, ...], catalog: Catalog) -> str:
    if loc and loc[0] in catalog.option_models:
        return f"plugin '{loc[0]}'"
    return "the harness core"


def _fields_at(model: type[BaseModel], path: tuple[Any, ...]) -> list[str] | None:
    """Field names of the (nested) model that holds ``path``; None when it is not a model."""
    current: Any = model
    for part in path:
        if not (isinstance(current, type) and issubclass(current, BaseModel)):
            return None
        field = current.model_fields.get(str(part))
        if field is None:
            return None
        current = field.annotation
    if isinstance(current, type) and issubclass(current, BaseModel):
        return list(current.model_fields)
    return None


def _explain(error: dict[str, Any], source: str, model: type[BaseModel], catalog: Catalog) -> str:
    loc = tuple(error.get("loc", ()))
    key = ".".join(str(p) for p in loc) or "(top level)"
    owner = _owner(loc, catalog)
    if error.get("type") == "extra_forbidden":
        if len(loc) == 1 and loc[0] in catalog.entries:
            return (
                f"harness config error in {source}, key '{key}' (plugin '{loc[0]}'): this plugin has no options. "
                f"Fix: remove the '{loc[0]}' section (enable the plugin under 'plugins' instead)."
            )
        allowed = _fields_at(model, loc[:-1]) or []
        kind = "option" if loc[:-1] else "top-level key (neither a core option nor a plugin name)"
        return (
            f"harness config error in {source}, key '{key}' ({owner}): unknown {kind}."
            f"{did_you_mean(loc[-1], allowed)} Valid keys here: {', '.join(allowed)}. "
            f"Fix: rename or remove the key ({REFERENCE_HINT})."
        )
    value = error.get("input")
    if error.get("type") in ("literal_error", "enum"):  # a choice (an action, a mode): list the valid ones
        import re

        valid = re.findall(r"'([^']*)'", str((error.get("ctx") or {}).get("expected", "")))
        return (
            f"harness config error in {source}, key '{key}' ({owner}): {value!r} is not a valid value."
            f"{did_you_mean(str(value), valid)} Valid values: {', '.join(valid)}. Fix: use one of them ({REFERENCE_HINT})."
        )
    return (
        f"harness config error in {source}, key '{key}' ({owner}): {error.get('msg')}; got {value!r}. "
        f"Fix: give a value of the right type ({REFERENCE_HINT})."
    )


def resolve_config(
    data: dict[str, Any] | None,
    catalog: Catalog,
    source: str = "<inline config>",
    extra_plugins: list[str] | None = None,
) -> ResolvedConfig:
    """Validate ``data`` against the core options and every plugin's options."""
    listed = (data or {}).get("plugins")
    for spec in (listed if isinstance(listed, list) else []) + list(extra_plugins or []):
        if isinstance(spec, str) and ":" in spec:
            catalog.add(spec)  # its options must be known before the file is validated
    model_cls = catalog.config_model()
    try:
        model = model_cls.model_validate(data or {})
    except ValidationError as exc:
        raise ConfigError([_explain(e, source, model_cls, catalog) for e in exc.errors()]) from None
    problems: list[str] = []
    requested = list(model.plugins) if model.plugins is not None else ["defaults"]
    requested = [name for spec in requested for name in (catalog.default_enabled if spec == "defaults" else [spec])]
    enabled: list[str] = []
    for spec in requested + list(extra_plugins or []):
        if spec in catalog.broken:
            problems.append(f"harness config error in {source}, key 'plugins': {catalog.broken[spec]}. Fix: reinstall or fix that package, or remove it from 'plugins'.")
            continue
        try:
            name = catalog.add(spec)
        except KeyError:
            problems.append(
                f"harness config error in {source}, key 'plugins': unknown plugin '{spec}'."
                f"{did_you_mean(spec, catalog.entries)} Available plugins: {', '.join(catalog.entries) or '(none)'}. "
                "Fix: use a name from `harness plugins`, or a 'module:Class' path."
            )
            continue
        if name not in enabled:
            enabled.append(name)
    for name in model.disable:
        if name not in catalog.entries:
            problems.append(
                f"harness config error in {source}, key 'disable': unknown plugin '{name}'."
                f"{did_you_mean(name, catalog.entries)} Fix: use a name from `harness plugins`."
            )
    enabled = [n for n in enabled if n not in model.disable]
    problems += _unknown_codes(model, catalog, source)
    if problems:
        raise ConfigError(problems)
    return ResolvedConfig(model=model, source=source, enabled=enabled)


def names_codes(field: Any) -> bool:
    """Whether a pydantic field is marked as naming finding codes (see ``NAMES_CODES``)."""
    extra = getattr(field, "json_schema_extra", None)
    return isinstance(extra, dict) and bool(extra.get("names_codes"))


def _unknown_codes(model: BaseModel, catalog: Catalog, source: str, path: tuple[str, ...] = ()) -> list[str]:
    """Every value of an option marked ``names_codes``, anywhere in the config, must be a declared finding code."""
    problems: list[str] = []
    for key, field in type(model).model_fields.items():
        value = getattr(model, key, None)
        where = (*path, key)
        if names_codes(field):
            if isinstance(value, dict):
                named = [(f"{'.'.join(where)}.{code}", code) for code in value]
            elif isinstance(value, (list, tuple, set, frozenset)):
                named = [(f"{'.'.join(where)}[{i}]", code) for i, code in enumerate(value)]
            else:
                named = [(".".join(where), value)] if value is not None else []
            for key_text, code in named:
                if str(code) not in catalog.codes:
                    problems.append(_unknown_code_message(source, key_text, str(code), where[0] if path else None, catalog))
        for i, nested in enumerate(value if isinstance(value, (list, tuple)) else [value]):
            if isinstance(nested, BaseModel):
                inner = (*where, str(i)) if isinstance(value, (list, tuple)) else where
                problems += _unknown_codes(nested, catalog, source, inner)
    return problems


def _unknown_code_message(source: str, key: str, code: str, plugin: str | None, catalog: Catalog) -> str:
    owner = f"plugin '{plugin}'" if plugin else "the harness core"
    own = sorted(c for c, o in catalog.code_owner.items() if plugin and o == plugin)
    valid = f"Codes of {plugin}: {', '.join(own)}; every code: `harness plugins --codes`." if own else (
        "Valid codes: those listed by `harness plugins --codes`.")
    return (
        f"harness config error in {source}, key '{key}' ({owner}): unknown finding code '{code}'."
        f"{did_you_mean(code, catalog.codes)} {valid} Fix: use a declared code."
    )


def load_config(
    config: str | os.PathLike[str] | dict[str, Any] | None,
    catalog: Catalog,
    extra_plugins: list[str] | None = None,
) -> ResolvedConfig:
    """Load from a path, a dict, or (None) the ``HARNESS_CONFIG``/``HARNESS_PLUGINS`` environment."""
    extra = list(extra_plugins or [])
    if config is None:
        env_plugins = os.environ.get(PLUGINS_ENV, "")
        extra += [p.strip() for p in env_plugins.split(",") if p.strip()]
        config = os.environ.get(CONFIG_ENV) or None
    if config is None:
        return resolve_config({}, catalog, "<defaults>", extra)
    if isinstance(config, dict):
        return resolve_config(config, catalog, "<inline config>", extra)
    path = Path(config).resolve()
    return resolve_config(read_yaml(path), catalog, str(path), extra)


def config_reference(catalog: Catalog) -> str:
    """Every option with type, default and description, as markdown."""
    lines = ["# harness config reference", "", "## core options (top level)", ""]
    lines += _model_reference(CoreOptions, prefix="")
    for name, model in catalog.option_models.items():
        entry = catalog.entries[name]
        lines += ["", f"## {name} ({entry.source}{', on by default' if entry.default_enabled else ''})", "", entry.description, ""]
        lines += _model_reference(model, prefix=f"{name}.") if model is not None else ["(no options)"]
    return "\n".join(lines) + "\n"


def _type_name(annotation: Any) -> str:
    text = getattr(annotation, "__name__", None) if isinstance(annotation, type) else None
    return text or str(annotation).replace("typing.", "")


def _model_reference(model: type[BaseModel], prefix: str) -> list[str]:
    lines = []
    for key, field in model.model_fields.items():
        default = field.get_default(call_default_factory=True)
        if isinstance(default, BaseModel):
            lines += _model_reference(type(default), prefix=f"{prefix}{key}.")
            continue
        default_text = default.value if hasattr(default, "value") else default
        lines.append(f"- `{prefix}{key}` ({_type_name(field.annotation)}, default `{default_text!r}`): {field.description or '(undocumented)'}")
    return lines
