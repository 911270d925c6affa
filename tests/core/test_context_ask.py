"""A finding written after the ranks agreed: its action is asked for before (``ctx.ask``), recorded with it (``decided``).

A late ask would act on the next step; so ``report(..., decided=...)`` records the action and leaves the step's
pending action alone, while ``ask`` raises it to the strongest asked, and ``decide`` is what ``report`` would pick.
"""
from __future__ import annotations

from pathlib import Path

from harness.core.actions import Action
from harness.core.config import Catalog, resolve_config
from harness.core.context import RunContext
from harness.core.distributed import DistInfo
from harness.core.findings import Finding, FindingCode, Severity, read_findings
from harness.core.manager import HarnessPluginManager

LATE = FindingCode("LATE_FINDING", Severity.ERROR, "a finding written after the agreement", "numeric-health#late")


def _ctx(run_dir: Path, policy: dict[str, str]) -> RunContext:
    catalog = Catalog.build(autoload=False)
    resolved = resolve_config({"plugins": []}, catalog)
    resolved.model.policy.update(policy)
    return RunContext(resolved, {LATE.code: LATE}, HarnessPluginManager(), run_dir, DistInfo(rank=0, world_size=1, local_rank=0))


def test_a_decided_finding_keeps_its_action_and_leaves_the_step_pending_action_alone(tmp_path: Path) -> None:
    ctx = _ctx(tmp_path / "harness", {LATE.code: "save_and_stop"})
    probe = Finding(code=LATE.code, severity=Severity.ERROR, plugin="p", message="", step=3, rank=0)
    assert ctx.decide(probe) is Action.SAVE_AND_STOP  # the config's policy, as report() would pick it

    ctx.ask(Action.SKIP_STEP)
    ctx.ask(Action.CONTINUE)  # a weaker ask never lowers the strongest
    assert ctx.pending_action is Action.SKIP_STEP
    assert ctx.agree() is Action.SKIP_STEP and ctx.pending_action is Action.CONTINUE

    written = ctx.report(LATE.code, "after the agreement", step=3, decided=Action.SKIP_STEP)
    assert written.action == "skip_step"  # recorded as asked, not the policy's save_and_stop
    assert ctx.pending_action is Action.CONTINUE  # not asked again: the next step would have acted on it
    ctx.report(LATE.code, "undecided: the policy applies and is asked for", step=4)
    assert ctx.pending_action is Action.SAVE_AND_STOP
    ctx.close()
    assert [f.action for f in read_findings(tmp_path / "harness" / "findings.jsonl")] == ["skip_step", "save_and_stop"]
