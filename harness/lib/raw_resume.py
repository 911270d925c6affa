"""Weights that transformers' Trainer resume never set: a checkpoint in the saved format, loaded by its raw names.

transformers 5 writes a model in its *saved format* (``save_pretrained``
reverts the conversions it applies at load: a Qwen3-MoE's fused
``experts.gate_up_proj`` is written per expert), and only ``from_pretrained``
converts it back. ``Trainer._load_from_checkpoint`` (5.x) loads the weights
file with ``load_state_dict(strict=False)`` by the names as saved: a tensor
of the model that the file holds under another name is left as it was before
the resume, and transformers only logs "missing keys". Both the checkpoint
proof (before any resume) and resume_check (after one) tell this with the
words below, so the advice reads the same wherever it is shown.

The file is data: only its safetensors header is read (names and shapes, no
tensor); the layouts come from :mod:`harness.lib.checkpoint_layout`
(transformers' own ``save_pretrained`` steps on the model's class from
memory, never a class the checkpoint names).
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from harness.lib.checkpoint_layout import layout_problems, memory_layout, missing_names, saved_layout

RAW_LOAD = ("by their saved names (load_state_dict, strict=False), without the key conversion from_pretrained applies "
            "(transformers 5 saves MoE experts per expert)")


def fix(folder: str) -> str:
    """What makes such a resume restore every tensor, for the checkpoint folder named ``folder``."""
    return (f"build the model with from_pretrained(<the {folder} folder>) before train(resume_from_checkpoint=...), "
            "or use a transformers whose Trainer converts the keys on resume")


def resumes_by_saved_names(trainer: Any) -> bool:
    """Whether ``trainer`` resumes weights with transformers.Trainer's own loader (names as saved, no conversion); a
    SentenceTransformerTrainer loads its checkpoints its own way, and DeepSpeed and FSDP load through their engines."""
    try:
        from transformers import Trainer
    except ImportError:
        return False
    if getattr(trainer, "is_deepspeed_enabled", False) or getattr(trainer, "is_fsdp_enabled", False):
        return False
    return getattr(type(trainer), "_load_from_checkpoint", None) is getattr(Trainer, "_load_from_checkpoint", object())


def header_shapes(folder: Path) -> dict[str, tuple[int, ...]] | None:
    """name -> shape of every tensor in ``folder``'s safetensors weights (shards included), read from the headers alone;
    None when the weights are not all safetensors or a header does not read."""
    from safetensors import safe_open

    from harness.lib.checkpoint_verify import weight_files

    files, _ = weight_files(Path(folder))
    if not files or not all(name.endswith(".safetensors") for name in files):
        return None
    shapes: dict[str, tuple[int, ...]] = {}
    try:
        for name in files:
            with safe_open(str(Path(folder) / name), framework="pt", device="cpu") as handle:
                for key in handle.keys():  # noqa: SIM118 - safe_open is not a mapping
                    shapes[key] = tuple(handle.get_slice(key).get_shape())
    except Exception:  # noqa: BLE001 - a header that does not read: nothing is claimed about it
        return None
    return shapes


@dataclass(frozen=True)
class RawLoadGap:
    """Tensors that differ after a resume because the Trainer's raw-name load never set them."""

    file: str  # the weights file as the checkpoint holds it ("model.safetensors", or "model.safetensors.index.json")
    not_loaded: list[str]  # the differing tensors the file holds under other names only

    def cause(self, folder: str, differing: list[str], other_cause: str) -> str:
        """Why ``differing`` differ after resuming from ``folder``: these tensors were never loaded (the fix named); any
        others the file does hold by name differ for ``other_cause``."""
        count = len(self.not_loaded)
        which = f"all {count}" if count == len(differing) else f"{count} of them (e.g. {', '.join(self.not_loaded[:3])})"
        text = (f"{which} kept the values they had before the resume: the Trainer's own resume loads {folder}'s tensors "
                f"{RAW_LOAD}, and {self.file} holds these under other names only. Fix: {fix(folder)}.")
        rest = [name for name in differing if name not in self.not_loaded]
        if rest:
            text += (f" {len(rest)} more tensor(s) differ though {self.file} holds them by name (first: {', '.join(rest[:3])}): "
                     f"{other_cause}")
        return text

    def evidence(self) -> dict[str, Any]:
        return {"cause": "raw_name_resume", "not_loaded": self.not_loaded[:50], "not_loaded_count": len(self.not_loaded),
                "weights_file": self.file}


def raw_load_gap(checkpoint: Path, trainer: Any, differing: list[str]) -> RawLoadGap | None:
    """Which of ``differing`` (weight names that changed across a resume) the Trainer's raw-name load could not set,
    when ``checkpoint``'s weights are a complete file of transformers' saved format; None when that is not the cause
    (another loader, a file of the model's own names, a damaged file, or names of another model). Never raises: the
    mismatch is reported whatever this finds."""
    try:
        return _raw_load_gap(Path(checkpoint), trainer, differing)
    except Exception:  # noqa: BLE001 - a model or file this cannot read: the mismatch keeps its generic cause
        return None


def _raw_load_gap(checkpoint: Path, trainer: Any, differing: list[str]) -> RawLoadGap | None:
    from harness.lib.checkpoint_target import find_target
    from harness.lib.checkpoint_verify import SAFE_INDEX, expected_shapes, weight_files

    if not differing or not resumes_by_saved_names(trainer):
        return None
    target, module, _ = find_target(trainer.model)
    if target is None or target.kind != "model" or target.prefix or module is None:
        return None  # an adapter, or a wrapper: loaded another way, or not by these names
    shapes = header_shapes(checkpoint)
    if not shapes:
        return None
    own = memory_layout(expected_shapes(module))
    gaps = set(missing_names(shapes, own))
    not_loaded = [name for name in differing if name in gaps]
    if not not_loaded:
        return None
    saved = saved_layout(target.model_class, target.config)
    if saved is None:
        return None
    files, _ = weight_files(checkpoint)
    file = files[0] if len(files) == 1 else SAFE_INDEX
    problems, not_comparable = layout_problems(shapes, [own, saved], file)
    if problems or not_comparable or missing_names(shapes, saved):
        return None  # the file lacks tensors of its layout, or is another model's: the Trainer's loader is not the cause
    return RawLoadGap(file, not_loaded)
