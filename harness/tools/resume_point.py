"""``harness resume-point <output_dir>``: the newest proven checkpoint, for scripts that restart a job.

A checkpoint is proven when ``checkpoint_proof`` read it back after its save
(complete, weights load and are finite, the reference loss matches) and wrote
``harness_proven`` into it. The newest such folder, with its Trainer files
still there and unchanged since the proof (every file it held, by size), is printed alone on stdout (exit 0), so that a launcher can do
``--resume_from_checkpoint "$(harness resume-point out)"``. With none proven,
the newest checkpoint marked ``harness_checked`` is printed instead (exit 0):
its proof could not be made (a model above ``max_model_mb``, no batch the
model accepts, a model whose saved format cannot be built; never another
model's weights, which are corrupt) but it is complete and its weights
load with finite values, and a line on stderr says so and why. With neither,
one line on stderr says so and what the newer folders are (exit 1): a
checkpoint found corrupt is never named.

A newer folder passed over for a reason a user would not guess gets a line on
stderr: a ``checkpoint-<N>`` that is a symlink (never named: a run directory
may be received from someone else, and nothing is read or used through a
link), a ``harness_proven`` marker that cannot be read, a proven checkpoint
that changed or lost files since, a checkpoint of a history the run went back
from: a step above the one the run's last ``train()`` call started from
(``run.json``), written before that call started (a rollback, or a resume from
an older checkpoint, left it; resuming from it would discard what the run
trained since). Without a readable ``run.json`` no folder is passed over for
that.
"""
from __future__ import annotations

import sys
from pathlib import Path

from harness.lib.checkpoints import abandoned_checkpoints, list_checkpoints
from harness.lib.proven import CHECKED, MARKER, resume_candidate

EXIT_NONE = 1


def print_resume_point(output_dir: Path) -> int:
    output_dir = Path(output_dir)
    if not output_dir.is_dir():
        sys.stderr.write(f"harness resume-point: {output_dir} is not a folder (give the training run's output_dir).\n")
        return 2
    chosen, notes = resume_candidate(output_dir)
    for note in notes:  # a newer folder passed over (a link, a broken marker, changed since, an abandoned history), a fallback
        sys.stderr.write(f"harness resume-point: {note}.\n")
    if chosen is not None:
        print(chosen)
        return 0
    gone_back = abandoned_checkpoints(output_dir)
    found = [p.name for p in list_checkpoints(output_dir) if p not in gone_back]
    line = " of the history the run's last train() call continues" if gone_back else ""
    sys.stderr.write(
        f"harness resume-point: no proven checkpoint in {output_dir}{line} (none holds a valid {MARKER} or {CHECKED} marker; checkpoint "
        f"folders: {', '.join(found[:10]) or 'none'}). A checkpoint is proven by the checkpoint_proof plugin after its save; see "
        "`harness explain` for CHECKPOINT_CORRUPT / CHECKPOINT_UNVERIFIED findings.\n"
    )
    return EXIT_NONE
