"""Meta-tests that keep hooks, docs, plugins and tests in step.

The README checks PARSE the README (its option tables, its plugin and command
tables, its hook list) and compare what they find exactly with the code, so a
name mentioned somewhere in prose ("every" for ``packing_check.every``) never
counts as documentation. Each check is a function from README text to a list
of problems; the synthetic READMEs at the bottom show that each one fails.
"""
from __future__ import annotations

import functools
import inspect
import os
import re
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import pytest
import yaml

from conftest import FAULTS, REPO
from harness.cli import build_parser
from harness.core import hookspecs
from harness.core.config import REFERENCE_PATH_PLUGINS, Catalog, CoreOptions, config_reference, load_config
from harness.core.hooks import Hooks
from harness.core.manager import HOOK_NAMES
from harness.testing.faults import FaultOptions

README = (REPO / "README.md").read_text(encoding="utf-8")
DECLARATION_HOOKS = {"add_config", "declare_codes"}  # the manager calls these itself, at registration
ENV_DEFAULTS = ("HARNESS_REPORT_PLOTS",)  # options whose default the environment changes; the README gives the plain one


# -- the README parser ----------------------------------------------------------------------


@dataclass
class Table:
    heading: str  # the nearest heading above the table
    header: list[str]
    rows: list[list[str]]


CELL_SPLIT = re.compile(r"(?<!\\)\|")  # a cell may hold an escaped pipe: `[CODE\|TOPIC]`


def _cell(text: str) -> str:
    text = text.strip()
    return text[1:-1] if len(text) > 1 and text[0] == text[-1] == "`" else text


def tables(text: str) -> list[Table]:
    """Every markdown table outside code fences, with the heading it sits under."""
    found: list[Table] = []
    heading, fenced, block = "", False, []
    for line in [*text.splitlines(), ""]:
        if line.startswith("```"):
            fenced = not fenced
        if not fenced and line.startswith("#"):
            heading = line.lstrip("#").strip()
        if not fenced and line.startswith("|"):
            block.append([c.strip().replace("\\|", "|") for c in CELL_SPLIT.split(line.strip().strip("|"))])
            continue
        if len(block) >= 2 and set("".join(block[1])) <= set("-: "):
            found.append(Table(heading, [_cell(c) for c in block[0]], [[_cell(c) for c in r] for r in block[2:]]))
        block = []
    return found


def table(text: str, heading: str, first_column: str) -> Table | None:
    matches = [t for t in tables(text) if t.heading == heading and t.header and t.header[0] == first_column]
    return matches[0] if len(matches) == 1 else None


def _compare(what: str, documented: list[tuple[str, str]], actual: dict[str, str]) -> list[str]:
    """Problems between (key, value) rows of a table and the code's {key: value}."""
    problems, seen = [], set()
    for key, value in documented:
        if key in seen:
            problems.append(f"{what} `{key}` is listed twice")
        seen.add(key)
        if key not in actual:
            problems.append(f"{what} `{key}` is in the README but not in the code")
        elif value != actual[key]:
            problems.append(f"{what} `{key}`: README says `{value}`, the code says `{actual[key]}`")
    problems += [f"{what} `{key}` is missing from the README's table" for key in actual if key not in seen]
    return problems


def render_default(value: Any) -> str:
    """A default as the README's tables write it: YAML flow style (``null``, ``true``, ``[a, b]``)."""
    text = yaml.safe_dump(value, default_flow_style=True, sort_keys=False, width=10**6).strip()
    return text[: -len("\n...")] if text.endswith("\n...") else text


@contextmanager
def _plain_environment() -> Iterator[None]:
    saved = {key: os.environ.pop(key) for key in ENV_DEFAULTS if key in os.environ}
    try:
        yield
    finally:
        os.environ.update(saved)


def defaults(model: Any) -> dict[str, str]:
    with _plain_environment():
        return {key: render_default(value) for key, value in model().model_dump(mode="json").items()}


@functools.cache
def catalog() -> Catalog:
    return Catalog.build(autoload=False)


def builtin_names() -> list[str]:
    from harness.plugins import BUILTIN_PLUGINS

    return list(BUILTIN_PLUGINS)


def actual_plugin_options() -> dict[str, str]:
    found: dict[str, str] = {}
    for name in builtin_names():
        model = catalog().option_models[name]
        found.update({f"{name}.{key}": value for key, value in (defaults(model) if model else {}).items()})
    return found


