"""Meta-tests that keep hooks, docs, playbooks, plugins and tests in step."""
from __future__ import annotations

import inspect
import re

import pytest

from conftest import REPO
from harness import hookspecs
from harness.cli import build_parser
from harness.config import Catalog, CoreOptions
from harness.manager import HOOK_NAMES

README = (REPO / "README.md").read_text(encoding="utf-8")
CORE_SOURCES = "".join((REPO / "harness" / name).read_text(encoding="utf-8") for name in ("bridge.py", "context.py", "config.py", "manager.py", "report/__init__.py"))
DECLARATION_HOOKS = {"add_config", "declare_codes"}


@pytest.mark.parametrize("hook", HOOK_NAMES)
def test_every_hook_is_documented_with_when_it_fires(hook: str) -> None:
    doc = inspect.getdoc(getattr(hookspecs, hook)) or ""
    assert "Fires:" in doc, f"hookspec {hook} must say when it fires"
    assert f"`{hook}`" in README or hook in README, f"README does not mention hook {hook}"


TEST_SOURCES = "".join(p.read_text(encoding="utf-8") for p in (REPO / "tests").rglob("test_*.py") if p.name != "test_docs.py")


@pytest.mark.parametrize("hook", HOOK_NAMES)
def test_every_hook_has_a_test(hook: str) -> None:
    assert f"def {hook}(" in TEST_SOURCES, f"no test implements hook {hook}: add a test plugin that uses it and asserts what it gets"


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


def test_every_builtin_plugin_has_its_test_module_and_documented_options() -> None:
    from harness.plugins import BUILTIN_PLUGINS

    catalog = Catalog.build(autoload=False)
    for name in BUILTIN_PLUGINS:
        assert (REPO / "tests" / "plugins" / f"test_{name}.py").exists(), f"tests/plugins/test_{name}.py missing"
        model = catalog.option_models[name]
        for key, field in (model.model_fields.items() if model else []):
            assert field.description, f"{name}.{key} has no description"
            assert re.search(rf"\b{key}\b", README), f"option {name}.{key} is not in README.md"
