"""Taking ``save_total_limit`` rotation over from the Trainer, so that it can keep the last proven checkpoint.

transformers 5.x rotates inside ``Trainer._save_checkpoint``, right after
``trainer_state.json`` is written and BEFORE ``on_save`` fires: by the time
any callback hears of checkpoint N, the Trainer has already deleted what it
deletes, keeping only the newest folder (N, not yet checked) and the best
model's. With ``save_total_limit: 1`` that deletes the last checkpoint known
to be good in the very save whose result is not known yet.

So the instance's ``_save_checkpoint`` is wrapped (this trainer only, no
class or module patch): during the call ``args.save_total_limit`` reads
None, so the Trainer's own rotation does nothing, and right after it the
harness rotates with the same rule plus the folders it must keep (the one
just written, the last proven checkpoint, those whose check is still
running). The limit is restored before anything else can read it, and the
checkpoint's ``training_args.bin`` (written during the call) is written
again with it. A save into a folder that already holds a marker (a resume
that saves that step again) removes the marker first. Later rotations (once a
newer checkpoint is proven) run on the training thread too, through
:meth:`RotationGuard.rotate`, never from the checking thread.
"""
from __future__ import annotations

import functools
import logging
from pathlib import Path
from typing import Any, Callable, Iterable

from harness.lib.proven import forget_proof, rotate

log = logging.getLogger("harness")
ATTRIBUTE = "_harness_rotation_guard"


class RotationGuard:
    """Owns ``save_total_limit`` rotation for one trainer; ``keep()`` names the folders it must not delete."""

    def __init__(self, trainer: Any, keep: Callable[[], Iterable[Path]]) -> None:
        self.trainer = trainer
        self.keep = keep
        self.limit: int | None = None
        self.deleted: list[Path] = []
        original = trainer._save_checkpoint

        @functools.wraps(original)
        def harness_save_checkpoint(*args: Any, **kwargs: Any) -> Any:
            trainer_args = trainer.args
            current = self._current()
            if current is not None and getattr(trainer_args, "should_save", True):
                forget_proof(Path(trainer_args.output_dir), current)  # a save into a proven folder: proven again, or not
            self.limit = trainer_args.save_total_limit
            if not self.limit or self.limit <= 0:
                return original(*args, **kwargs)
            trainer_args.save_total_limit = None  # the Trainer's rotation would delete the last proven checkpoint
            try:
                result = original(*args, **kwargs)
            finally:
                trainer_args.save_total_limit = self.limit
            _resave_arguments(trainer, current)  # written inside the call, with the limit None: the script's limit again
            self.rotate(current=current)
            return result

        trainer._save_checkpoint = harness_save_checkpoint

    def _current(self) -> Path | None:
        """The folder the save in progress writes: checkpoint-<global_step> of the output dir."""
        args, state = self.trainer.args, getattr(self.trainer, "state", None)
        step = getattr(state, "global_step", None)
        return Path(args.output_dir) / f"checkpoint-{step}" if getattr(args, "output_dir", None) and step is not None else None

    def rotate(self, current: Path | None = None) -> list[Path]:
        """Rotate now (on the training thread); the main process only, as the Trainer does (``args.should_save``).

        ``current``: the folder just written, kept whatever its step (a resume from an older checkpoint writes below
        the highest step on disk).
        """
        args = self.trainer.args
        limit = args.save_total_limit
        if not limit or limit <= 0 or not getattr(args, "should_save", True):
            return []
        best = getattr(getattr(self.trainer, "state", None), "best_model_checkpoint", None)
        keep = [*self.keep(), *([Path(best)] if best else []), *([current] if current is not None else [])]
        try:
            deleted = rotate(Path(args.output_dir), limit, keep)
        except Exception as exc:  # noqa: BLE001 - a folder that cannot be deleted costs disk, never the run
            log.warning("harness: checkpoint rotation failed: %s", exc)
            return []
        self.deleted.extend(deleted)
        return deleted


def _resave_arguments(trainer: Any, checkpoint: Path | None) -> None:
    """``training_args.bin`` as the Trainer writes it (``torch.save`` of its own arguments), with the real limit."""
    path = checkpoint / "training_args.bin" if checkpoint is not None else None
    if path is None or not getattr(trainer.args, "should_save", True) or not path.is_file() or path.is_symlink():
        return
    try:
        import torch

        torch.save(trainer.args, path)
    except Exception as exc:  # noqa: BLE001 - the arguments file is a convenience, the checkpoint is complete without it
        log.warning("harness: could not rewrite %s with save_total_limit=%s: %s", path, trainer.args.save_total_limit, exc)


def install(trainer: Any, keep: Callable[[], Iterable[Path]]) -> RotationGuard:
    """The trainer's guard (made on first use; a later call only replaces ``keep``)."""
    guard: RotationGuard | None = getattr(trainer, ATTRIBUTE, None)
    if guard is None:
        guard = RotationGuard(trainer, keep)
        setattr(trainer, ATTRIBUTE, guard)
    guard.keep = keep
    return guard
