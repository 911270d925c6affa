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


def write_proven(output_dir: Path, checkpoint: Path, record: dict[str, Any]) -> Path:
    """Write the marker atomically (temp name + rename), never through a link, never outside ``output_dir``."""
    body = {"format": FORMAT, **record}
    return safe_write_text(Path(output_dir), Path(checkpoint) / MARKER, json.dumps(body, indent=1, sort_keys=True))


def forget_proof(output_dir: Path, checkpoint: Path) -> None:
    """Remove ``checkpoint``'s marker before a new save into the same folder (a resume that saves that step again),
    so that a torn or corrupt second save is never taken for the proven first one. Never through a link."""
    path = Path(checkpoint) / MARKER
    if path.is_symlink() or not path.is_file():
        return
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


def read_marker(checkpoint: Path) -> tuple[dict[str, Any] | None, str | None]:
    """``(record, None)`` for a valid marker of ``checkpoint``; ``(None, None)`` when it has none; ``(None, why)`` for a
    marker that is there but is not proof (a link, a folder, not JSON, another format, another step)."""
    path = Path(checkpoint) / MARKER
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
    if record.get("format") != FORMAT:
        return None, f"its format is {_short(record.get('format'))}, not {FORMAT!r}"
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
            if path.is_symlink() or name == MARKER:
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
    output_dir = Path(output_dir)
    links = linked_checkpoints(output_dir)
    gone_back = abandoned_checkpoints(output_dir)  # {} without a readable run.json
    candidates = sorted([*list_checkpoints(output_dir), *links], key=lambda p: checkpoint_step(p) or 0, reverse=True)
    notes = []
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
            continue  # never proven (or not yet): nothing to say
        changed = changed_since_proof(checkpoint, record)
        if changed:
            more = f" (and {len(changed) - 3} more)" if len(changed) > 3 else ""
            notes.append(f"passed over {checkpoint.name}: it changed since it was proven: {'; '.join(changed[:3])}{more}")
            continue
        missing = trainer_missing(checkpoint)
        if missing:
            notes.append(f"passed over {checkpoint.name}: it was proven but lacks {', '.join(missing)} now")
            continue
        return checkpoint, notes
    return None, notes


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
