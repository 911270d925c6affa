"""A test plugin for rollback: asks for a rollback the first time a chosen step runs, and fingerprints every batch."""
from __future__ import annotations

import json
from typing import Any

from harness import FindingCode, Severity, hookimpl

BAD_BATCH = FindingCode("TEST_BAD_BATCH", Severity.ERROR, "a batch the test declares bad", "harness-core#test_fault")


class BadBatchOnce:
    """Reports TEST_BAD_BATCH (action: rollback) at step 5 of the first pass only; records (pass, step, batch sum)."""

    name = "bad_batch_once"
    at_step = 5

    def __init__(self) -> None:
        self.fired = False
        self.passes = 0

    @hookimpl
    def declare_codes(self) -> list[FindingCode]:
        return [BAD_BATCH]

    @hookimpl
    def on_run_start(self) -> None:
        self.passes += 1

    @hookimpl
    def inspect_batch(self, ctx: Any, batch: dict[str, Any], step: int, micro_step: int) -> None:
        with open(ctx.path(f"batches.rank-{ctx.rank}.jsonl"), "a", encoding="utf-8") as handle:
            handle.write(json.dumps({"pass": self.passes, "step": step, "sum": int(batch["input_ids"].sum())}) + "\n")
        if step == self.at_step and not self.fired:
            self.fired = True
            ctx.report(BAD_BATCH.code, f"bad batch at step {step}")

    @hookimpl
    def decide_action(self, finding: Any) -> str | None:
        return "rollback" if finding.code == BAD_BATCH.code else None


class BatchRecorder(BadBatchOnce):
    """Only fingerprints batches (a clean reference run)."""

    name = "batch_recorder"
    at_step = -1
