"""The harness config: one YAML file, validated with pydantic, errors that say how to fix them.

Top-level keys are the core options (:mod:`harness.core.options`) plus one
section per plugin, named after the plugin, holding that plugin's options (its
``Options`` model). Options of plugins that are not enabled are still
validated, so a typo never waits for the day the plugin is switched on.
The names of the options and catalog modules are re-exported here.
"""
from __future__ import annotations

import os
import re
import select
import stat
import time
import typing
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml
from pydantic import BaseModel, ValidationError

from harness.core.catalog import Catalog
from harness.core.errors import ConfigError, did_you_mean
from harness.core.manager import HarnessPluginManager
from harness.core.options import (
    CONFIG_ENV,
    CORE_KEYS,
    NAMES_CODES,
    ONLY_ENV,
    PLUGINS_ENV,
    REFERENCE_HINT,
    REPORT_PLOTS_ENV,
    CoreOptions,
    ResolvedConfig,
)
from harness.core.registry import entry_for
from harness.core.safe_yaml import MAX_YAML_BYTES, load_yaml, short_repr

__all__ = [
    "CONFIG_ENV", "CORE_KEYS", "NAMES_CODES", "ONLY_ENV", "PLUGINS_ENV", "REFERENCE_HINT", "REPORT_PLOTS_ENV", "Catalog",
    "Selection", "effective_selection",
    "CoreOptions", "ResolvedConfig", "config_reference", "load_config", "names_codes", "read_yaml", "resolve_config",
]


CONFIG_READ_S = 30.0  # a config given through a pipe (``--config <(envsubst < t.yaml)``) must be written within this


def read_config_text(path: str | os.PathLike[str]) -> str:
    """The text of a config file as given: a regular file, or a pipe (read once, to its end); at most
    ``MAX_YAML_BYTES``. Anything else (a device such as /dev/zero, a socket, a folder) is a ConfigError naming it."""
    shown = str(path)

    def unreadable(exc: OSError) -> ConfigError:
        return ConfigError([f"harness config file '{shown}' cannot be read ({exc.strerror or exc}). Fix: pass a YAML file you can read."])

    folder = ConfigError([f"harness config file '{shown}' is a folder. Fix: pass the YAML file itself with --config (or HARNESS_CONFIG)."])
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0))
    except FileNotFoundError:
        raise ConfigError([f"harness config file '{shown}' does not exist. Fix: pass an existing YAML file with --config (or HARNESS_CONFIG)."]) from None
    except IsADirectoryError:
        raise folder from None
    except OSError as exc:
        raise unreadable(exc) from None
    try:
        mode = os.fstat(fd).st_mode
        if stat.S_ISDIR(mode):
            raise folder
        if not (stat.S_ISREG(mode) or stat.S_ISFIFO(mode)):
            raise ConfigError([f"harness config file '{shown}' is not a regular file or a pipe (a device or a socket). "
                               "Fix: pass a YAML file, or a pipe that carries one (--config <(envsubst < t.yaml))."])
        data = _read_capped(fd, stat.S_ISFIFO(mode), shown)
    except OSError as exc:
        raise unreadable(exc) from None
    finally:
        os.close(fd)
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as exc:
        line = data[: exc.start].count(b"\n") + 1
        raise ConfigError([f"harness config file '{shown}' is not UTF-8 text (byte {data[exc.start]:#04x} on line {line}). "
                           "Fix: save it as UTF-8 YAML."]) from None


