"""Finding codes that the harness core itself emits."""
from __future__ import annotations

from harness.core.findings import FindingCode, Severity

INTERNAL_PLUGIN_ERROR = FindingCode(
    "INTERNAL_PLUGIN_ERROR",
    Severity.ERROR,
    "A plugin raised an exception; training went on without that call.",
    "harness-core#internal_plugin_error",
)
PLUGIN_DISABLED = FindingCode(
    "PLUGIN_DISABLED",
    Severity.ERROR,
    "A plugin raised too many exceptions and was switched off for the rest of the run.",
    "harness-core#plugin_disabled",
)
ACTION_TAKEN = FindingCode(
    "ACTION_TAKEN",
    Severity.INFO,
    "The harness changed training (skipped a step, saved and stopped, stopped) after a finding.",
    "harness-core#action_taken",
)
PLUGIN_STOP = FindingCode(
    "PLUGIN_STOP",
    Severity.ERROR,
    "A plugin raised HarnessStop: training stops at the next optimizer-step guard, on every rank.",
    "harness-core#plugin_stop",
)
SKIP_NOT_APPLIED = FindingCode(
    "SKIP_NOT_APPLIED",
    Severity.CRITICAL,
    "A skip was decided but the optimizer applied the update anyway (an optimizer the guard cannot hold).",
    "harness-core#skip_not_applied",
)
ROLLBACK_PERFORMED = FindingCode(
    "ROLLBACK_PERFORMED",
    Severity.WARNING,
    "The stage runner rolled back to the last good checkpoint and skipped the offending training rows.",
    "harness-core#rollback_performed",
)
ROLLBACK_EXHAUSTED = FindingCode(
    "ROLLBACK_EXHAUSTED",
    Severity.CRITICAL,
    "A rollback was asked for but no retries or no earlier checkpoint were left; the run stopped.",
    "harness-core#rollback_exhausted",
)
CHECKPOINT_INCOMPLETE = FindingCode(
    "CHECKPOINT_INCOMPLETE",
    Severity.WARNING,
    "A checkpoint folder lacks files of a finished save (killed mid-save); resume_from_checkpoint=True passed over it.",
    "resume#checkpoint_incomplete",
)
RUN_DIR_WRITE_FAILED = FindingCode(
    "RUN_DIR_WRITE_FAILED",
    Severity.WARNING,
    "The harness could not write to the run directory for a while (a full disk or quota, an I/O error); training went "
    "on and what was held in memory was written once it could.",
    "harness-core#run_dir_write_failed",
)
HARNESS_STATE_NOT_SAVED = FindingCode(
    "HARNESS_STATE_NOT_SAVED",
    Severity.WARNING,
    "The harness could not write its plugin state or its completion marker into a checkpoint; a resume from it is "
    "not verified.",
    "harness-core#harness_state_not_saved",
)
CORE_CODES: tuple[FindingCode, ...] = (
    RUN_DIR_WRITE_FAILED,
    HARNESS_STATE_NOT_SAVED,
    INTERNAL_PLUGIN_ERROR,
    PLUGIN_DISABLED,
    PLUGIN_STOP,
    ACTION_TAKEN,
    SKIP_NOT_APPLIED,
    ROLLBACK_PERFORMED,
    ROLLBACK_EXHAUSTED,
    CHECKPOINT_INCOMPLETE,
)
