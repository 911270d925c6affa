"""Config errors name the file, the key, the plugin and a fix; good configs resolve."""
from __future__ import annotations

from pathlib import Path

import pytest

from conftest import FAULTS, harness_cli, write_yaml
from harness.actions import Action
from harness.hookspecs import hookimpl
from harness.config import Catalog, load_config
from harness.errors import ConfigError


@pytest.fixture
def catalog() -> Catalog:
    return Catalog.build(extra=[FAULTS])


def _error(tmp_path: Path, catalog: Catalog, data: dict) -> str:
    path = write_yaml(tmp_path / "harness.yaml", data)
    with pytest.raises(ConfigError) as info:
        load_config(path, catalog)
    return str(info.value)


def test_unknown_plugin_names_file_key_and_suggestion(tmp_path: Path, catalog: Catalog) -> None:
    message = _error(tmp_path, catalog, {"plugins": ["metrics_lgo"]})
    assert str(tmp_path / "harness.yaml") in message
    assert "key 'plugins'" in message and "unknown plugin 'metrics_lgo'" in message
    assert "Did you mean 'metrics_log'?" in message and "Fix:" in message


def test_typo_in_plugin_option_names_plugin_and_did_you_mean(tmp_path: Path, catalog: Catalog) -> None:
    message = _error(tmp_path, catalog, {"fault_injector": {"report_at_stpe": 3}})
    assert "key 'fault_injector.report_at_stpe'" in message
    assert "plugin 'fault_injector'" in message
    assert "Did you mean 'report_at_step'?" in message
    assert str(tmp_path / "harness.yaml") in message


def test_wrong_type_names_key_value_and_expected_type(tmp_path: Path, catalog: Catalog) -> None:
    message = _error(tmp_path, catalog, {"fault_injector": {"report_at_step": "three"}})
    assert "key 'fault_injector.report_at_step'" in message and "plugin 'fault_injector'" in message
    assert "integer" in message and "'three'" in message


def test_unknown_top_level_key_suggests_core_option(tmp_path: Path, catalog: Catalog) -> None:
    message = _error(tmp_path, catalog, {"polciy": {}})
    assert "key 'polciy'" in message and "the harness core" in message and "Did you mean 'policy'?" in message


def test_unknown_code_in_policy_and_bad_action(tmp_path: Path, catalog: Catalog) -> None:
    assert "Did you mean 'TEST_FAULT'?" in _error(tmp_path, catalog, {"policy": {"TEST_FALT": "stop"}})
    message = _error(tmp_path, catalog, {"policy": {"TEST_FAULT": "halt"}})
    assert "key 'policy.TEST_FAULT'" in message and "'halt'" in message


def test_yaml_syntax_error_names_line(tmp_path: Path, catalog: Catalog) -> None:
    path = tmp_path / "broken.yaml"
    path.write_text("plugins: [a, b\nseverity: {}\n", encoding="utf-8")
    with pytest.raises(ConfigError, match=r"broken.yaml' is not valid YAML at line \d+"):
        load_config(path, catalog)


def test_missing_file(tmp_path: Path, catalog: Catalog) -> None:
    with pytest.raises(ConfigError, match="does not exist"):
        load_config(tmp_path / "nope.yaml", catalog)


def test_valid_config_resolves_plugins_policy_and_severity(tmp_path: Path, catalog: Catalog) -> None:
    path = write_yaml(
        tmp_path / "ok.yaml",
        {"plugins": ["metrics_log", FAULTS], "policy": {"TEST_FAULT": "skip_step"}, "severity": {"TEST_FAULT": "critical"}},
    )
    resolved = load_config(path, catalog)
    assert resolved.enabled == ["metrics_log", "fault_injector"]
    assert resolved.model.policy["TEST_FAULT"] is Action.SKIP_STEP
    assert resolved.options_for("fault_injector").report_at_step is None


def test_defaults_and_disable(catalog: Catalog) -> None:
    defaults = catalog.default_enabled
    assert "metrics_log" in defaults and "nan_guard" in defaults and "mlflow" not in defaults
    assert load_config({}, catalog).enabled == defaults
    assert load_config({"disable": ["metrics_log"]}, catalog).enabled == [n for n in defaults if n != "metrics_log"]
    assert load_config({"plugins": ["defaults", FAULTS]}, catalog).enabled == [*defaults, "fault_injector"]


def test_cli_prints_reference_with_every_option(tmp_path: Path) -> None:
    out = harness_cli("plugins", "--config-reference")
    assert out.returncode == 0, out.stderr
    for key in ("`plugins`", "`policy`", "`severity`", "`max_plugin_errors`", "## metrics_log"):
        assert key in out.stdout
    assert "(undocumented)" not in out.stdout


def test_cli_lists_plugins_and_codes() -> None:
    listing = harness_cli("plugins")
    assert listing.returncode == 0 and "metrics_log" in listing.stdout and " on " in listing.stdout
    codes = harness_cli("plugins", "--codes")
    assert "INTERNAL_PLUGIN_ERROR" in codes.stdout


class _NoOptions:
    name = "no_options"

    @hookimpl
    def on_log(self) -> None:
        pass


def test_a_section_for_a_plugin_without_options(tmp_path: Path, catalog: Catalog) -> None:
    catalog.add(_NoOptions())
    message = _error(tmp_path, catalog, {"no_options": {"every": 2}})
    assert "plugin 'no_options'): this plugin has no options" in message