def _read_capped(fd: int, pipe: bool, shown: str) -> bytes:
    """All of ``fd`` up to ``MAX_YAML_BYTES`` (a pipe: until its writer closes it, waiting ``CONFIG_READ_S`` at most)."""
    chunks: list[bytes] = []
    size = 0
    deadline = time.monotonic() + CONFIG_READ_S
    while True:
        if pipe:
            left = deadline - time.monotonic()
            if left <= 0 or not select.select([fd], [], [], left)[0]:
                raise ConfigError([f"harness config file '{shown}' is a pipe that sent no end of file within {CONFIG_READ_S:.0f} s. "
                                   "Fix: close the pipe's writing end after the YAML, or pass a file."])
        try:
            chunk = os.read(fd, 1 << 16)
        except BlockingIOError:
            continue
        if not chunk:
            return b"".join(chunks)
        chunks.append(chunk)
        size += len(chunk)
        if size > MAX_YAML_BYTES:
            raise ConfigError([f"harness config file '{shown}' holds more than {MAX_YAML_BYTES >> 20} MB. "
                               "Fix: pass the harness config (a few KB of YAML), not another file."])


def read_yaml(path: Path, text: str | None = None) -> dict[str, Any]:
    """Read a YAML mapping (from ``path``, or ``text`` read from it already), with errors that name the file and line."""
    path = Path(path)
    if text is None:
        text = read_config_text(path)
    try:
        data = load_yaml(text)
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
        if isinstance(part, int):  # an entry of a list of models (`eval_sets: [{path: ...}]`): its item type
            args = [a for a in typing.get_args(current) if isinstance(a, type) and issubclass(a, BaseModel)]
            if not args:
                return None
            current = args[0]
            continue
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
        by_path = {_path_plugin(target)[0]: target for target in REFERENCE_PATH_PLUGINS} if len(loc) == 1 else {}
        if loc[0] in by_path:  # the section of a shipped plugin that is enabled by its path only
            return (
                f"harness config error in {source}, key '{key}': the section of the plugin '{loc[0]}', which is not "
                f"enabled. Fix: enable it by its path, `plugins: [defaults, \"{by_path[loc[0]]}\"]` (or remove the section)."
            )
        return (
            f"harness config error in {source}, key '{key}' ({owner}): unknown {kind}."
            f"{did_you_mean(loc[-1], allowed)} Valid keys here: {', '.join(allowed)}. "
            f"Fix: rename or remove the key ({REFERENCE_HINT})."
        )
    value = error.get("input")
    if error.get("type") in ("literal_error", "enum"):  # a choice (an action, a mode): list the valid ones
        valid = re.findall(r"'([^']*)'", str((error.get("ctx") or {}).get("expected", "")))
        return (
            f"harness config error in {source}, key '{key}' ({owner}): {short_repr(value)} is not a valid value."
            f"{did_you_mean(str(value), valid)} Valid values: {', '.join(valid)}. Fix: use one of them ({REFERENCE_HINT})."
        )
    return (
        f"harness config error in {source}, key '{key}' ({owner}): {error.get('msg')}; got {short_repr(value)}. "
        f"Fix: give a value of the right type ({REFERENCE_HINT})."
    )