def check_core_options(text: str) -> list[str]:
    found = table(text, "Config", "option")
    if found is None:
        return ["no single `| option | default | meaning |` table under the heading `Config`"]
    return _compare("core option", [(r[0], r[1]) for r in found.rows], defaults(CoreOptions))


def check_plugin_options(text: str) -> list[str]:
    found = table(text, "Plugin options", "option")
    if found is None:
        return ["no single `| option | default |` table under the heading `Plugin options`"]
    return _compare("plugin option", [(r[0], r[1]) for r in found.rows], actual_plugin_options())


FAULT_PLUGIN = FAULTS  # harness.testing:FaultInjector, enabled by path
FAULT_HEADING = "Fault injection"


def check_fault_options(text: str) -> list[str]:
    """The `Fault injection` table: every FaultInjector option, its default, an example the plugin accepts, a meaning."""
    found = table(text, FAULT_HEADING, "option")
    if found is None:
        return [f"no single `| option | default | example | meaning |` table under the heading `{FAULT_HEADING}`"]
    if found.header != ["option", "default", "example", "meaning"]:
        return [f"the `{FAULT_HEADING}` table's columns are {found.header}, not option, default, example, meaning"]
    problems = _compare("fault_injector option", [(r[0], r[1]) for r in found.rows], defaults(FaultOptions))
    for row in found.rows:
        key, example, meaning = row[0], row[2] if len(row) > 2 else "", row[3] if len(row) > 3 else ""
        if not meaning:
            problems.append(f"fault_injector option `{key}` has no meaning in the README's table")
        if key not in FaultOptions.model_fields:
            continue
        try:
            FaultOptions.model_validate({key: yaml.safe_load(example)})
        except (yaml.YAMLError, ValueError) as exc:
            problems.append(f"fault_injector option `{key}`: the README's example `{example}` is not valid: {str(exc).splitlines()[0]}")
    return problems


FENCE = re.compile(r"^```yaml\n(.*?)^```", re.S | re.M)


def section(text: str, heading: str) -> str:
    """The text under the heading ``heading`` up to the next heading of its level or above (code fences skipped)."""
    body: list[str] | None = None
    level, fenced = 0, False
    for line in text.split("\n"):
        if line.startswith("```"):
            fenced = not fenced
        match = None if fenced else re.match(r"(#+) (.*)$", line)
        if body is None:
            if match and match.group(2).strip() == heading:
                body, level = [], len(match.group(1))
            continue
        if match and len(match.group(1)) <= level:
            break
        body.append(line)
    return "\n".join(body or [])


def check_fault_example(text: str) -> list[str]:
    """The `Fault injection` section's YAML example enables FaultInjector and loads as a config."""
    blocks = FENCE.findall(section(text, FAULT_HEADING))
    if not blocks:
        return [f"no ```yaml example under the heading `{FAULT_HEADING}`"]
    problems = []
    for block in blocks:
        try:
            data = yaml.safe_load(block)
            resolved = load_config(data, Catalog.build(autoload=False))  # a fresh catalog: loading adds the plugin to it
        except Exception as exc:  # noqa: BLE001 - any failure to load is the problem to report
            problems.append(f"the `{FAULT_HEADING}` example does not load as a config: {exc}")
            continue
        if "fault_injector" not in resolved.enabled:
            problems.append(f"the `{FAULT_HEADING}` example does not enable {FAULT_PLUGIN}")
    return problems


def check_config_example(text: str) -> list[str]:
    """Every ```yaml example under `Config` loads as a config (a user copies it first)."""
    blocks = FENCE.findall(section(text, "Config"))
    if not blocks:
        return ["no ```yaml example under the heading `Config`"]
    problems = []
    for block in blocks:
        try:
            load_config(yaml.safe_load(block), Catalog.build(autoload=False))
        except Exception as exc:  # noqa: BLE001 - any failure to load is the problem to report
            problems.append(f"the `Config` example does not load as a config: {exc}")
    return problems


def check_plugin_table(text: str) -> list[str]:
    found = table(text, "Plugins", "plugin")
    if found is None:
        return ["no single `| plugin | default | what it does |` table under the heading `Plugins`"]
    actual = {n: "on" if catalog().entries[n].default_enabled else "off" for n in builtin_names()}
    return _compare("plugin", [(r[0], r[1].split(" ", 1)[0]) for r in found.rows], actual)


def check_commands(text: str) -> list[str]:
    found = table(text, "Commands", "command")
    if found is None:
        return ["no single `| command | what it does |` table under the heading `Commands`"]
    sub = next(a for a in build_parser()._actions if a.dest == "cmd")
    documented = {(m.group(1), "") for r in found.rows if (m := re.match(r"harness ([\w-]+)", r[0]))}
    return _compare("command", sorted(documented), {c: "" for c in sub.choices})  # type: ignore[union-attr]


