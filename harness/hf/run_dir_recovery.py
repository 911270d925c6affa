"""A run directory deleted under a live run: noticed at checkpoints and at the run end, made again, findings rewritten.

``rm -rf runs/x/harness`` while the job trains (a clean-up script, a
mistaken command) left every later write going to removed files: the
findings of the rest of the run were lost, and the lock with them, so a
second job could start in the same folder. The writers keep their open
descriptors; at each checkpoint and at the end one ``fstat`` per writer
tells whether its file is gone (nothing is checked per step). Then the
files are made anew at their paths, the findings this process holds are
written again, rank 0 takes the run lock again, and the console says once
what happened and what is lost (the lines written before: ledger, step
records).
"""
from __future__ import annotations

import logging
from pathlib import Path

from harness.core.appendfile import reopen_removed
from harness.core.context import RunContext
from harness.core.findings import findings_path
from harness.core.mapped_lines import reopen_removed_lines
from harness.lib import rundir

log = logging.getLogger("harness")


def recover_run_dir(ctx: RunContext) -> list[Path]:
    """Make the run directory's removed files anew (see the module); the paths made again (empty: nothing removed)."""
    made = reopen_removed() + reopen_removed_lines()
    if not made:
        return []
    if findings_path(ctx.run_dir, 0 if ctx.is_main else ctx.rank) in made:
        ctx.write_findings_again()
    rundir.retake(ctx.run_dir)
    if not ctx.run_dir_recreated:
        ctx.run_dir_recreated = True
        log.warning("harness: the run directory %s was deleted while training (rank %d noticed at step %d); its files are "
                    "made again and the findings this process holds are written again. What was written there before is "
                    "lost (the data ledger and step records before this point, config.yaml); training goes on.",
                    ctx.run_dir, ctx.rank, ctx.step)
    return made
