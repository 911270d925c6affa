"""``harness_proven``: the marker of a checkpoint whose files were read back and checked, and rotation that keeps one.

``checkpoint_proof`` writes ``<checkpoint>/harness_proven`` (JSON: step, the
reference loss at save and from disk, the checks passed, seconds, and the
size of every file it held) once a checkpoint passed every check that could
run. A checkpoint that lost or changed a file since is no longer taken as
proven. ``newest_proven`` is what
``harness resume-point`` prints: the newest proven checkpoint of the history
line the run's last ``train()`` call continues (a newer folder left by a
history the run went back from, by a rollback or a resume from an older
checkpoint, is passed over: ``checkpoints.abandoned_checkpoints``).
``rotate`` is transformers' ``save_total_limit`` rotation (oldest step first, the newest always kept) with more folders kept
(the last proven one, those still being checked), so that the only
checkpoint known to be good is never the one deleted.

``harness_checked`` (the same record, with ``not_proven``: why) marks a
checkpoint whose proof could not be made but which is complete with
readable, finite weights (a model above ``max_model_mb``, no batch the model
accepts, a model whose saved format cannot be built from its config; never a
file of another model's names, which is corrupt). It is never taken as proven; with no proven
checkpoint, ``resume_candidate`` falls back to the newest such one and says
so in a note: a checkpoint the Trainer would resume is named, never refused
for what the harness could not check.
"""
from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any, Iterable

from harness.lib.checkpoints import abandoned_checkpoints, checkpoint_step, linked_checkpoints, list_checkpoints, trainer_missing
from harness.lib.safe_paths import safe_rmtree, safe_target, safe_write_text

MARKER = "harness_proven"
FORMAT = "train-harness-proven/1"
CHECKED = "harness_checked"  # complete with readable, finite weights; the proof could not be made (why: ``not_proven``)
CHECKED_FORMAT = "train-harness-checked/1"


def write_proven(output_dir: Path, checkpoint: Path, record: dict[str, Any]) -> Path:
    """Write the marker atomically (temp name + rename), never through a link, never outside ``output_dir``."""
    body = {"format": FORMAT, **record}
    return safe_write_text(Path(output_dir), Path(checkpoint) / MARKER, json.dumps(body, indent=1, sort_keys=True))


def write_checked(output_dir: Path, checkpoint: Path, record: dict[str, Any]) -> Path:
    """Write ``harness_checked`` as :func:`write_proven` writes its marker."""
    body = {"format": CHECKED_FORMAT, **record}
    return safe_write_text(Path(output_dir), Path(checkpoint) / CHECKED, json.dumps(body, indent=1, sort_keys=True))


def forget_proof(output_dir: Path, checkpoint: Path) -> None:
    """Remove ``checkpoint``'s markers before a new save into the same folder (a resume that saves that step again),
    so that a torn or corrupt second save is never taken for the proven first one. Never through a link."""
    for name in (MARKER, CHECKED):
        path = Path(checkpoint) / name
        if path.is_symlink() or not path.is_file():
            continue
        try:
            safe_target(Path(output_dir), path).unlink()
        except (OSError, ValueError):
            pass


def _short(value: Any, limit: int = 80, quoted: bool = True) -> str:
    """``value`` from a received file, for a message: its repr (control characters escaped; a string without its quotes
    when not ``quoted``), cut at ``limit`` characters."""
    text = repr(value)
    if not quoted and isinstance(value, str):
        text = text[1:-1]
    return text if len(text) <= limit else text[: limit - 3] + "..."


