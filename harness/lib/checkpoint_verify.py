"""Is a checkpoint folder what a resume needs? Completeness and readable, finite weights, read from disk alone.

A save can end early (a kill, a full disk, a preempted node) or write a file
that does not read back (a truncated shard), and nobody notices until the
resume, after ``save_total_limit`` rotated the good checkpoints away. These
checks read the folder as a resume would, on the CPU, without unpickling
anything but tensors (``safetensors``; ``torch.load(weights_only=True)`` for
``.bin``), and say for every problem which file and what is wrong.

What the Trainer writes (transformers 5.x ``Trainer._save_checkpoint``): the
weights (``model.safetensors``, or shards and ``model.safetensors.index.json``;
``pytorch_model.bin`` without safetensors; ``adapter_model.*`` for PEFT), then,
unless ``save_only_model``, ``optimizer.pt`` (DeepSpeed: ``global_step<N>/``;
FSDP: its own files), ``scheduler.pt`` (not under DeepSpeed's own scheduler),
``rng_state.pth`` (``rng_state_<r>.pth`` per rank with several processes), then
``trainer_state.json``. HF's JIT checkpoint writes ``checkpoint-is-incomplete.txt``
first and removes it when the save ended.
"""
from __future__ import annotations

import json
import os
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from harness.lib.checkpoints import INCOMPLETE_MARKER, STATE_DIR, TRAINER_STATE

SAFE_INDEX, BIN_INDEX = "model.safetensors.index.json", "pytorch_model.bin.index.json"
_ZERO_RANK = re.compile(r"zero_pp_rank_(\d+)_")
WEIGHT_CANDIDATES = ("model.safetensors", "pytorch_model.bin", "adapter_model.safetensors", "adapter_model.bin")


@dataclass(frozen=True)
class Layout:
    """What this run's configuration makes the Trainer write into each checkpoint (taken at save time)."""

    world_size: int = 1
    save_only_model: bool = False
    deepspeed: bool = False
    fsdp: bool = False
    scheduler: bool = True  # False under DeepSpeed's own scheduler (the engine keeps it in global_step<N>/)


@dataclass(frozen=True)
class Problem:
    """One thing wrong with a checkpoint: the file (relative to the folder) and what is wrong with it."""

    file: str
    what: str

    def __str__(self) -> str:
        return f"{self.file}: {self.what}"


@dataclass
class Weights:
    """The weights as read back: tensors (when kept), shapes, the files read, and what could not be checked."""

    files: list[str] = field(default_factory=list)
    shapes: dict[str, tuple[int, ...]] = field(default_factory=dict)
    tensors: dict[str, Any] = field(default_factory=dict)
    problems: list[Problem] = field(default_factory=list)
    unverified: str | None = None  # why the weights could not be read (a format these checks do not load)


def _files(folder: Path) -> list[Path]:
    """Every regular file below ``folder`` (links are not followed: a checkpoint is data)."""
    found: list[Path] = []
    for root, dirs, names in os.walk(folder, followlinks=False):
        dirs[:] = [d for d in dirs if not (Path(root) / d).is_symlink()]
        found.extend(Path(root) / n for n in names if not (Path(root) / n).is_symlink())
    return found


def _harness_temp_file(path: Path) -> bool:
    """A harness state file being written (``safe_write_text``'s ``.<name>.<pid>.tmp``, renamed when whole)."""
    return path.parent.name == STATE_DIR and TEMP_NAME.fullmatch(path.name) is not None


TEMP_NAME = re.compile(r"\..+\.\d+\.tmp")


def weight_files(folder: Path) -> tuple[list[str], list[Problem]]:
    """The weight files a loader would read (shards from the index), and the ones the index names that are missing."""
    folder = Path(folder)
    for index in (SAFE_INDEX, BIN_INDEX):
        if (folder / index).is_file():
            try:
                weight_map = json.loads((folder / index).read_text(encoding="utf-8"))["weight_map"]
                shards = sorted(set(weight_map.values()))
            except (OSError, ValueError, KeyError, TypeError, AttributeError) as exc:
                return [], [Problem(index, f"unreadable index ({type(exc).__name__}: {exc})")]
            missing = [Problem(s, f"named by {index} but missing") for s in shards if not (folder / s).is_file()]
            return [s for s in shards if (folder / s).is_file()], missing
    return [name for name in WEIGHT_CANDIDATES if (folder / name).is_file()][:1], []


def check_complete(folder: Path, step: int | None, layout: Layout) -> list[Problem]:
    """Every file this run's save writes is there and non-empty, the JIT marker is absent, trainer_state.json reads."""
    folder = Path(folder)
    problems: list[Problem] = []
    if (folder / INCOMPLETE_MARKER).exists():
        problems.append(Problem(INCOMPLETE_MARKER, "HF's in-progress marker is still there: the save did not finish"))
    for path in _files(folder):
        if _harness_temp_file(path):
            continue  # a harness write under way (a save of the same step again): never part of a finished save
        try:
            if path.stat().st_size == 0:
                problems.append(Problem(str(path.relative_to(folder)), "is empty (0 bytes)"))
        except FileNotFoundError:
            continue  # gone since the listing (a temp file renamed): not a file of the save
        except OSError as exc:
            problems.append(Problem(str(path.relative_to(folder)), f"cannot be read ({exc.strerror})"))
    files, missing = weight_files(folder)
    problems.extend(missing)
    ds_dirs = sorted(p.name for p in folder.glob("global_step*") if p.is_dir())
    if not files and not missing and not (layout.deepspeed and ds_dirs) and not layout.fsdp:
        problems.append(Problem("model.safetensors", "no weights file (model.safetensors, shards with an index, pytorch_model.bin)"))
    required: list[str] = []
    if not layout.save_only_model:
        if not layout.deepspeed and not layout.fsdp:
            required.append("optimizer.pt")
        if layout.scheduler and not layout.deepspeed:
            required.append("scheduler.pt")
        required += ["rng_state.pth"] if layout.world_size <= 1 else [f"rng_state_{r}.pth" for r in range(layout.world_size)]
    problems.extend(Problem(name, "missing") for name in required if not (folder / name).is_file())
    if layout.deepspeed and not layout.save_only_model:
        problems.extend(_deepspeed_problems(folder, step, ds_dirs, layout.world_size))
    problems.extend(_trainer_state_problems(folder, step))
    return problems


