"""The package's layers: import-linter's contracts hold, and no module of ``harness`` reaches itself through imports.

Both checks read the package as it is installed: ``plugins/``, ``stages/`` and
``playbooks/`` install as ``harness.plugins``, ``harness.stages`` and
``harness.playbooks`` (setup.py's ``PACKAGE_DIR``), a mapping grimp cannot see
through an editable install. So the sources are copied to a folder laid out
like the wheel and checked there, in a subprocess with that folder first on
``PYTHONPATH``. Each check is also shown to fail: on a forbidden import and on
a cycle planted into the copy (function-level imports count).

Run by hand: ``python tests/core/test_layers.py`` prints lint-imports' report.
"""
from __future__ import annotations

import ast
import json
import os
import shutil
import re
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
LINT_IMPORTS = Path(sys.executable).with_name("lint-imports")

# Every module that reaches itself again through imports, with the chain back: a JSON list of [module, chain].
CYCLES_SCRIPT = """
import json, grimp
graph = grimp.build_graph("harness", cache_dir=None)
found = []
for module in sorted(graph.modules):
    for imported in sorted(graph.find_modules_directly_imported_by(module)):
        if imported != module and graph.chain_exists(importer=imported, imported=module):
            found.append([module, [module, *graph.find_shortest_chain(importer=imported, imported=module)]])
            break
print(json.dumps(found))
"""


def package_dir() -> dict[str, str]:
    """setup.py's ``PACKAGE_DIR`` (import name -> folder), read without running setup.py."""
    tree = ast.parse((REPO / "setup.py").read_text(encoding="utf-8"))
    for node in tree.body:
        if isinstance(node, ast.Assign) and any(getattr(t, "id", None) == "PACKAGE_DIR" for t in node.targets):
            return ast.literal_eval(node.value)
    raise AssertionError("setup.py has no PACKAGE_DIR")


def install_tree(dst: Path) -> Path:
    """The package's sources copied to ``dst`` in their installed layout (``dst/harness/plugins`` ...)."""
    ignore = shutil.ignore_patterns("__pycache__", "*.pyc")
    for name, folder in sorted(package_dir().items(), key=lambda item: item[0].count(".")):
        shutil.copytree(REPO / folder, dst / Path(*name.split(".")), ignore=ignore, dirs_exist_ok=True)
    return dst


def _env(tree: Path) -> dict[str, str]:
    return {**os.environ, "PYTHONPATH": str(tree), "PYTHONDONTWRITEBYTECODE": "1"}


def lint_imports(tree: Path) -> subprocess.CompletedProcess[str]:
    """``lint-imports`` with the repository's contracts (pyproject.toml) over the installed layout in ``tree``."""
    command = [str(LINT_IMPORTS), "--no-cache", "--no-logo", str(REPO / "pyproject.toml")]
    return subprocess.run(command, cwd=tree, env=_env(tree), capture_output=True, text=True, timeout=300)


def import_cycles(tree: Path) -> list[tuple[str, list[str]]]:
    """Every module of ``harness`` in ``tree`` that imports itself again, with the chain (grimp's whole graph)."""
    done = subprocess.run([sys.executable, "-c", CYCLES_SCRIPT], cwd=tree, env=_env(tree), capture_output=True,
                          text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    return [(module, chain) for module, chain in json.loads(done.stdout)]


def _plant(tree: Path, module: str, text: str) -> None:
    path = tree / Path(*module.split(".")).with_suffix(".py")
    path.write_text(path.read_text(encoding="utf-8") + "\n" + text + "\n", encoding="utf-8")


@pytest.fixture
def tree(tmp_path: Path) -> Path:
    return install_tree(tmp_path / "site")


def test_install_tree_has_the_installed_layout(tree: Path) -> None:
    for folder in ("core", "lib", "hf", "report", "tools", "launch", "testing", "plugins", "stages", "playbooks"):
        assert (tree / "harness" / folder / "__init__.py").is_file(), folder


def test_lint_imports_contracts_hold(tree: Path) -> None:
    done = lint_imports(tree)
    assert done.returncode == 0, done.stdout + done.stderr
    summary = done.stdout.split("Contracts: ")[-1].split("\n")[0]
    assert re.fullmatch(r"\d+ kept, 0 broken\.", summary), summary


def test_lint_imports_fails_on_an_import_from_core_to_hf(tree: Path) -> None:
    _plant(tree, "harness.core.findings", "import harness.hf  # planted: the core imports the Trainer integration")
    done = lint_imports(tree)
    assert done.returncode != 0
    assert "harness.core is not allowed to import harness.hf" in done.stdout
    assert "harness.core.findings -> harness.hf" in done.stdout


def test_lint_imports_fails_when_a_plugin_imports_another(tree: Path) -> None:
    _plant(tree, "harness.plugins.nan_guard", "def _planted():\n    from harness.plugins import data_hash  # planted")
    done = lint_imports(tree)
    assert done.returncode != 0
    assert "harness.plugins.nan_guard -> harness.plugins.data_hash" in done.stdout


def test_lint_imports_fails_when_the_core_imports_transformers(tree: Path) -> None:
    _plant(tree, "harness.core.codes", "def _planted():\n    import transformers  # planted")
    done = lint_imports(tree)
    assert done.returncode != 0
    assert "harness.core.codes -> transformers" in done.stdout


def test_no_import_cycle_in_the_package(tree: Path) -> None:
    cycles = import_cycles(tree)
    assert not cycles, "\n".join(" -> ".join(chain) for _, chain in cycles)


def test_cycle_check_finds_a_planted_function_level_cycle(tree: Path) -> None:
    _plant(tree, "harness.core.findings", "def _planted():\n    from harness.core import config  # planted")
    cycles = dict(import_cycles(tree))
    assert "harness.core.findings" in cycles
    chain = cycles["harness.core.findings"]
    assert chain[0] == chain[-1] == "harness.core.findings" and "harness.core.config" in chain


if __name__ == "__main__":
    import tempfile

    with tempfile.TemporaryDirectory() as tmp:
        result = lint_imports(install_tree(Path(tmp)))
        sys.stdout.write(result.stdout + result.stderr)
        raise SystemExit(result.returncode)


def test_test_files_have_unique_names() -> None:
    """The test folders are not packages: pytest imports each test file by its base name, so two files of one name
    make the second a collection error on a clean clone (CI failed so once: tests/lib and tests/e2e test_world_scaling)."""
    from collections import Counter

    tests = Path(__file__).resolve().parents[1]
    names = Counter(p.name for p in tests.rglob("test_*.py"))
    assert [name for name, count in names.items() if count > 1] == []
