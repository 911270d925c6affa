"""Config errors name the file, the key, the plugin and a fix; good configs resolve."""
from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from conftest import FAULTS, harness_cli, write_yaml
from harness.core.actions import Action
from harness.core.hookspecs import hookimpl
from harness.core.config import Catalog, load_config
from harness.core.errors import ConfigError


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


def test_only_runs_exactly_those_and_plugins_adds_to_the_defaults(catalog: Catalog, monkeypatch: pytest.MonkeyPatch) -> None:
    defaults = catalog.default_enabled
    assert load_config({}, catalog, extra_plugins=["mlflow"]).enabled == [*defaults, "mlflow"]  # --plugins: added
    assert load_config({}, catalog, only=["nan_guard", "mlflow"]).enabled == ["nan_guard", "mlflow"]  # --only: exactly
    assert load_config({"only": ["loss_baseline"]}, catalog).enabled == ["loss_baseline"]
    assert load_config({"only": ["loss_baseline"]}, catalog, extra_plugins=["mlflow"]).enabled == ["loss_baseline", "mlflow"]
    assert load_config({"plugins": ["defaults"]}, catalog, only=["nan_guard"]).enabled == ["nan_guard"]  # the command line wins
    assert load_config({}, catalog, extra_plugins=["defaults", FAULTS]).enabled == [*defaults, "fault_injector"]  # attach's list
    assert load_config({"only": ["defaults"], "disable": ["nan_guard"]}, catalog).enabled == [n for n in defaults if n != "nan_guard"]
    monkeypatch.setenv("HARNESS_ONLY", "nan_guard, data_hash")
    assert load_config(None, catalog).enabled == ["nan_guard", "data_hash"]


def test_two_ways_of_choosing_plugins_at_once_are_refused(catalog: Catalog) -> None:
    with pytest.raises(ConfigError, match="keys 'only' and 'plugins'"):
        load_config({"only": ["nan_guard"], "plugins": ["mlflow"]}, catalog)
    with pytest.raises(ConfigError, match="--only .* and --plugins"):
        load_config({}, catalog, extra_plugins=["mlflow"], only=["nan_guard"])
    with pytest.raises(ConfigError, match="unknown plugin 'nan_gard'.*nan_guard"):
        load_config({}, catalog, only=["nan_gard"])


def test_cli_shows_which_plugins_a_config_enables(tmp_path: Path) -> None:
    config = write_yaml(tmp_path / "harness.yaml", {"only": ["nan_guard", "loss_baseline"]})
    shown = harness_cli("plugins", "--config", str(config))
    assert shown.returncode == 0, shown.stderr
    on = [line.split()[0] for line in shown.stdout.splitlines() if line.split()[1:2] == ["on"]]
    assert on == ["nan_guard", "loss_baseline"]
    assert "2 of " in shown.stdout and str(config) in shown.stdout
    added = harness_cli("plugins", "--config", str(config), "--plugins", "mlflow")
    assert [line.split()[0] for line in added.stdout.splitlines() if line.split()[1:2] == ["on"]] == ["nan_guard", "loss_baseline", "mlflow"]


def test_cli_prints_reference_with_every_option(tmp_path: Path) -> None:
    out = harness_cli("plugins", "--config-reference")
    assert out.returncode == 0, out.stderr
    for key in ("`plugins`", "`policy`", "`severity`", "`max_plugin_errors`", "## metrics_log", "## fault_injector", "`fault_injector.corrupt_at_steps`"):
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


# -- options that name actions or finding codes ------------------------------------------------------------------

import re  # noqa: E402
import typing  # noqa: E402

from pydantic import BaseModel  # noqa: E402

from harness.core.config import CoreOptions, resolve_config  # noqa: E402


def _names_an_action(key: str, field: Any) -> bool:
    """An option whose value is an action: by its name (action, *_action, escalate_to, on_*) or its description."""
    return key == "action" or key.endswith("_action") or key == "escalate_to" or key.startswith("on_") or bool(re.search(r"\baction\b", field.description or "", re.I))