def _deepspeed_problems(folder: Path, step: int | None, ds_dirs: list[str], world_size: int) -> list[Problem]:
    """DeepSpeed's ``global_step<N>/`` folder: present, named by ``latest``, holding model states."""
    expected = f"global_step{step}" if step is not None else None
    if expected is not None and expected not in ds_dirs:
        return [Problem(expected, f"missing (DeepSpeed's engine state; found {ds_dirs or 'none'})")]
    problems: list[Problem] = []
    latest = folder / "latest"
    if latest.is_file() and expected is not None and latest.read_text(encoding="utf-8", errors="replace").strip() != expected:
        problems.append(Problem("latest", f"names {latest.read_text(encoding='utf-8', errors='replace').strip()!r}, not {expected!r}"))
    target = folder / (expected or ds_dirs[-1]) if (expected or ds_dirs) else None
    if target is not None and not any(target.glob("*model_states.pt")):
        problems.append(Problem(target.name, "holds no *model_states.pt"))
    if target is not None and any(target.glob("*zero_pp_rank_*")):  # ZeRO: one optimizer partition per data-parallel rank
        ranks = {int(m.group(1)) for p in target.glob("*zero_pp_rank_*_optim_states.pt") if (m := _ZERO_RANK.search(p.name))}
        problems.extend(Problem(f"{target.name}/zero_pp_rank_{r}_mp_rank_00_optim_states.pt", "missing (rank {r}'s optimizer partition)".format(r=r))
                        for r in range(world_size) if r not in ranks)
    return problems


def _trainer_state_problems(folder: Path, step: int | None) -> list[Problem]:
    path = folder / TRAINER_STATE
    if not path.is_file():
        return [Problem(TRAINER_STATE, "missing (the Trainer writes it last: its save did not end)")]
    try:
        state = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        return [Problem(TRAINER_STATE, f"unreadable ({type(exc).__name__})")]
    saved = state.get("global_step") if isinstance(state, dict) else None
    if step is not None and saved != step:
        return [Problem(TRAINER_STATE, f"says global_step {saved}, the folder is step {step}")]
    return []


def read_weights(folder: Path, keep: bool) -> Weights:
    """Read every weight tensor on the CPU; finite and readable, or a problem naming the file and tensor.

    ``keep``: hold the tensors for a rebuild (else each is dropped once checked).
    """
    import torch

    folder = Path(folder)
    result = Weights()
    files, _ = weight_files(folder)
    if not files:
        result.unverified = "no weights file these checks can read (DeepSpeed/FSDP sharded state only)"
        return result
    for name in files:
        result.files.append(name)
        try:
            for key, tensor in _tensors(folder / name):
                result.shapes[key] = tuple(tensor.shape)
                if tensor.is_floating_point() and tensor.numel() and not bool(torch.isfinite(tensor).all()):
                    bad = int((~torch.isfinite(tensor)).sum())
                    result.problems.append(Problem(name, f"tensor {key} has {bad} non-finite value(s) of {tensor.numel()}"))
                if keep:
                    result.tensors[key] = tensor
        except Exception as exc:  # noqa: BLE001 - whatever the reader raises on a damaged file, that is the finding
            size = (folder / name).stat().st_size if (folder / name).exists() else 0
            result.problems.append(Problem(name, f"does not load ({type(exc).__name__}: {str(exc)[:200]}; {size} bytes on disk)"))
    return result


def _tensors(path: Path) -> Any:
    """(name, CPU tensor) pairs of one weights file: safetensors, or a tensors-only torch pickle."""
    import torch

    if path.name.endswith(".safetensors"):
        from safetensors import safe_open

        with safe_open(str(path), framework="pt", device="cpu") as handle:
            for key in handle.keys():  # noqa: SIM118 - safe_open is not a mapping
                yield key, handle.get_tensor(key)
        return
    state = torch.load(path, map_location="cpu", weights_only=True)
    if not isinstance(state, dict):
        raise ValueError(f"holds a {type(state).__name__}, not a state dict")
    yield from ((k, v) for k, v in state.items() if torch.is_tensor(v))


def expected_shapes(model: Any) -> dict[str, tuple[tuple[int, ...], int]]:
    """Each state-dict entry of the in-memory model: (shape, storage id); tied entries share the id (saved once).
    Judged against a file by :func:`harness.lib.checkpoint_layout.layout_problems`, beside transformers' saved format."""
    shapes: dict[str, tuple[tuple[int, ...], int]] = {}
    for name, tensor in model.state_dict().items():
        shapes[name] = (tuple(tensor.shape), int(tensor.untyped_storage().data_ptr()) if tensor.numel() else id(tensor))
    return shapes
