"""Which checkpoint a resume may use: the last COMPLETE one.

A kill during a save leaves a ``checkpoint-<N>`` folder that HF's
``get_last_checkpoint`` still picks (it looks at folder names only), and
``train(resume_from_checkpoint=True)`` then dies with ``FileNotFoundError``.

The rule. A checkpoint is complete for the Trainer when it holds
``trainer_state.json`` (HF writes it after the weights, optimizer, scheduler
and RNG state, so its presence means the Trainer's part of the save ended)
and the weights. The harness writes its part after that, in the Trainer's
``on_save`` callback: every rank writes ``harness_state/rank-<r>.json``
(plugin state, possibly ``{}``), runs the plugins' ``on_checkpoint_save``, and
writes ``harness_state/complete.rank-<r>`` LAST (temp name + rename), a
small JSON with the step and world size. When any checkpoint of the output
directory carries such a marker, the run is one the harness saves state
for, and a checkpoint is complete only with the markers (and state files)
of every rank of the world size it was saved with. Checkpoints of runs
saved without the harness (or before the markers existed) need only the
Trainer's part; their resume is ``RESUME_UNCHECKED``.

``resolve_last`` picks the newest complete checkpoint; when none is complete
for the harness but one is for the Trainer, it picks the newest of those
(better than refusing: the Trainer can restore it, the harness says what it
cannot check).

History lines. A resume from an older checkpoint (a rollback, a user's
``--resume_from_checkpoint checkpoint-30``) leaves the newer folders of the
history it went back from (``checkpoint-50``) beside those the resumed
attempt writes; the newest folder by name is then of the abandoned line, and
resuming from it silently discards what the resumed attempt trained. The run's
``run.json`` (``<output_dir>/harness/run.json``) records each ``train()``
call's start step and start time: a checkpoint with a step above the last
call's start step whose ``trainer_state.json`` was written before that call
started belongs to the abandoned line (:func:`abandoned_checkpoints`), and
``resolve_last`` (and ``harness resume-point``) pass it over. "Before" is
``CLOCK_SLACK_S`` before: file times of a coarse file system or a skewed file
server must not make the resumed call's own first save look older (an
abandoned save precedes a relaunch by far more). Without a readable
``run.json`` nothing is passed over for this.
"""
from __future__ import annotations

import json
import math
import os
import re
import stat
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from harness.core.received import RefusedFile, read_received_json
from harness.lib.safe_paths import safe_mkdir, safe_write_text

STATE_DIR = "harness_state"
TRAINER_STATE = "trainer_state.json"
INCOMPLETE_MARKER = "checkpoint-is-incomplete.txt"  # transformers' JIT checkpoint: there until its save finished
CHECKPOINT_RE = re.compile(r"^checkpoint-(\d+)$")
WEIGHT_FILE_RE = re.compile(r"^(model|pytorch_model|adapter_model|consolidated)([-._].*)?\.(safetensors|bin|pt)$|^.*\.safetensors(\.index\.json)?$|^pytorch_model\.bin\.index\.json$")
WEIGHT_DIR_RE = re.compile(r"^(global_step\d+|pytorch_model_fsdp_\d+|model_\d+)$")  # DeepSpeed, FSDP sharded
RUN_SUBDIR = "harness"  # <output_dir>/harness/run.json: each train() call's start step and start time
CLOCK_SLACK_S = 1.0  # a folder counts as written before a train() call only this much before its recorded start (clocks, NFS)


def marker_name(rank: int) -> str:
    return f"complete.rank-{rank}"


def state_name(rank: int) -> str:
    return f"rank-{rank}.json"


STATE_BYTES = 64 << 20  # a received checkpoint is data: a larger harness state file is not read