def _typed_as_choice(annotation: Any) -> bool:
    """Action, a Literal of strings, or a container/Optional of them: never a bare str that lets 'skip' through."""
    if annotation is Action:
        return True
    origin, args = typing.get_origin(annotation), typing.get_args(annotation)
    if origin is typing.Literal:
        return bool(args) and all(isinstance(a, str) for a in args)
    if origin is dict:
        return _typed_as_choice(args[1])
    if origin in (list, tuple, set) or origin is typing.Union or str(origin) == "<class 'types.UnionType'>":
        choices = [a for a in args if a is not type(None) and a is not Ellipsis]
        return bool(choices) and all(_typed_as_choice(a) for a in choices)
    return False


def _action_fields(model: type[BaseModel], prefix: tuple[str, ...] = ()) -> list[tuple[tuple[str, ...], Any]]:
    found = []
    for key, field in model.model_fields.items():
        nested = [a for a in (field.annotation, *typing.get_args(field.annotation)) if isinstance(a, type) and issubclass(a, BaseModel)]
        if nested:
            found += [f for n in nested for f in _action_fields(n, (*prefix, key))]
        elif _names_an_action(key, field):
            found.append(((*prefix, key), field))
    return found


def test_action_options_are_typed() -> None:
    """Every option of every plugin (and the core) that names an action is the Action enum or a Literal, so a typo like
    'skip' fails validation with the valid values listed, instead of reaching the first NaN as an unknown action."""
    catalog = Catalog.build(autoload=False)
    models = {"": CoreOptions, **{name: m for name, m in catalog.option_models.items() if m is not None}}
    fields = [((name, *path) if name else path, field) for name, model in models.items() for path, field in _action_fields(model)]
    keys = {".".join(path) for path, _ in fields}
    assert {"policy", "nan_guard.action", "nan_guard.escalate_to", "nan_guard.params_action", "grad_sync.on_desync"} <= keys
    untyped = [".".join(path) for path, field in fields if not _typed_as_choice(field.annotation)]
    assert untyped == [], f"options naming an action but typed loosely (use harness.core.actions.Action or a Literal): {untyped}"

    class Loose(BaseModel):  # the guard itself: a new plugin's str action field is caught
        on_spike: str = "stop"
    assert not _typed_as_choice(Loose.model_fields["on_spike"].annotation) and _action_fields(Loose)

    for path, field in fields:
        value: Any = {"LOSS_SPIKE": "skip"} if typing.get_origin(field.annotation) is dict else "skip"
        data: Any = value
        for part in reversed(path):
            data = {part: data}
        with pytest.raises(ConfigError) as info:
            resolve_config(data, catalog)
        message = str(info.value)
        owner = f"plugin '{path[0]}'" if len(path) > 1 else "the harness core"
        assert f"key '{'.'.join(path)}" in message and owner in message and "'skip' is not a valid value" in message, message
        valid = _choices(field.annotation)
        assert f"Valid values: {', '.join(valid)}." in message, message
        assert ("Did you mean 'skip_step'?" in message) == ("skip_step" in valid)


def _choices(annotation: Any) -> list[str]:
    if annotation is Action:
        return [a.value for a in Action]
    args = typing.get_args(annotation)
    if typing.get_origin(annotation) is typing.Literal:
        return list(args)
    return next(c for c in (_choices(a) for a in reversed(args)) if c)


def test_code_options_are_checked(tmp_path: Path) -> None:
    """Options naming finding codes (marked names_codes) are checked against the declared codes, in one place."""
    catalog = Catalog.build(autoload=False)
    path = write_yaml(tmp_path / "harness.yaml", {"resume_check": {"stop_on": ["RESUME_MODEL_MISMATCH", "RESUME_TYPO", "RESUME_DATA_POSITON"]}})
    with pytest.raises(ConfigError) as info:
        load_config(path, catalog)
    typo, near = info.value.problems
    for message in (typo, near):
        assert str(path) in message and "plugin 'resume_check'" in message and "Fix:" in message
        assert "Codes of resume_check: " in message and "RESUME_RNG_NOT_RESTORED" in message
    assert "key 'resume_check.stop_on[1]'" in typo and "unknown finding code 'RESUME_TYPO'" in typo
    assert "key 'resume_check.stop_on[2]'" in near and "Did you mean 'RESUME_DATA_POSITION'?" in near
    assert load_config({"resume_check": {"stop_on": ["RESUME_LOSS_JUMP"]}}, catalog).options_for("resume_check").stop_on == ["RESUME_LOSS_JUMP"]
    marked = [f"{name}.{key}" for name, model in catalog.option_models.items() if model
              for key, field in model.model_fields.items() if (field.json_schema_extra or {}).get("names_codes")]
    assert "resume_check.stop_on" in marked


