"""The Plugin base (harness.core.plugin) inside a real RunContext and manager: options, codes, limits, requirements."""
from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from pydantic import BaseModel, ConfigDict

from harness.core.config import Catalog, load_config
from harness.core.context import RunContext
from harness.core.distributed import DistInfo
from harness.core.findings import FindingCode, Severity
from harness.core.hookspecs import hookimpl
from harness.core.manager import HarnessPluginManager
from harness.core.plugin import Plugin

THING = FindingCode("CHECKER_THING", Severity.WARNING, "a thing happened", "plugin-errors#internal_plugin_error")
OTHER = FindingCode("CHECKER_OTHER", Severity.INFO, "another thing", "plugin-errors#internal_plugin_error")
UNCHECKED = FindingCode("CHECKER_UNCHECKED", Severity.WARNING, "not checked", "plugin-errors#internal_plugin_error")


class CheckerOptions(BaseModel):
    model_config = ConfigDict(extra="forbid")
    threshold: int = 3


class Checker(Plugin):
    """checker: a plugin of the tests."""

    name = "checker"
    Options = CheckerOptions
    CODES = (THING, OTHER, UNCHECKED)
    requires = ("helper",)

    def __init__(self) -> None:
        self.setups: list[tuple[Any, Any]] = []

    def setup(self, ctx: Any) -> None:
        self.setups.append((ctx, self.options))

    @hookimpl
    def on_step_end(self, ctx: Any, step: int) -> None:
        self.report(THING.code, f"step {step}", limit=self.options.threshold)


class Helper(Plugin):
    """helper: what checker reads."""

    name = "helper"


def _run(tmp_path: Path, config: dict[str, Any]) -> tuple[RunContext, Checker]:
    checker, helper = Checker(), Helper()
    catalog = Catalog.build(extra=[checker, helper], autoload=False)
    resolved = load_config(config, catalog)
    manager = HarnessPluginManager(resolved.model.max_plugin_errors)
    for name in resolved.enabled:
        manager.register(catalog.entries[name])
    ctx = RunContext(resolved, catalog.codes, manager, tmp_path, DistInfo(rank=0, world_size=1, local_rank=0))
    for name in resolved.enabled:
        manager.hooks.configure(name, ctx, resolved.options_for(name))
    return ctx, checker


def test_class_attributes_declare_options_and_codes(tmp_path: Path) -> None:
    catalog = Catalog.build(extra=[Checker(), Helper()], autoload=False)
    assert catalog.option_models["checker"] is CheckerOptions and catalog.option_models["helper"] is None
    assert {c: catalog.code_owner[c] for c in ("CHECKER_THING", "CHECKER_OTHER", "CHECKER_UNCHECKED")} == dict.fromkeys(
        ("CHECKER_THING", "CHECKER_OTHER", "CHECKER_UNCHECKED"), "checker")


def test_configure_sets_ctx_and_options_then_calls_setup_once(tmp_path: Path) -> None:
    ctx, checker = _run(tmp_path, {"plugins": ["checker", "helper"], "checker": {"threshold": 7}})
    assert checker.ctx is ctx and checker.options == CheckerOptions(threshold=7)
    assert checker.setups == [(ctx, checker.options)]
    _, defaults = _run(tmp_path / "b", {"plugins": ["checker", "helper"]})
    assert defaults.options == CheckerOptions()


def test_report_limit_holds_back_the_rest_and_the_last_one_says_so(tmp_path: Path) -> None:
    ctx, checker = _run(tmp_path, {"plugins": ["checker", "helper"], "checker": {"threshold": 3}})
    for step in range(1, 6):
        ctx.step = step
        ctx.manager.hooks.on_step_end(ctx, step, {})
    assert [f.message.split(" (")[0] for f in ctx.findings] == ["step 1", "step 2", "step 3"]
    assert all(f.plugin == "checker" and f.code == "CHECKER_THING" for f in ctx.findings)
    assert "(the 3" in ctx.findings[2].message and "further ones are not reported" in ctx.findings[2].message
    assert "further ones" not in ctx.findings[1].message
    assert checker.reported("CHECKER_THING") == 5
    assert checker.report("CHECKER_THING", "again", limit=3) is None


def test_limits_count_per_code_and_no_limit_means_none(tmp_path: Path) -> None:
    ctx, checker = _run(tmp_path, {"plugins": ["checker", "helper"]})
    assert checker.report("CHECKER_THING", "a", limit=1) is not None
    assert checker.report("CHECKER_THING", "b", limit=1) is None
    assert checker.report("CHECKER_OTHER", "c", limit=1) is not None  # its own count
    assert all(checker.report("CHECKER_OTHER", f"d{i}") is not None for i in range(20))
    assert len(ctx.findings) == 22


def test_a_required_plugin_that_is_off_is_missing_and_reported_unchecked_once(tmp_path: Path) -> None:
    ctx, checker = _run(tmp_path, {"plugins": ["checker"]})
    assert checker.missing == ("helper",)
    first = checker.unchecked("CHECKER_UNCHECKED", "the data position")
    assert checker.unchecked("CHECKER_UNCHECKED", "the data position") is None
    assert first is not None and [f.code for f in ctx.findings] == ["CHECKER_UNCHECKED"]
    assert "the data position was not checked" in first.message and "helper" in first.message
    assert first.evidence == {"requires": ["helper"], "missing": ["helper"]}


def test_a_required_plugin_that_is_on_is_not_missing(tmp_path: Path) -> None:
    _, checker = _run(tmp_path, {"plugins": ["checker", "helper"]})
    assert checker.missing == ()


def test_a_disabled_requirement_is_missing_too(tmp_path: Path) -> None:
    _, checker = _run(tmp_path, {"plugins": ["checker", "helper"], "disable": ["helper"]})
    assert checker.missing == ("helper",)


def test_defer_goes_through_the_context_under_the_plugin_s_name(tmp_path: Path) -> None:
    ctx, checker = _run(tmp_path, {"plugins": ["checker", "helper"]})
    checker.defer("loss", torch.tensor(2.5))
    checker.defer("loss", torch.tensor(float("inf")))
    assert checker.deferred("loss") == []  # nothing is read before the guard
    ctx.read_deferred()
    assert checker.deferred("loss") == [2.5, float("inf")]
    assert ctx.deferred("loss", owner="checker") == [2.5, float("inf")] and ctx.deferred("loss", owner="helper") == []


def test_an_undeclared_code_is_still_an_error(tmp_path: Path) -> None:
    _, checker = _run(tmp_path, {"plugins": ["checker", "helper"]})
    with pytest.raises(ValueError, match="not declared"):
        checker.report("NOT_A_CODE", "x")
