"""Writing into a run directory that came from someone else: never through a symlink, never outside it.

A run directory is data (a tarball from a colleague, a copy from a cluster).
Any folder or file in it may be a symlink planted to make a rebuild delete or
overwrite something else. Every write and delete the offline commands make
goes through :func:`safe_target`: each component from the root down must not
be a symlink, and the resolved path must stay inside the root.
"""
from __future__ import annotations

import contextlib
import os
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import BinaryIO

from harness.core.errors import HarnessError


class UnsafePathError(HarnessError):
    """A write or delete would go through a symlink, or out of the run directory."""


def safe_target(root: Path, path: Path) -> Path:
    """``path`` (inside ``root``) after checking that neither ``root`` nor any component below it is a symlink.

    ``root`` itself is checked too (``<output_dir>/harness`` as a symlink is
    refused); what lies above it is the user's own choice. Components that do
    not exist yet are fine (they will be created as plain folders/files).
    """
    root, path = Path(root), Path(path)
    try:
        relative = path.relative_to(root)
    except ValueError:
        raise UnsafePathError(f"refusing to write '{path}': it is outside the run directory '{root}'.") from None
    if ".." in relative.parts:
        raise UnsafePathError(f"refusing to write '{path}': it leaves the run directory '{root}' ('..').")
    current = root
    for part in ("",) + relative.parts:
        current = current / part if part else current
        if current.is_symlink():
            raise UnsafePathError(
                f"refusing to write through the symlink '{current}' (-> {os.readlink(current)}): a run directory is data, and "
                "nothing is written or deleted through a link in it. Fix: replace the link with a real folder/file, "
                "or write the report elsewhere with `harness report --out DIR`."
            )
        if not current.exists():
            break  # below a missing component nothing exists yet, so nothing below can be a link
    resolved_root, resolved = root.resolve(), path.resolve()
    if resolved != resolved_root and not resolved.is_relative_to(resolved_root):
        raise UnsafePathError(f"refusing to write '{path}': it resolves to '{resolved}', outside the run directory '{root}'.")
    return path


def safe_mkdir(root: Path, path: Path) -> Path:
    path = safe_target(root, path)
    path.mkdir(parents=True, exist_ok=True)
    return safe_target(root, path)


def safe_rmtree(root: Path, path: Path) -> None:
    """Delete the folder ``path`` (missing is fine); a symlink on the way or inside is never followed."""
    path = safe_target(root, path)
    if path.exists():
        shutil.rmtree(path)  # rmtree itself never follows links inside the tree (it unlinks them)


def safe_write_bytes(root: Path, path: Path, data: bytes) -> Path:
    """Write ``path`` atomically: a new temporary file (never an existing one, never a link) renamed over it."""
    with safe_open_write(root, path, make_parent=False) as handle:
        handle.write(data)
    return safe_target(root, path)


def safe_write_text(root: Path, path: Path, text: str) -> Path:
    return safe_write_bytes(root, path, text.encode("utf-8"))


@contextlib.contextmanager
def safe_open_write(root: Path, path: Path, make_parent: bool = True) -> Iterator[BinaryIO]:
    """Write ``path`` atomically, streamed: a new temporary file (never an existing one, never a link) renamed over
    ``path`` at the end; its folder is made first (``make_parent``) or must exist and be no link."""
    path = safe_target(root, path)
    if make_parent:
        safe_mkdir(root, path.parent)
    else:
        safe_target(root, path.parent)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_BINARY", 0)
    if tmp.is_symlink() or tmp.exists():
        tmp.unlink()
    try:
        with os.fdopen(os.open(tmp, flags, 0o644), "wb") as handle:
            yield handle
        safe_target(root, path)
        os.replace(tmp, path)
    except BaseException:
        try:
            tmp.unlink()
        except OSError:
            pass
        raise


__all__ = ["UnsafePathError", "safe_mkdir", "safe_open_write", "safe_rmtree", "safe_target", "safe_write_bytes",
           "safe_write_text"]
