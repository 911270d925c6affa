"""Meta-tests that keep hooks, docs, playbooks, plugins and tests in step."""
from __future__ import annotations

import inspect
import re

import pytest

from conftest import FAULTS, REPO
from harness import hookspecs
from harness.cli import build_parser
from harness.config import Catalog, CoreOptions
from harness.manager import HOOK_NAMES

README = (REPO / "README.md").read_text(encoding="utf-8")
CORE_SOURCES = "".join((REPO / "harness" / name).read_text(encoding="utf-8") for name in ("bridge.py", "context.py", "config.py", "manager.py"))
DECLARATION_HOOKS = {"add_config", "declare_codes"}


@pytest.mark.parametrize("hook", HOOK_NAMES)
def test_every_hook_is_documented_with_when_it_fires(hook: str) -> None:
    doc = inspect.getdoc(getattr(hookspecs, hook)) or ""
    assert "Fires:" in doc, f"hookspec {hook} must say when it fires"
    assert f"`{hook}`" in README or hook in README, f"README does not mention hook {hook}"


@pytest.mark.parametrize("hook", HOOK_NAMES)
def test_every_hook_has_a_caller(hook: str) -> None:
    assert f'"{hook}"' in CORE_SOURCES, f"no part of the core calls hook {hook}"


def test_every_core_option_is_in_readme_and_described() -> None:
    for name, field in CoreOptions.model_fields.items():
        assert f"`{name}`" in README, f"README does not document core option {name}"
        assert field.description, f"core option {name} has no description"


def test_every_cli_command_is_in_readme() -> None:
    sub = next(a for a in build_parser()._actions if a.dest == "cmd")
    for command in sub.choices:  # type: ignore[union-attr]
        assert f"harness {command}" in README


def test_every_finding_code_has_a_playbook_section() -> None:
    catalog = Catalog.build(extra=[FAULTS])
    for code in catalog.codes.values():
        family, _, anchor = code.playbook.partition("#")
        path = REPO / "playbooks" / f"{family}.md"
        assert path.exists(), f"{code.code}: playbook file {path.name} missing"
        headings = re.findall(r"^## (\S+)", path.read_text(encoding="utf-8"), flags=re.M)
        assert code.code in headings and anchor == code.code.lower(), f"{code.code}: no section in {path.name}"


def test_every_builtin_plugin_has_its_test_module_and_documented_options() -> None:
    from harness.plugins import BUILTIN_PLUGINS

    catalog = Catalog.build(autoload=False)
    for name in BUILTIN_PLUGINS:
        assert (REPO / "tests" / "plugins" / f"test_{name}.py").exists(), f"tests/plugins/test_{name}.py missing"
        model = catalog.option_models[name]
        for key, field in (model.model_fields.items() if model else []):
            assert field.description, f"{name}.{key} has no description"
            assert re.search(rf"\b{key}\b", README), f"option {name}.{key} is not in README.md"