def read_state_file(checkpoint_dir: Path, rank: int) -> tuple[dict[str, Any], str | None]:
    """The plugin states in ``<checkpoint>/harness_state/rank-<rank>.json`` and, when they cannot be used, why not.

    A checkpoint is data (it may have been copied or received): a link, a
    file that is not a regular one or is larger than ``STATE_BYTES``, text
    that is not JSON (or nested too deep to parse), a top level that is not
    an object, and an entry that is not an object are each taken as absent,
    with the reason, never raised into the resumed training. ``({}, None)``
    when there is no such file.
    """
    path = Path(checkpoint_dir) / STATE_DIR / state_name(rank)
    try:
        data = read_received_json(path, STATE_BYTES)  # the one safe opener of received files: no link, FIFO or device
    except FileNotFoundError:
        return {}, None
    except RefusedFile as exc:
        return {}, str(exc)
    except OSError as exc:
        return {}, f"it cannot be read ({type(exc).__name__}: {exc.strerror or exc})"
    except ValueError as exc:  # not UTF-8, not JSON, or nested too deep to parse
        return {}, f"it is not JSON ({str(exc)[:80]})"
    if not isinstance(data, dict):
        return {}, f"it holds a JSON {type(data).__name__}, not an object of plugin states"
    bad = sorted(str(k) for k, v in data.items() if not isinstance(v, dict))
    states = {str(k): v for k, v in data.items() if isinstance(v, dict)}
    return states, (f"the entries of {', '.join(bad[:5])} are not JSON objects" if bad else None)


def write_state_file(checkpoint_dir: Path, name: str, text: str) -> Path:
    """Write ``<checkpoint>/harness_state/<name>`` atomically, never through a link.

    A ``harness_state`` (or a file in it) that is a symbolic link would carry
    the write outside the run directory: ``harness.lib.safe_paths.UnsafePathError`` instead.
    """
    root = Path(checkpoint_dir)
    target = root / STATE_DIR / name
    safe_mkdir(root, target.parent)
    return safe_write_text(root, target, text)


def write_marker(checkpoint_dir: Path, rank: int, world_size: int, step: int) -> None:
    """The last file of a harness save on this rank: written under a temp name, then renamed (never through a link)."""
    write_state_file(checkpoint_dir, marker_name(rank), json.dumps({"step": step, "rank": rank, "world_size": world_size}))


def drop_other_ranks(checkpoint_dir: Path, world_size: int) -> list[str]:
    """Remove the harness's state and markers of ranks at or above ``world_size`` from a checkpoint saved again.

    The Trainer saves into an existing ``checkpoint-<N>`` folder without
    clearing it: after a resume on fewer processes re-saves a step, a
    ``rank-1.json`` of the earlier, wider run would be read as this save's.
    Only the harness's own files, by exact name (a link is removed, never
    followed); the Trainer's files are the Trainer's. A ``harness_state`` that
    is a link is left alone: listing through it and unlinking there would
    delete files outside the run directory. Returns the names removed.
    """
    folder = Path(checkpoint_dir) / STATE_DIR
    pattern = re.compile(r"^(?:complete\.rank-|rank-)(\d+)(?:\.json)?$")
    removed: list[str] = []
    try:
        if not stat.S_ISDIR(os.lstat(folder).st_mode):
            return removed  # a link (never followed) or a file: nothing of the harness's to remove
        # the folder opened without following a link, then listed and unlinked through that handle: swapping it for a
        # link after the check above changes nothing
        fd = os.open(folder, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0) | getattr(os, "O_NOFOLLOW", 0))
    except OSError:
        return removed  # no state folder yet: a first save
    try:
        with os.scandir(fd) as entries:
            names = [entry.name for entry in entries if entry.is_symlink() or entry.is_file(follow_symlinks=False)]
        for name in names:
            match = pattern.match(name)
            if match is None or int(match.group(1)) < world_size:
                continue
            try:
                os.unlink(name, dir_fd=fd)
                removed.append(name)
            except OSError:
                pass
    except OSError:
        pass
    finally:
        os.close(fd)
    return removed


def set_aside(checkpoint: Path) -> Path | None:
    """Rename an incomplete ``checkpoint-<N>`` to ``incomplete-checkpoint-<N>`` (``.2``, ``.3`` ... if taken); None if it cannot be.

    Left under its name, it is still a ``checkpoint-*`` folder: the next
    ``get_last_checkpoint`` of a script without the harness picks it again,
    and transformers 4.x's ``save_total_limit`` rotation (by step number,
    ``use_mtime=False``) keeps the highest-numbered folder, so the broken one
    outlives the good checkpoints saved after the resume. Outside that
    pattern neither HF nor the harness picks it, and nothing is deleted.
    """
    checkpoint = Path(checkpoint)
    target = checkpoint.with_name(f"incomplete-{checkpoint.name}")
    n = 1
    while target.exists() or target.is_symlink():
        n += 1
        target = checkpoint.with_name(f"incomplete-{checkpoint.name}.{n}")
    try:
        os.rename(checkpoint, target)
    except OSError:
        return None
    return target


