"""Plugin state beside a Trainer checkpoint, and handing it back on resume.

At every save each rank writes ``<checkpoint>/harness_state/rank-<r>.json``
(the plugins' ``checkpoint_state``), then ``on_checkpoint_save`` fires, and
last the rank's completion marker: a checkpoint is complete for the harness
only with every rank's marker (see :mod:`harness.lib.checkpoints`). On
resume the state goes to each plugin's ``on_resume``. ``resume_from_checkpoint
=True`` is resolved here to the last COMPLETE checkpoint, with a
``CHECKPOINT_INCOMPLETE`` finding per newer folder passed over; so is the
path of the newest folder when a kill left it incomplete (what a script's own
``get_last_checkpoint`` names). Any other incomplete checkpoint named is
refused before the first step, with the fix.
"""
from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

from harness.core.codes import CHECKPOINT_INCOMPLETE, HARNESS_STATE_NOT_SAVED
from harness.core.context import RunContext
from harness.core.errors import NoCompleteCheckpointError
from harness.lib import checkpoints
from harness.hf.run_dir_recovery import recover_run_dir
from harness.lib.safe_paths import UnsafePathError

log = logging.getLogger("harness")
STATE_DIR = checkpoints.STATE_DIR



class CheckpointState:
    """Saves the plugins' state with each checkpoint and dispatches it back on resume."""

    def __init__(self, ctx: RunContext, trainer: Any) -> None:
        self.ctx = ctx
        self.trainer = trainer

    # -- save ------------------------------------------------------------------------------------------

    def save(self, step: int) -> None:
        ctx, manager = self.ctx, self.ctx.manager
        recover_run_dir(ctx)  # a run directory deleted since the last save is made again before anything is written there
        checkpoint_dir = Path(self.trainer.args.output_dir) / f"checkpoint-{step}"
        states: dict[str, str] = {}
        for name in manager.names:
            value = manager.hooks.checkpoint_state(name, ctx, step)
            if value is None:
                continue
            try:
                states[name] = json.dumps(value)
            except (TypeError, ValueError) as exc:  # the plugin's state, not the checkpoint, is lost
                manager.record_error(name, "checkpoint_state", exc)
        if ctx.is_main:  # a folder saved again by fewer processes: the wider run's ranks must not pass for this save's
            stale = checkpoints.drop_other_ranks(checkpoint_dir, ctx.world_size)
            if stale:
                log.info("harness: %s was saved before by more processes; removed their harness state %s", checkpoint_dir, stale)
        # written even when empty: with the marker below it tells a finished harness save from an interrupted one
        target = checkpoint_dir / STATE_DIR / f"rank-{ctx.rank}.json"
        written = False
        text = "{" + ", ".join(f"{json.dumps(k)}: {v}" for k, v in states.items()) + "}"
        try:  # never through a link: a harness_state that is one would carry the write outside the run directory
            checkpoints.write_state_file(checkpoint_dir, target.name, text)
            written = True
        except (OSError, UnsafePathError) as exc:
            self._not_saved(step, checkpoint_dir, f"its plugin state {target.relative_to(checkpoint_dir)}", exc)
        manager.hooks.on_checkpoint_save(ctx, step, checkpoint_dir)
        if written:  # last: a checkpoint is complete for the harness only with every rank's marker
            try:
                checkpoints.write_marker(checkpoint_dir, ctx.rank, ctx.world_size, step)
            except (OSError, UnsafePathError) as exc:
                self._not_saved(step, checkpoint_dir, "its completion marker", exc)

    def _not_saved(self, step: int, checkpoint_dir: Path, what: str, exc: BaseException) -> None:
        """A harness part of a save that could not be written: said as a finding (the proof then waits for no marker of
        this rank's: it knows none will come). The Trainer's own files are the Trainer's: its save went on."""
        errno = getattr(exc, "errno", None)
        reason = f"{type(exc).__name__}{f' [Errno {errno}]' if errno else ''}: {getattr(exc, 'strerror', None) or exc}"
        self.ctx.unsaved_states[step] = f"rank {self.ctx.rank} could not write {what} ({reason})"
        self.ctx.report(
            HARNESS_STATE_NOT_SAVED.code,
            f"the harness could not write {what} into {checkpoint_dir.name} ({reason}): the Trainer's checkpoint was saved, "
            "but a resume from it is not verified (resume_check has nothing to compare with) and the harness does not count "
            "it complete. Free space or fix the folder's permissions; the next save writes it again.",
            step=step, plugin="harness",
            evidence={"checkpoint": str(checkpoint_dir), "what": what, "errno": errno, "error": str(exc)[:300]},
        )

    # -- resume ----------------------------------------------------------------------------------------

    def dispatch_resume(self) -> None:
        """At train begin of a resumed run: each plugin's ``on_resume`` with the state it stored (or None)."""
        ctx = self.ctx
        if ctx.resumed_from is None:
            return
        states = read_state(ctx.resumed_from, ctx.rank)
        for name in ctx.manager.names:
            ctx.manager.hooks.on_resume(name, ctx, ctx.resumed_from, states.get(name))

    def resume_dir(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[tuple[Any, ...], dict[str, Any], Path | None]:
        """The checkpoint this train() call resumes from, and its arguments with ``True``/``"last"`` made that path.

        HF's ``resume_from_checkpoint=True`` takes the highest-numbered folder,
        complete or not (a kill during a save leaves one without
        ``trainer_state.json``, and the resume dies with ``FileNotFoundError``).
        The harness resolves it to the last complete checkpoint itself (see
        ``harness.lib.checkpoints``) and hands the real ``train()`` that path.
        """
        positional = bool(args)
        resume = args[0] if positional else kwargs.get("resume_from_checkpoint")
        if resume is None or resume is False:
            return args, kwargs, None
        if resume is True or (isinstance(resume, str) and resume.strip().lower() == "last"):
            chosen = self.resolve_last()
        else:
            named = Path(resume)
            judged, missing = self._judge_named(named)
            if judged == "complete or absent":
                return args, kwargs, named  # resumed as asked (a wrong name: HF's own error)
            if judged == "incomplete":
                raise NoCompleteCheckpointError(
                    f"resume_from_checkpoint={named}: that checkpoint is incomplete: it lacks {', '.join(missing)} (a save "
                    "interrupted by a kill, a crash or a full disk). Fix: resume from the last complete checkpoint "
                    f"(`harness resume-point {named.parent}` prints it), or pass resume_from_checkpoint=True and the "
                    "harness resumes from it."
                )
            # a script that resumes by itself (HF's run_clm: get_last_checkpoint) names the newest folder, which a kill
            # during its save left incomplete: the Trainer would die on it at every rerun of the same command
            if judged == "set aside" and self.ctx.is_main:
                log.warning("harness: %s was set aside as incomplete (incomplete-%s); resuming from the last complete "
                            "checkpoint instead", named, named.name)
            chosen = self.resolve_last(asked=f"resume_from_checkpoint={named.name} (the newest checkpoint folder)")
        value: Any = str(chosen) if chosen is not None else True  # no checkpoint at all: HF's own error
        if positional:
            args = (value, *args[1:])
        else:
            kwargs = {**kwargs, "resume_from_checkpoint": value}
        return args, kwargs, chosen

    def _judge_named(self, named: Path) -> tuple[str, list[str]]:
        """A checkpoint named by its path: "complete or absent"; "incomplete" (and what it lacks); "newest" (the output
        dir's newest folder, incomplete); or "set aside" (rank 0 renamed it incomplete-<name>, in this call or an earlier
        one). Every rank judges alike whenever rank 0's rename happens: each ends with the same checkpoint, or all refuse."""
        aside = named.with_name(f"incomplete-{named.name}")
        output_dir = Path(self.trainer.args.output_dir)
        try:  # a folder of this run's output dir: the only one the harness resolves (and renames in)
            is_checkpoint = checkpoints.checkpoint_step(named) is not None and named.parent.resolve() == output_dir.resolve()
        except OSError:
            is_checkpoint = False
        if named.is_dir():
            missing = checkpoints.trainer_missing(named)
            if not missing:
                return "complete or absent", []
            newest = checkpoints.list_checkpoints(output_dir)
            try:
                if is_checkpoint and newest and newest[0].resolve() == named.resolve():
                    return "newest", missing
            except OSError:
                pass
            if is_checkpoint and not named.is_dir() and aside.is_dir():
                return "set aside", missing  # renamed by rank 0 between the two looks
            return "incomplete", missing
        if is_checkpoint and aside.is_dir():
            return "set aside", []
        return "complete or absent", []

    def resolve_last(self, asked: str = "resume_from_checkpoint=True") -> Path | None:
        """The last complete checkpoint of the output dir; a ``CHECKPOINT_INCOMPLETE`` finding per newer folder passed over
        (``asked``: what the train() call asked for, in the findings' and the error's words)."""
        ctx = self.ctx
        output_dir = Path(self.trainer.args.output_dir)
        found = checkpoints.resolve_last(output_dir, ctx.world_size)
        chosen = found.chosen
        if ctx.is_main:
            for folder, why in found.abandoned:  # kept as they are (no finding, no rename): a history gone back from is no damage
                log.warning("harness: %s passed over %s: %s.", asked, folder.name, why)
            for folder, missing in found.skipped:
                # set aside only when resuming from an older one: save_total_limit would keep it and rotate the good ones away
                moved = checkpoints.set_aside(folder) if chosen is not None else None
                ctx.report(
                    CHECKPOINT_INCOMPLETE.code,
                    f"{folder.name} is incomplete: it lacks {', '.join(missing)} (a save interrupted by a kill, a crash or a "
                    "full disk); "
                    + (f"{asked} resumes from {chosen.name} instead." if chosen is not None
                       else "no complete checkpoint is left to resume from.")
                    + (f" It was renamed {moved.name} (kept, outside the checkpoint-* names that the Trainer resumes from and "
                       "rotates)." if moved is not None else ""),
                    step=checkpoints.checkpoint_step(folder),
                    evidence={"checkpoint": str(folder), "missing": missing, "resumed_from": str(chosen) if chosen else None,
                              "renamed_to": str(moved) if moved is not None else None},
                    plugin="harness",
                )
            if chosen is not None and found.chosen_missing:
                ctx.report(
                    CHECKPOINT_INCOMPLETE.code,
                    f"{chosen.name} lacks {', '.join(found.chosen_missing)} (the harness's part of the save did not finish) and no "
                    "older checkpoint is complete: resuming from it anyway; the checks that need the harness state are skipped.",
                    step=checkpoints.checkpoint_step(chosen),
                    evidence={"checkpoint": str(chosen), "missing": found.chosen_missing, "resumed_from": str(chosen)},
                    plugin="harness",
                )
        if chosen is None and found.skipped:
            lacks = "; ".join(f"{p.name} lacks {', '.join(m)}" for p, m in found.skipped[:5])
            raise NoCompleteCheckpointError(
                f"{asked}: no complete checkpoint in {output_dir} ({lacks}). Every save there was "
                "interrupted before the Trainer finished it. Fix: name a checkpoint to resume from, or start without "
                "resume_from_checkpoint (the incomplete folders can be deleted)."
            )
        return chosen


def read_state(checkpoint_dir: Path, rank: int) -> dict[str, Any]:
    """This rank's stored plugin states of ``checkpoint_dir`` ({} when absent; what cannot be used is said and left out)."""
    states, problem = checkpoints.read_state_file(checkpoint_dir, rank)
    if problem is not None:
        log.warning("harness: the plugin state %s cannot be used (%s); the plugins resume without it",
                    Path(checkpoint_dir) / STATE_DIR / checkpoints.state_name(rank), problem)
    return states
