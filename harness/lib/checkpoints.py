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
"""
from __future__ import annotations

import json
import os
import re
from dataclasses import dataclass, field
from pathlib import Path

STATE_DIR = "harness_state"
TRAINER_STATE = "trainer_state.json"
INCOMPLETE_MARKER = "checkpoint-is-incomplete.txt"  # transformers' JIT checkpoint: there until its save finished
CHECKPOINT_RE = re.compile(r"^checkpoint-(\d+)$")
WEIGHT_FILE_RE = re.compile(r"^(model|pytorch_model|adapter_model|consolidated)([-._].*)?\.(safetensors|bin|pt)$|^.*\.safetensors(\.index\.json)?$|^pytorch_model\.bin\.index\.json$")
WEIGHT_DIR_RE = re.compile(r"^(global_step\d+|pytorch_model_fsdp_\d+|model_\d+)$")  # DeepSpeed, FSDP sharded


def marker_name(rank: int) -> str:
    return f"complete.rank-{rank}"


def state_name(rank: int) -> str:
    return f"rank-{rank}.json"


def write_marker(checkpoint_dir: Path, rank: int, world_size: int, step: int) -> None:
    """The last file of a harness save on this rank: written under a temp name, then renamed."""
    target = Path(checkpoint_dir) / STATE_DIR / marker_name(rank)
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = target.with_name(target.name + ".tmp")
    tmp.write_text(json.dumps({"step": step, "rank": rank, "world_size": world_size}), encoding="utf-8")
    os.replace(tmp, target)


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


@dataclass
class Resolution:
    """The checkpoint ``resume_from_checkpoint=True`` resumes from, and the newer ones it passed over."""

    chosen: Path | None
    skipped: list[tuple[Path, list[str]]] = field(default_factory=list)  # (folder, what it lacks), newest first
    chosen_missing: list[str] = field(default_factory=list)  # harness files the chosen one lacks (a fallback)
    tracked: bool = False  # whether the output dir's checkpoints carry harness completion markers


def resolve_last(output_dir: Path, world_size: int = 1) -> Resolution:
    """The newest complete checkpoint of ``output_dir`` (see the module doc for "complete")."""
    checkpoints = list_checkpoints(output_dir)
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