def test_a_folder_or_a_file_that_is_not_utf8_is_a_config_error(tmp_path: Path, catalog: Catalog) -> None:
    (tmp_path / "adir").mkdir()
    with pytest.raises(ConfigError, match=r"adir' is a folder\. Fix: pass the YAML file itself"):
        load_config(tmp_path / "adir", catalog)
    (tmp_path / "bad.yaml").write_bytes(b"plugins: []\n\xff\xfe level: 1\n")
    with pytest.raises(ConfigError, match=r"bad.yaml' is not UTF-8 text \(byte 0xff on line 2\)\. Fix: save it as UTF-8"):
        load_config(tmp_path / "bad.yaml", catalog)


def test_a_typo_in_rerun_trigger_codes_is_an_error_not_a_silent_off(tmp_path: Path, catalog: Catalog) -> None:
    message = _error(tmp_path, catalog, {"rerun": {"trigger_codes": ["NONFINITE_LOS"]}})
    assert "rerun.trigger_codes" in message and "NONFINITE_LOS" in message and "Did you mean 'NONFINITE_LOSS'?" in message


def test_console_level_off_unquoted_in_yaml_means_off(tmp_path: Path, catalog: Catalog) -> None:
    path = tmp_path / "quiet.yaml"
    path.write_text("console: {level: off}\n", encoding="utf-8")  # YAML reads it as false
    assert load_config(path, catalog).model.console.level == "off"


def test_a_runs_own_config_yaml_loads_back_with_a_plugin_enabled_by_path(catalog: Catalog) -> None:
    import yaml

    resolved = load_config({"plugins": ["defaults", FAULTS], "fault_injector": {"report_at_step": 4}}, catalog)
    written = yaml.safe_load(resolved.to_yaml())
    assert FAULTS in written["plugins"] and "fault_injector" not in written["plugins"]
    again = load_config(written, Catalog.build(autoload=False))  # a fresh catalog, as `harness plugins --config` has
    assert again.enabled == resolved.enabled and again.model.fault_injector.report_at_step == 4


def test_a_section_of_a_path_plugin_not_enabled_says_how_to_enable_it(tmp_path: Path) -> None:
    message = _error(tmp_path, Catalog.build(autoload=False), {"fault_injector": {"report_at_step": 4}})
    assert "the section of the plugin 'fault_injector', which is not enabled" in message
    assert f'plugins: [defaults, "{FAULTS}"]' in message


def test_an_unknown_key_in_a_list_entry_lists_the_entrys_keys(tmp_path: Path, catalog: Catalog) -> None:
    message = _error(tmp_path, catalog, {"contamination": {"eval_sets": [{"path": "e.jsonl", "feild": "text"}]}})
    assert "contamination.eval_sets.0.feild" in message and "Did you mean 'field'?" in message
    assert "Valid keys here: path, field" in message, message


def test_a_section_of_a_plugin_that_is_off_is_noted(tmp_path: Path, catalog: Catalog, capsys: pytest.CaptureFixture[str]) -> None:
    """Valid, but taking no effect: `layer_stats: {interval: 5}` with layer_stats off said nothing."""
    from harness.cli import main as harness_main

    resolved = load_config({"layer_stats": {"interval": 5}, "nan_guard": {"max_consecutive": 5}}, catalog)
    assert len(resolved.notes) == 1 and "the 'layer_stats' section is set but the plugin 'layer_stats' is not enabled" in resolved.notes[0]
    disabled = load_config({"disable": ["nan_guard"], "nan_guard": {"max_consecutive": 5}}, catalog)
    assert "take it out of 'disable'" in disabled.notes[0]
    config = write_yaml(tmp_path / "h.yaml", {"layer_stats": {"interval": 5}})
    assert harness_main(["plugins", "--config", str(config)]) == 0
    err = capsys.readouterr().err
    assert "harness plugins: note:" in err and "'layer_stats' section is set" in err, err