def checkpoint_step(path: Path) -> int | None:
    m = CHECKPOINT_RE.match(Path(path).name)
    return int(m.group(1)) if m else None


def _named_checkpoints(output_dir: Path) -> list[Path]:
    """Every entry of ``output_dir`` named ``checkpoint-<N>`` (whatever it is), newest step first."""
    try:
        entries = list(Path(output_dir).iterdir())
    except OSError:
        return []
    found = [(checkpoint_step(p), p) for p in entries if checkpoint_step(p) is not None]
    return [p for _, p in sorted(found, key=lambda x: x[0], reverse=True)]  # type: ignore[arg-type, return-value]


def list_checkpoints(output_dir: Path) -> list[Path]:
    """``checkpoint-<N>`` folders of ``output_dir``, newest step first; a symlink is never one.

    A run directory may be received from someone else (data, see the README): a
    ``checkpoint-<N>`` link may point anywhere, so nothing is read, resumed from
    or rotated through it. :func:`linked_checkpoints` lists those, for notes.
    """
    return [p for p in _named_checkpoints(output_dir) if not p.is_symlink() and p.is_dir()]


def linked_checkpoints(output_dir: Path) -> list[Path]:
    """The ``checkpoint-<N>`` entries of ``output_dir`` that are symlinks (to a folder or not), newest step first."""
    return [p for p in _named_checkpoints(output_dir) if p.is_symlink()]


def has_weights(checkpoint: Path) -> bool:
    try:
        entries = list(Path(checkpoint).iterdir())
    except OSError:
        return False
    return any(
        (e.is_file() and WEIGHT_FILE_RE.match(e.name)) or (e.is_dir() and WEIGHT_DIR_RE.match(e.name))
        for e in entries
    )


def harness_tracked(output_dir: Path) -> bool:
    """Whether the harness saved its state (with completion markers) into any checkpoint of ``output_dir``."""
    return any(any((c / STATE_DIR).glob("complete.rank-*")) for c in list_checkpoints(output_dir))


def trainer_missing(checkpoint: Path) -> list[str]:
    """What the Trainer needs to resume that ``checkpoint`` lacks."""
    missing = []
    if (Path(checkpoint) / INCOMPLETE_MARKER).exists():  # still saving (JIT checkpoint): HF's get_last_checkpoint, by name only, would take it
        missing.append(f"the end of its save ({INCOMPLETE_MARKER} is still there)")
    if not (Path(checkpoint) / TRAINER_STATE).is_file():
        missing.append(TRAINER_STATE)
    # a harness marker is written after the Trainer's save returned, weights included, in whatever format (a Trainer
    # subclass's own _save, FSDP's per-rank files): the name patterns are needed only for checkpoints without one
    if not has_weights(checkpoint) and not (Path(checkpoint) / STATE_DIR / marker_name(0)).is_file():
        missing.append("the weights (model.safetensors / pytorch_model.bin)")
    return missing


def harness_missing(checkpoint: Path, world_size: int) -> list[str]:
    """The harness files of ``checkpoint`` that a complete harness save writes and that are not there."""
    state = Path(checkpoint) / STATE_DIR
    world = world_size
    try:
        world = int(json.loads((state / marker_name(0)).read_text(encoding="utf-8")).get("world_size", world_size))
    except (OSError, ValueError, TypeError, AttributeError):
        pass
    missing = []
    for rank in range(max(1, world)):
        for name in (state_name(rank), marker_name(rank)):
            if not (state / name).is_file():
                missing.append(f"{STATE_DIR}/{name}")
    return missing


@dataclass(frozen=True)
class HistoryLine:
    """The history the run's last ``train()`` call continues, from ``run.json``: attempt ``attempt`` (numbered from 1, as in
    the report) started at ``start_step`` at ``started`` (``time.time()``), resumed from ``resumed_from`` (None: a fresh start)."""

    attempt: int
    start_step: int
    started: float
    resumed_from: str | None

    def describe(self) -> str:
        """``the resume from checkpoint-30 (attempt 2)``, for a note."""
        if self.resumed_from:
            return f"the resume from {Path(self.resumed_from).name} (attempt {self.attempt})"
        return f"the fresh start of attempt {self.attempt} (from step {self.start_step})"


