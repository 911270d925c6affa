"""A weights file cut short right after a save, for tests of ``checkpoint_proof`` (a full disk, a killed copy)."""
from __future__ import annotations

import os
from pathlib import Path

WEIGHTS = ("model.safetensors", "pytorch_model.bin", "adapter_model.safetensors")


def truncate_weights(checkpoint_dir: Path, keep_fraction: float = 0.5) -> Path | None:
    """Cut the checkpoint's first weights file (or first shard) to ``keep_fraction`` of its size; the file cut, or None."""
    folder = Path(checkpoint_dir)
    candidates = [folder / name for name in WEIGHTS] + sorted(folder.glob("model-*-of-*.safetensors"))
    target = next((p for p in candidates if p.is_file() and not p.is_symlink()), None)
    if target is None:
        return None
    size = target.stat().st_size
    with open(target, "r+b") as handle:
        handle.truncate(int(size * keep_fraction))
        os.fsync(handle.fileno())
    return target