HOOK_LIST = re.compile(r"^Hooks \(.*?\):\s*(.*)$", re.S)
NAMES = re.compile(r"`(\w+)`(?:,\s*`(\w+)`)*\.")


def hook_list(text: str) -> list[str] | None:
    """The names of the paragraph ``Hooks (...): `a`, `b`, ...`z`.``; None without one such plain list."""
    paragraphs = [p for p in re.split(r"\n\s*\n", text) if HOOK_LIST.match(p.strip())]
    if len(paragraphs) != 1:
        return None
    names = HOOK_LIST.match(paragraphs[0].strip()).group(1).strip()  # type: ignore[union-attr]
    if not NAMES.fullmatch(names):
        return None
    return re.findall(r"`(\w+)`", names)


def check_hooks(text: str) -> list[str]:
    names = hook_list(text)
    if names is None:
        return ["no single paragraph `Hooks (...): `a`, `b`, ....` listing the hooks"]
    return _compare("hook", [(n, "") for n in names], {n: "" for n in HOOK_NAMES})


# -- the README against the code ------------------------------------------------------------

CHECKS: dict[str, Callable[[str], list[str]]] = {
    "core options": check_core_options,
    "plugin options": check_plugin_options,
    "plugin table": check_plugin_table,
    "commands": check_commands,
    "hooks": check_hooks,
    "fault options": check_fault_options,
    "fault example": check_fault_example,
    "config example": check_config_example,
}


@pytest.mark.parametrize("name", CHECKS)
def test_readme_matches_the_code(name: str) -> None:
    assert CHECKS[name](README) == []


def test_every_option_has_a_description() -> None:
    models = {"core": CoreOptions, "fault_injector": FaultOptions, **{n: catalog().option_models[n] for n in builtin_names()}}
    for owner, model in models.items():
        for key, field in (model.model_fields.items() if model else []):
            assert field.description, f"{owner}.{key} has no description"


def reference_problems(reference: str) -> list[str]:
    """Every FaultInjector option must have its line in `harness plugins --config-reference`: name, type, default, description."""
    lines = {m.group(1): m.group(0) for m in re.finditer(r"^- `fault_injector\.(\w+)` \(.*$", reference, re.M)}
    problems = [] if "## fault_injector " in reference else ["no `## fault_injector` section in the config reference"]
    for key, field in FaultOptions.model_fields.items():
        line = lines.get(key)
        if line is None:
            problems.append(f"fault_injector option `{key}` is missing from the config reference")
            continue
        default = field.get_default(call_default_factory=True)
        if f"default `{default!r}`" not in line or not line.endswith(f": {field.description}"):
            problems.append(f"fault_injector option `{key}`: the config reference says {line!r}")
    return problems + [f"fault_injector option `{k}` is in the config reference but not in the code" for k in lines if k not in FaultOptions.model_fields]


def test_the_config_reference_lists_every_fault_option() -> None:
    assert FAULT_PLUGIN in REFERENCE_PATH_PLUGINS
    assert reference_problems(config_reference(catalog())) == []


def test_the_config_reference_check_can_fail() -> None:
    reference = config_reference(catalog())
    dropped = "\n".join(line for line in reference.splitlines() if not line.startswith("- `fault_injector.corrupt_rows`"))
    assert "fault_injector option `corrupt_rows` is missing from the config reference" in reference_problems(dropped)
    line = "- `fault_injector.grad_scale` (float, default `1.5`)"
    assert line in reference
    changed = reference.replace(line, line.replace("1.5", "2.5"))
    assert any("`grad_scale`: the config reference says" in p for p in reference_problems(changed))
    assert reference_problems(reference.replace("## fault_injector ", "## faults ")) == ["no `## fault_injector` section in the config reference"]


PATH_IN_BACKTICKS = re.compile(r"`((?:harness|plugins|stages|tests|benchmarks|examples|scripts|playbooks)/[\w./-]+\.(?:py|md|yaml|txt))`")


def test_every_repository_path_in_readme_exists() -> None:
    missing = sorted({p for p in PATH_IN_BACKTICKS.findall(README) if not (REPO / p).exists()})
    assert missing == [], f"README names files that do not exist: {missing}"


# -- hooks against the code -----------------------------------------------------------------