def current_line(output_dir: Path) -> HistoryLine | None:
    """The last ``train()`` call that ``<output_dir>/harness/run.json`` records with a start step and a start time; None
    when the file is missing or unreadable or records none (a call that failed before training began records neither)."""
    from harness.lib.runinfo import read_run_info  # imported here, by the one function that reads run.json

    attempts = read_run_info(Path(output_dir) / RUN_SUBDIR)["attempts"]
    for index in range(len(attempts) - 1, -1, -1):
        attempt = attempts[index]
        start, started, resumed = attempt.get("start_step"), attempt.get("started"), attempt.get("resumed_from")
        if not isinstance(start, int) or isinstance(start, bool) or start < 0:
            continue
        if not isinstance(started, (int, float)) or isinstance(started, bool) or not math.isfinite(started):
            continue
        return HistoryLine(index + 1, start, float(started), resumed if isinstance(resumed, str) and resumed else None)
    return None


def written_at(checkpoint: Path) -> float | None:
    """When the Trainer's save of ``checkpoint`` ended: the mtime of its ``trainer_state.json`` (written last by the
    Trainer, again by a later save into the same folder); None without one (an incomplete folder, judged as such)."""
    path = Path(checkpoint) / TRAINER_STATE
    try:
        return path.stat().st_mtime if path.is_file() and not path.is_symlink() else None
    except OSError:
        return None


def abandoned_checkpoints(output_dir: Path, line: HistoryLine | None = None) -> dict[Path, str]:
    """The ``checkpoint-<N>`` folders of a history the run went back from, each with why, newest step first: a step above
    the start step of the run's last ``train()`` call (``line``; read from ``run.json`` when not given) and written before
    that call started. {} when ``run.json`` is missing or unreadable (nothing can be told: today's choice stands)."""
    line = line if line is not None else current_line(output_dir)
    if line is None:
        return {}
    found: dict[Path, str] = {}
    for checkpoint in list_checkpoints(output_dir):
        step, written = checkpoint_step(checkpoint), written_at(checkpoint)
        if step is None or step <= line.start_step or written is None or written >= line.started - CLOCK_SLACK_S:
            continue
        found[checkpoint] = f"written before {line.describe()}: a history the run went back from"
    return found


@dataclass
class Resolution:
    """The checkpoint ``resume_from_checkpoint=True`` resumes from, and the newer ones it passed over."""

    chosen: Path | None
    skipped: list[tuple[Path, list[str]]] = field(default_factory=list)  # (folder, what it lacks), newest first
    chosen_missing: list[str] = field(default_factory=list)  # harness files the chosen one lacks (a fallback)
    tracked: bool = False  # whether the output dir's checkpoints carry harness completion markers
    # (folder, why) of the newer folders of an abandoned history line (see the module doc), newest first: passed over, never
    # incomplete for that (nothing to rename or report as broken)
    abandoned: list[tuple[Path, str]] = field(default_factory=list)


def resolve_last(output_dir: Path, world_size: int = 1) -> Resolution:
    """The newest complete checkpoint of ``output_dir`` (see the module doc for "complete") of the history line the run's
    last ``train()`` call continues (see the module doc for "history lines")."""
    gone_back = abandoned_checkpoints(output_dir)
    found = _resolve_complete([c for c in list_checkpoints(output_dir) if c not in gone_back], output_dir, world_size)
    newest = checkpoint_step(found.chosen) if found.chosen is not None else None
    found.abandoned = [(c, why) for c, why in gone_back.items() if newest is None or (checkpoint_step(c) or 0) > newest]
    return found


def _resolve_complete(checkpoints: list[Path], output_dir: Path, world_size: int) -> Resolution:
    """The newest complete one of ``checkpoints`` (newest step first)."""
    tracked = harness_tracked(output_dir)
    skipped: list[tuple[Path, list[str]]] = []
    fallback: tuple[Path, list[str]] | None = None
    for checkpoint in checkpoints:
        missing = trainer_missing(checkpoint)
        harness = harness_missing(checkpoint, world_size) if tracked and not missing else []
        if not missing and not harness:
            return Resolution(checkpoint, skipped, [], tracked)
        if not missing and fallback is None:
            fallback = (checkpoint, harness)
        skipped.append((checkpoint, missing + harness))
    if fallback is not None:
        chosen, harness = fallback
        return Resolution(chosen, [s for s in skipped if s[0] != chosen and checkpoint_step(s[0]) > checkpoint_step(chosen)], harness, tracked)  # type: ignore[operator]
    return Resolution(None, skipped, [], tracked)