def read_marker(checkpoint: Path, name: str = MARKER) -> tuple[dict[str, Any] | None, str | None]:
    """``(record, None)`` for a valid marker of ``checkpoint``; ``(None, None)`` when it has none; ``(None, why)`` for a
    marker that is there but is not proof (a link, a folder, not JSON, another format, another step). ``name``: the
    proof (``harness_proven``) or the fallback (``harness_checked``)."""
    path = Path(checkpoint) / name
    if path.is_symlink():
        return None, "it is a symbolic link; nothing is read through a link"
    if not path.exists():
        return None, None
    if path.is_dir():
        return None, "it is a folder, not a file"
    if not path.is_file():
        return None, "it is not a regular file"
    try:
        record = json.loads(path.read_text(encoding="utf-8"))
    except OSError as e:
        return None, f"{e.strerror or type(e).__name__}"
    except ValueError as e:  # json.JSONDecodeError, UnicodeDecodeError
        return None, f"not JSON: {_short(str(e), quoted=False)}"
    if not isinstance(record, dict):
        return None, f"not a JSON object but {type(record).__name__}"
    wanted = CHECKED_FORMAT if name == CHECKED else FORMAT
    if record.get("format") != wanted:
        return None, f"its format is {_short(record.get('format'))}, not {wanted!r}"
    step = checkpoint_step(Path(checkpoint))
    if record.get("step") != step:
        return None, f"it names step {_short(record.get('step'))}, the folder is step {step}"
    return record, None


def read_proven(checkpoint: Path) -> dict[str, Any] | None:
    """The marker of ``checkpoint`` when it is a regular file of this format naming the folder's step; else None."""
    return read_marker(checkpoint)[0]


def file_manifest(checkpoint: Path) -> dict[str, int]:
    """Every regular file of ``checkpoint`` (links not followed) and its size, the marker itself left out: what the proof
    read, so that a later look can tell a checkpoint that lost or changed a file since (a cleanup, a copy cut short)."""
    checkpoint = Path(checkpoint)
    found: dict[str, int] = {}
    for root, dirs, names in os.walk(checkpoint, followlinks=False):
        dirs[:] = [d for d in dirs if not (Path(root) / d).is_symlink()]
        for name in names:
            path = Path(root) / name
            if path.is_symlink() or name in (MARKER, CHECKED):
                continue
            try:
                found[path.relative_to(checkpoint).as_posix()] = path.stat().st_size
            except OSError:
                continue
    return found


def changed_since_proof(checkpoint: Path, record: dict[str, Any]) -> list[str]:
    """The files of the proof's manifest that are gone or have another size now (a marker without a manifest: none)."""
    manifest = record.get("files")
    if not isinstance(manifest, dict):
        return []
    changed = []
    for name, size in manifest.items():
        path = Path(checkpoint) / str(name)
        try:
            now = path.stat().st_size if path.is_file() and not path.is_symlink() else None
        except OSError:
            now = None
        if now is None:
            changed.append(f"{name} is missing")
        elif now != size:
            changed.append(f"{name} is {now} bytes, {size} when proven")
    return changed


def newest_proven_noting(output_dir: Path) -> tuple[Path | None, list[str]]:
    """:func:`newest_proven`, and a line for each newer checkpoint passed over for a reason a user would not guess: a
    ``checkpoint-<N>`` that is a symlink (never read or used: a received run directory is data), a proof marker that is
    there but broken, a proven checkpoint that changed or lost Trainer files since, one of a history the run went back
    from (written before the run's last ``train()`` call resumed from an older step; see ``run.json``). One without a marker
    is not noted."""
    return _newest_noting(output_dir, fallback=False)


def resume_candidate(output_dir: Path) -> tuple[Path | None, list[str]]:
    """What ``harness resume-point`` names: :func:`newest_proven_noting`'s choice; with no proven checkpoint, the newest
    one marked ``harness_checked`` (complete, weights finite, the proof could not be made), with a note saying so. A
    newer checked one passed over for an older proven one is noted too."""
    return _newest_noting(output_dir, fallback=True)


def _checked_note(checkpoint: Path, record: dict[str, Any]) -> str:
    checks = ", ".join(str(c) for c in record.get("checks") or []) or "none"
    return f"{checkpoint.name} is not proven ({_short(record.get('not_proven'), 300, quoted=False)}); checks passed: {checks}"