SOURCES = {p: p.read_text(encoding="utf-8") for d in ("harness", "plugins", "stages") for p in (REPO / d).rglob("*.py")}
TEST_SOURCES = "".join(p.read_text(encoding="utf-8") for p in (REPO / "tests").rglob("test_*.py") if p.name != "test_docs.py")
FACADE = {REPO / "harness" / "core" / "hooks.py", REPO / "harness" / "core" / "manager.py"}


@pytest.mark.parametrize("hook", HOOK_NAMES)
def test_every_hook_says_when_it_fires(hook: str) -> None:
    doc = inspect.getdoc(getattr(hookspecs, hook)) or ""
    assert "Fires:" in doc, f"hookspec {hook} must say when it fires"


@pytest.mark.parametrize("hook", HOOK_NAMES)
def test_every_hook_has_a_test(hook: str) -> None:
    assert f"def {hook}(" in TEST_SOURCES, f"no test implements hook {hook}: add a test plugin that uses it and asserts what it gets"


@pytest.mark.parametrize("hook", sorted(set(HOOK_NAMES) - DECLARATION_HOOKS))
def test_every_hook_is_called_through_the_typed_facade(hook: str) -> None:
    assert callable(getattr(Hooks, hook, None)), f"harness.core.hooks.Hooks has no method {hook}"
    callers = [p for p, s in SOURCES.items() if p not in FACADE and re.search(rf"\bhooks\.{hook}\(", s)]
    assert callers, f"nothing calls hooks.{hook}(...)"


def test_no_hook_is_called_by_a_string_name() -> None:
    pattern = re.compile(rf"\.call\w*\(\s*(?:\w+\s*,\s*)?[\"']({'|'.join(HOOK_NAMES)})[\"']")
    named = [f"{p.relative_to(REPO)}: {m.group(1)}" for p, s in SOURCES.items() if p not in FACADE for m in pattern.finditer(s)]
    assert named == [], f"call these hooks through manager.hooks.<hook>(...): {named}"


def test_every_builtin_plugin_has_its_test_module() -> None:
    for name in builtin_names():
        assert (REPO / "tests" / "plugins" / f"test_{name}.py").exists(), f"tests/plugins/test_{name}.py missing"


# -- each check can fail: synthetic READMEs -------------------------------------------------


def synthetic_readme() -> str:
    """A minimal README, written from the code, that every check accepts."""
    core = "\n".join(f"| `{k}` | `{v}` | meaning |" for k, v in defaults(CoreOptions).items())
    options = "\n".join(f"| `{k}` | `{v}` |" for k, v in actual_plugin_options().items())
    plugins = "\n".join(f"| `{n}` | {'on' if catalog().entries[n].default_enabled else 'off (opt in)'} | does |" for n in builtin_names())
    sub = next(a for a in build_parser()._actions if a.dest == "cmd")
    commands = "\n".join(f"| `harness {c} [ARGS]` | does |" for c in sub.choices)  # type: ignore[union-attr]
    hooks = ", ".join(f"`{h}`" for h in HOOK_NAMES)
    faults = "\n".join(f"| `{k}` | `{v}` | `{v}` | meaning |" for k, v in defaults(FaultOptions).items())
    return (
        f"# t\n\n## Commands\n\n| command | what it does |\n|---|---|\n{commands}\n\n"
        f"## Config\n\n```yaml\nplugins: [defaults]\nconsole: {{level: off}}\nnan_guard: {{max_consecutive: 5}}\n```\n\n"
        f"| option | default | meaning |\n|---|---|---|\n{core}\n\n"
        f"## Plugins\n\n| plugin | default | what it does |\n|---|---|---|\n{plugins}\n\n"
        f"**`packing_check`.** the experiment runs every 500 steps; see `on_loss` in prose.\n\n"
        f"### Plugin options\n\n| option | default |\n|---|---|\n{options}\n\n"
        f"## Writing a plugin\n\nHooks (documented in `harness/core/hookspecs.py`: when each fires):\n{hooks}.\n\n"
        f"## {FAULT_HEADING}\n\n```yaml\nplugins: [\"{FAULT_PLUGIN}\"]\nfault_injector: {{nonfinite_loss_at_steps: [3]}}\n```\n\n"
        f"| option | default | example | meaning |\n|---|---|---|---|\n{faults}\n\n## After\n"
    )


def _drop_line(start: str) -> Callable[[str], str]:
    return lambda text: "\n".join(line for line in text.split("\n") if not line.startswith(start))


def _replace(old: str, new: str) -> Callable[[str], str]:
    def apply(text: str) -> str:
        assert old in text, old
        return text.replace(old, new, 1)

    return apply