def resolve_config(
    data: dict[str, Any] | None,
    catalog: Catalog,
    source: str = "<inline config>",
    extra_plugins: list[str] | None = None,
    only: list[str] | None = None,
) -> ResolvedConfig:
    """Validate ``data`` against the core options and every plugin's options.

    The plugins that run: ``only`` (the command line's ``--only``) if given, else the file's ``only:``, else its
    ``plugins:`` (default ``[defaults]``) followed by ``extra_plugins`` (``--plugins``, ``attach(plugins=...)``);
    ``defaults`` stands for the plugins on by default wherever a list names it; ``disable:`` is taken out last.
    """
    listed = [spec for key in ("plugins", "only") for spec in _list_at(data, key)]
    for spec in [*listed, *(extra_plugins or []), *(only or [])]:
        if isinstance(spec, str) and ":" in spec:
            catalog.add(spec)  # its options must be known before the file is validated
    model_cls = catalog.config_model()
    try:
        model = model_cls.model_validate(data or {})
    except ValidationError as exc:
        raise ConfigError([_explain(e, source, model_cls, catalog) for e in exc.errors()]) from None
    problems = _selection_conflicts(model, source, extra_plugins, only)
    if only is not None:
        requested, key = list(only), "--only"
    elif model.only is not None:
        requested, key = [*model.only, *(extra_plugins or [])], "only"
    else:
        requested, key = [*(model.plugins if model.plugins is not None else ["defaults"]), *(extra_plugins or [])], "plugins"
    requested = [name for spec in requested for name in (catalog.default_enabled if spec == "defaults" else [spec])]
    enabled: list[str] = []
    paths: dict[str, str] = {}  # name -> the 'module:Class' path it was enabled by (written back so, in config.yaml)
    for spec in requested:
        if spec in catalog.broken:
            problems.append(f"harness config error in {source}, key '{key}': {catalog.broken[spec]}. Fix: reinstall or fix that package, or remove it from '{key}'.")
            continue
        try:
            name = catalog.add(spec)
        except KeyError:
            problems.append(
                f"harness config error in {source}, key '{key}': unknown plugin '{spec}'."
                f"{did_you_mean(spec, catalog.entries)} Available plugins: {', '.join(catalog.entries) or '(none)'}. "
                "Fix: use a name from `harness plugins`, or a 'module:Class' path."
            )
            continue
        if name not in enabled:
            enabled.append(name)
            if isinstance(spec, str) and ":" in spec and spec != name:
                paths[name] = spec
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
    unused = [key for key in (data or {}) if key in catalog.entries and key not in enabled]
    notes = [f"{source}: the '{key}' section is set but the plugin '{key}' is not enabled, so its options take no effect "
             f"(enable it with `plugins: [defaults, {key}]` or --plugins {key}"
             + (", and take it out of 'disable'" if key in model.disable else "") + ")" for key in unused]
    return ResolvedConfig(model=model, source=source, enabled=enabled, paths=paths, notes=notes)


def _list_at(data: dict[str, Any] | None, key: str) -> list[Any]:
    """``data[key]`` when it is a list (validation reports anything else), else ``[]``."""
    value = data.get(key) if isinstance(data, dict) else None
    return value if isinstance(value, list) else []


def _selection_conflicts(model: CoreOptions, source: str, extra: list[str] | None, only: list[str] | None) -> list[str]:
    """Two ways of choosing the plugins given at once: say which to keep rather than guess."""
    problems = []
    if model.only is not None and model.plugins is not None:
        problems.append(f"harness config error in {source}, keys 'only' and 'plugins': both choose the plugins. "
                        "Fix: keep 'only' for exactly those plugins, or 'plugins' (with 'defaults' in it for the defaults too).")
    if only is not None and extra:
        problems.append(f"--only ({','.join(only)}) and --plugins ({','.join(extra)}) given together. "
                        "Fix: list every plugin you want in --only, or use --plugins to add to the config's.")
    if only is not None and not only:
        problems.append("--only names no plugin. Fix: give at least one name (`harness plugins` lists them), "
                        "or 'disable' plugins in the config to run none of them.")
    return problems


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
    only: list[str] | None = None,
    source: str | None = None,
) -> ResolvedConfig:
    """Load from a path, a dict, or (None) the ``HARNESS_CONFIG``/``HARNESS_PLUGINS``/``HARNESS_ONLY`` environment.

    ``source``: the name errors give the file (``harness wrap`` reads a pipe once, then validates a private copy).
    """
    extra = list(extra_plugins or [])
    if config is None:
        extra += _names(os.environ.get(PLUGINS_ENV, ""))
        if only is None and os.environ.get(ONLY_ENV) is not None:
            only = _names(os.environ[ONLY_ENV])
        config = os.environ.get(CONFIG_ENV) or None
    if config is None:
        return resolve_config({}, catalog, "<defaults>", extra, only)
    if isinstance(config, dict):
        return resolve_config(config, catalog, "<inline config>", extra, only)
    path = Path(os.path.abspath(config))  # not resolved: /dev/fd/63 (a shell's <(...)) is a link to no path
    shown = Path(source) if source else path
    return resolve_config(read_yaml(shown, read_config_text(path)), catalog, str(shown), extra, only)