def _newest_noting(output_dir: Path, fallback: bool) -> tuple[Path | None, list[str]]:
    output_dir = Path(output_dir)
    links = linked_checkpoints(output_dir)
    gone_back = abandoned_checkpoints(output_dir)  # {} without a readable run.json
    candidates = sorted([*list_checkpoints(output_dir), *links], key=lambda p: checkpoint_step(p) or 0, reverse=True)
    notes: list[str] = []
    checked: tuple[Path, dict[str, Any]] | None = None  # the newest harness_checked one met so far (fallback only)
    for checkpoint in candidates:
        if checkpoint in links:
            try:
                target = f" (-> {_short(os.readlink(checkpoint), quoted=False)})"
            except OSError:
                target = ""
            notes.append(f"passed over {checkpoint.name}: it is a symbolic link{target}; a checkpoint is never read or "
                         "used through a link (replace it with a real folder to resume from it)")
            continue
        if checkpoint in gone_back:  # proven or not: resuming from it would discard what the run trained since
            notes.append(f"passed over {checkpoint.name}: {gone_back[checkpoint]}")
            continue
        record, problem = read_marker(checkpoint)
        if problem is not None:
            notes.append(f"passed over {checkpoint.name}: its proof marker {MARKER} could not be read ({problem})")
            continue
        if record is None:
            if fallback and checked is None:
                checked = _usable_checked(checkpoint, notes)
            continue  # never proven (or not yet): nothing to say
        if not _still_as_checked(checkpoint, record, "proven", notes):
            continue
        if checked is not None:
            notes.append(f"passed over {checked[0].name} for the proven {checkpoint.name}: {_checked_note(*checked)}")
        return checkpoint, notes + _warnings(checkpoint, record, fallback)
    if checked is not None:
        notes.append(f"{_checked_note(*checked)}; named because it is complete and its weights load with finite values, "
                     "and no checkpoint is proven")
        return checked[0], notes + _warnings(*checked, fallback)
    return None, notes


def _warnings(checkpoint: Path, record: dict[str, Any], shown: bool) -> list[str]:
    """What the proof found about resuming from ``checkpoint`` (its files are good; the Trainer's loader may not be)."""
    warning = record.get("resume_warning")
    return [f"warning: {checkpoint.name} is good, but {_short(warning, 900, quoted=False)}"] if shown and warning else []


def _usable_checked(checkpoint: Path, notes: list[str]) -> tuple[Path, dict[str, Any]] | None:
    """``checkpoint`` and its ``harness_checked`` record when that marker is valid and its files are as checked."""
    record, problem = read_marker(checkpoint, CHECKED)
    if problem is not None:
        notes.append(f"passed over {checkpoint.name}: its marker {CHECKED} could not be read ({problem})")
        return None
    if record is None or not _still_as_checked(checkpoint, record, "checked", notes):
        return None
    return checkpoint, record


def _still_as_checked(checkpoint: Path, record: dict[str, Any], what: str, notes: list[str]) -> bool:
    """Whether ``checkpoint`` still holds the files its marker recorded and what the Trainer needs; else a note."""
    changed = changed_since_proof(checkpoint, record)
    if changed:
        more = f" (and {len(changed) - 3} more)" if len(changed) > 3 else ""
        notes.append(f"passed over {checkpoint.name}: it changed since it was {what}: {'; '.join(changed[:3])}{more}")
        return False
    missing = trainer_missing(checkpoint)
    if missing:
        notes.append(f"passed over {checkpoint.name}: it was {what} but lacks {', '.join(missing)} now")
        return False
    return True


def newest_proven(output_dir: Path) -> Path | None:
    """The highest-step ``checkpoint-<N>`` of ``output_dir`` with a valid marker whose files are still those proven, of the
    run's current history line."""
    return newest_proven_noting(output_dir)[0]


def rotate(output_dir: Path, limit: int | None, keep: Iterable[Path]) -> list[Path]:
    """Delete the oldest ``checkpoint-<N>`` folders beyond ``limit``, never the newest nor any in ``keep``; the deleted."""
    if not limit or limit <= 0:
        return []
    checkpoints = list(reversed(list_checkpoints(Path(output_dir))))  # oldest first, by step (not mtime: no clock games)
    if len(checkpoints) <= limit:
        return []
    existing = {str(c.resolve()) for c in checkpoints}
    protected = {str(Path(p).resolve()) for p in keep if p is not None} & existing
    protected.add(str(checkpoints[-1].resolve()))
    remaining, deleted = len(checkpoints), []
    for checkpoint in checkpoints:
        if remaining <= max(limit, len(protected)):
            break
        if str(checkpoint.resolve()) in protected:
            continue
        safe_rmtree(Path(output_dir), checkpoint)
        deleted.append(checkpoint)
        remaining -= 1
    return deleted
