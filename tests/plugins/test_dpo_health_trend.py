"""dpo_health's log checks over a long DPO run: constant work per log and bounded history, the same findings as before.

Driven through a real run context and plugin manager with logged values only (what TRL logs; no trainer needed).
"""
from __future__ import annotations

import statistics
from pathlib import Path
from typing import Any

from harness.core.config import Catalog, load_config
from harness.core.context import RunContext
from harness.core.distributed import DistInfo
from harness.core.manager import HarnessPluginManager


def _dpo_health(run_dir: Path) -> tuple[RunContext, Any]:
    catalog = Catalog.build(autoload=False)
    resolved = load_config({"plugins": ["dpo_health"]}, catalog)
    manager = HarnessPluginManager(resolved.model.max_plugin_errors)
    for name in resolved.enabled:
        manager.register(catalog.entries[name])
    ctx = RunContext(resolved, catalog.codes, manager, run_dir, DistInfo(rank=0, world_size=1, local_rank=0))
    for name in manager.names:
        manager.hooks.configure(name, ctx, resolved.options_for(name))
    plugin = manager.plugin("dpo_health")
    plugin._kind = "dpo"  # what on_run_start decides for a DPOTrainer
    return ctx, plugin


def _logs(i: int, falling: bool) -> dict[str, float]:
    chosen = -0.01 * i if falling else 0.1 * ((i * 7919) % 13 - 6)  # falling: below -2 after 200 logs; else noise around 0
    margin = 0.02 * i if falling else 0.05
    return {"rewards/chosen": chosen, "rewards/margins": margin, "rewards/accuracies": 0.6, "logps/chosen": -50.0 - i}


def _first_falling_step(count: int) -> int | None:
    """The old check, recomputed from the whole history at every log: the step it first fires at."""
    points: list[dict[str, float]] = []
    for i in range(1, count + 1):
        points.append(_logs(i, True))
        if len(points) < 6:
            continue
        third = max(2, len(points) // 3)
        med = {(k, part): statistics.median(p[k] for p in (points[:third] if part == "early" else points[-third:]))
               for k in ("rewards/chosen", "rewards/margins") for part in ("early", "late")}
        if (med["rewards/chosen", "late"] < -2.0 and med["rewards/chosen", "late"] < med["rewards/chosen", "early"]
                and med["rewards/margins", "late"] > med["rewards/margins", "early"]):
            return i
    return None


def test_a_long_healthy_run_keeps_a_bounded_history_and_reports_nothing(tmp_path: Path) -> None:
    ctx, plugin = _dpo_health(tmp_path)
    for step in range(1, 3001):
        ctx.manager.hooks.on_log(ctx, step, _logs(step, False))
    assert [f.code for f in ctx.findings] == []
    assert len(plugin._history) <= 2 * plugin.options.saturated_logs
    assert len(plugin._trend.chosen) == 3000  # every point counts towards the thirds


def test_falling_chosen_rewards_are_reported_at_the_step_and_with_the_numbers_of_the_full_recomputation(tmp_path: Path) -> None:
    ctx, _ = _dpo_health(tmp_path)
    for step in range(1, 601):
        ctx.manager.hooks.on_log(ctx, step, _logs(step, True))
    (finding,) = [f for f in ctx.findings if f.code == "DPO_CHOSEN_LOGPS_FALLING"]
    expected = _first_falling_step(600)
    assert expected is not None and finding.step == expected
    third = max(2, expected // 3)
    points = [_logs(i, True) for i in range(1, expected + 1)]
    assert finding.evidence["early_rewards_chosen"] == statistics.median(p["rewards/chosen"] for p in points[:third])
    assert finding.evidence["late_margin"] == statistics.median(p["rewards/margins"] for p in points[-third:])
    assert finding.evidence["logps_chosen_first_last"] == [-51.0, -50.0 - expected]
    assert f"(steps 1-{expected})" in finding.message