@dataclass
class Selection:
    """The config file and plugin lists a run gets from the command line and the environment, with what was set aside."""

    config: str | None
    plugins: list[str]
    only: list[str] | None
    from_env: list[str]  # the environment variables the selection came from (for messages)
    notes: list[str]  # inherited variables that the command line replaced


def effective_selection(config: str | None, plugins: Sequence[str] = (), only: Sequence[str] | None = None,
                        env: Mapping[str, str] | None = None) -> Selection:
    """What a run started from here would use: ``--config``/``--plugins``/``--only``, else the inherited
    ``HARNESS_CONFIG``/``HARNESS_PLUGINS``/``HARNESS_ONLY``. Plugin flags replace both inherited plugin variables
    (``--only a`` with ``HARNESS_PLUGINS=b`` inherited is exactly ``a``); each variable set aside is a note."""
    env = os.environ if env is None else env
    inherited_plugins = _names(env.get(PLUGINS_ENV, ""))
    inherited_only = _names(env[ONLY_ENV]) if env.get(ONLY_ENV) is not None else None
    inherited_config = env.get(CONFIG_ENV) or None
    notes: list[str] = []
    from_env: list[str] = []
    if plugins or only is not None:
        chosen_plugins, chosen_only = list(plugins), list(only) if only is not None else None
        for name, value in ((PLUGINS_ENV, env.get(PLUGINS_ENV)), (ONLY_ENV, env.get(ONLY_ENV))):
            if value is not None and value.strip():
                notes.append(f"{name}={value} from the environment is not used: the command line names the plugins")
    else:
        chosen_plugins, chosen_only = inherited_plugins, inherited_only
        from_env += [name for name, value in ((PLUGINS_ENV, inherited_plugins), (ONLY_ENV, inherited_only)) if value is not None and value != []]
    if config:
        if inherited_config and Path(inherited_config).resolve() != Path(config).resolve():
            notes.append(f"{CONFIG_ENV}={inherited_config} from the environment is not used: --config {config} is")
    elif inherited_config:
        config = inherited_config
        from_env.append(CONFIG_ENV)
    return Selection(config, chosen_plugins, chosen_only, from_env, notes)


def _names(text: str) -> list[str]:
    """``a, b,,c`` -> ``['a', 'b', 'c']`` (a comma-separated list of plugin names from the command line or env)."""
    return [p.strip() for p in text.split(",") if p.strip()]


# Plugins shipped in the package that a config enables by their 'module:Class' path only (never by name, never by
# default): test support. They are not in the catalog, so the reference lists them from here, under that path.
REFERENCE_PATH_PLUGINS = ("harness.testing:FaultInjector",)


def config_reference(catalog: Catalog) -> str:
    """Every option with type, default and description, as markdown."""
    lines = ["# harness config reference", "", "## core options (top level)", ""]
    lines += _model_reference(CoreOptions, prefix="")
    for name, model in catalog.option_models.items():
        entry = catalog.entries[name]
        lines += ["", f"## {name} ({entry.source}{', on by default' if entry.default_enabled else ''})", "", entry.description, ""]
        lines += _model_reference(model, prefix=f"{name}.") if model is not None else ["(no options)"]
    for target in REFERENCE_PATH_PLUGINS:
        name, description, model = _path_plugin(target)
        if name in catalog.option_models:
            continue  # already listed above (a catalog that was given the path)
        lines += ["", f"## {name} (shipped, off; enable it by path: `plugins: [defaults, \"{target}\"]`)", "", description, ""]
        lines += _model_reference(model, prefix=f"{name}.") if model is not None else ["(no options)"]
    return "\n".join(lines) + "\n"


def _path_plugin(target: str) -> tuple[str, str, type[BaseModel] | None]:
    """Name, description and option model of a plugin given by path, read as the catalog would (the catalog left alone)."""
    entry = entry_for(target, {})
    manager = HarnessPluginManager()
    manager.register(entry)
    return entry.name, entry.description, manager.option_model(entry.name)


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