MUTATIONS = [
    ("core options", _drop_line("| `report` |"), "core option `report` is missing"),
    ("core options", _replace("| `recent_batches` |", "| `bogus` | `1` | x |\n| `recent_batches` |"), "core option `bogus` is in the README but not"),
    ("core options", _replace("| `max_plugin_errors` | `10` |", "| `max_plugin_errors` | `11` |"), "says `11`, the code says `10`"),
    ("core options", _replace("| `report` |", "| `report` | `true` | x |\n| `report` |"), "core option `report` is listed twice"),
    ("core options", _replace("## Config", "## Configuration"), "no single"),
    ("plugin options", _drop_line("| `packing_check.every` |"), "plugin option `packing_check.every` is missing"),
    ("plugin options", _replace("| `nan_guard.action` |", "| `nan_guard.bogus` | `1` |\n| `nan_guard.action` |"), "`nan_guard.bogus` is in the README but not"),
    ("plugin options", _replace("| `nan_guard.max_consecutive` | `3` |", "| `nan_guard.max_consecutive` | `4` |"), "says `4`, the code says `3`"),
    ("plugin table", _drop_line("| `data_hash` |"), "plugin `data_hash` is missing"),
    ("plugin table", _replace("| `mlflow` | off", "| `mlflow` | on"), "plugin `mlflow`: README says `on`"),
    ("plugin table", _replace("| `metrics_log` |", "| `ghost` | on | x |\n| `metrics_log` |"), "plugin `ghost` is in the README but not"),
    ("commands", _drop_line("| `harness scan"), "command `scan` is missing"),
    ("commands", _replace("| `harness scan", "| `harness frobnicate` | x |\n| `harness scan"), "command `frobnicate` is in the README but not"),
    ("hooks", _replace("`on_loss`, ", ""), "hook `on_loss` is missing"),  # on_loss stays in prose: that does not count
    ("hooks", _replace("`decide_action`.", "`decide_action`, `on_nothing`."), "hook `on_nothing` is in the README but not"),
    ("hooks", _replace("`on_log`, ", "`on_log` (after logging), "), "no single paragraph"),
    ("fault options", _drop_line("| `nan_batch_on_rank` |"), "fault_injector option `nan_batch_on_rank` is missing"),
    ("fault options", _replace("| `corrupt_rows` |", "| `corrupt_cols` | `null` | `1` | x |\n| `corrupt_rows` |"), "`corrupt_cols` is in the README but not"),
    ("fault options", _replace("| `grad_scale` | `1.5` |", "| `grad_scale` | `2.0` |"), "says `2.0`, the code says `1.5`"),
    ("fault options", _replace("| `lr_scale` | `100.0` | `100.0` |", "| `lr_scale` | `100.0` | `-1` |"), "`lr_scale`: the README's example `-1` is not valid"),
    ("fault options", _replace("| `snapshot_steps` | `[]` | `[]` | meaning |", "| `snapshot_steps` | `[]` | `[]` |  |"), "`snapshot_steps` has no meaning"),
    ("fault options", _replace("| option | default | example | meaning |", "| option | default | meaning | example |"), "columns are"),
    ("fault example", _replace("nonfinite_loss_at_steps: [3]", "nonfinite_loss_at_step: 3"), "does not load as a config"),
    ("fault example", _replace("fault_injector: {", "disable: [fault_injector]\nfault_injector: {"), "does not enable"),
    ("fault example", _replace(f'plugins: ["{FAULT_PLUGIN}"]\n', ""), "does not load as a config"),
    ("fault example", _replace("```yaml\nplugins: [\"", "```text\nplugins: [\""), "no ```yaml example"),
    ("config example", _replace("nan_guard: {max_consecutive: 5}", "fault_injector: {report_at_step: 4}"), "does not load as a config"),
    ("config example", _replace("```yaml\nplugins: [defaults]", "```text\nplugins: [defaults]"), "no ```yaml example under the heading `Config`"),
]


def test_the_synthetic_readme_passes_every_check() -> None:
    text = synthetic_readme()
    assert {name: check(text) for name, check in CHECKS.items()} == {name: [] for name in CHECKS}


@pytest.mark.parametrize(("check", "mutate", "expected"), MUTATIONS, ids=[f"{c}-{e[:30]}" for c, _, e in MUTATIONS])
def test_each_check_reports_what_is_wrong(check: str, mutate: Callable[[str], str], expected: str) -> None:
    problems = CHECKS[check](mutate(synthetic_readme()))
    assert any(expected in p for p in problems), problems
