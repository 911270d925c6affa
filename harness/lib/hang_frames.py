"""Where a stuck thread is, in words, and every thread's stack in a file: what a RANK_HANG finding says and points at.

:func:`name_frames` reads a thread's frames (outermost first, as
``traceback.extract_stack`` gives them) and names the operation it waits in
("in the data loader's __next__", "in all_gather", "in torch.save", "in
backward") and where that was called from ("at the step guard", "in the
Trainer's checkpoint save"), from the frames' file paths and function names
alone: no import of torch or transformers. :func:`write_stacks` dumps every
thread of the process with ``sys._current_frames`` and ``traceback``, and
falls back to ``faulthandler`` (which needs no Python objects) when that fails.
"""
from __future__ import annotations

import faulthandler
import sys
import threading
import traceback
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable

FrameRow = tuple[str, int, str]  # (file name, line, function)

COLLECTIVES = frozenset({
    "all_reduce", "all_gather", "all_gather_into_tensor", "all_gather_object", "broadcast", "broadcast_object_list",
    "barrier", "monitored_barrier", "reduce", "reduce_scatter", "reduce_scatter_tensor", "gather", "gather_object",
    "scatter", "scatter_object_list", "all_to_all", "all_to_all_single", "send", "recv", "batch_isend_irecv", "wait",
})
WAITS = {("threading.py", "wait"): "threading's Event/Condition wait", ("threading.py", "acquire"): "a lock's acquire",
         ("queue.py", "get"): "a queue's get", ("queue.py", "put"): "a queue's put", ("threading.py", "join"): "a thread's join",
         ("subprocess.py", "wait"): "waiting for a subprocess", ("selectors.py", "select"): "select on a socket or pipe"}
CONTEXTS = (  # (path part, functions or None for any, words): the first that an outer frame matches wins
    ("harness/hf/guard.py", None, "at the step guard"),
    ("harness/core/distributed.py", None, "in the harness's cross-rank exchange"),
    ("transformers/trainer.py", {"_save_checkpoint", "save_model", "_save", "_save_optimizer_and_scheduler"}, "in the Trainer's checkpoint save"),
    ("transformers/trainer.py", {"evaluate", "evaluation_loop", "prediction_step", "_evaluate"}, "in the evaluation"),
    ("transformers/trainer.py", {"_maybe_log_save_evaluate"}, "in the Trainer's log/evaluate/save after the step"),
    ("transformers/trainer.py", {"get_batch_samples"}, "fetching the step's batches"),
    ("transformers/trainer.py", {"training_step"}, "in the training step"),
    ("accelerate/optimizer.py", {"step"}, "in the optimizer step"),
)


@dataclass(frozen=True)
class Where:
    """A thread's position: ``words`` for people, ``kind`` for the watchdog (collective, data, save, wait, compute, other)."""

    words: str
    kind: str
    innermost: list[str]  # "function (path:line)", innermost first


def _norm(path: str) -> str:
    return path.replace("\\", "/")


SHORT_PARTS = 3  # a frame's path is shown by its last parts: enough to tell torch/distributed/x.py from a user's x.py


def short(row: FrameRow) -> str:
    """``function (path:line)``: a path of more than ``SHORT_PARTS`` parts as ``.../`` and its last parts (the mark says
    it was cut: ``tmp/trial/train.py`` would read as a relative path), a shorter one whole, as the frame has it."""
    path, line, function = row
    normed = _norm(path)
    parts = [part for part in normed.split("/") if part]
    tail = ".../" + "/".join(parts[-SHORT_PARTS:]) if len(parts) > SHORT_PARTS else normed
    return f"{function} ({tail}:{line})"


def _operation(frames: list[FrameRow], world_size: int) -> tuple[int, str, str] | None:
    """(index of the frame, words, kind) of the operation the thread waits in; None when none is known."""
    paths = [_norm(f[0]) for f in frames]
    for i in range(len(frames) - 1, -1, -1):  # innermost first, but a collective is named by its outermost public frame
        path, function = paths[i], frames[i][2]
        if ("torch/distributed/" in path or "deepspeed/comm/" in path) and function in COLLECTIVES:
            j = i
            while j > 0 and ("torch/distributed/" in paths[j - 1] or "deepspeed/comm/" in paths[j - 1]):
                j -= 1
                if frames[j][2] in COLLECTIVES:
                    i, function = j, frames[j][2]
            return i, f"in {function}", "collective"
        if path.endswith("torch/utils/data/dataloader.py") and function == "__next__":
            return i, "in the data loader's __next__" + _data_detail(frames, i), "data"
        if path.endswith("torch/serialization.py") and function in ("save", "load"):
            return i, f"in torch.{function}", "save"
        if path.endswith("safetensors/torch.py") and function in ("save_file", "save_model", "load_file", "load_model"):
            return i, f"in safetensors' {function}", "save"
        if "torch/autograd/" in path and function in ("backward", "_engine_run_backward", "grad"):
            while i > 0 and "torch/autograd/" in paths[i - 1]:
                i -= 1
            if world_size > 1:
                return i, "in backward (the autograd engine, where DDP's gradient all-reduce waits for every rank)", "collective"
            return i, "in backward (the autograd engine)", "compute"
        if world_size > 1 and path.endswith("harness/core/deferred.py") and function == "read":
            # the step's one device-to-host copy: on a GPU it waits for every queued kernel, NCCL's all-reduce among them
            return i, "in the step guard's device read (on a GPU it waits for the queued kernels: the gradient all-reduce)", "collective"
    return None


def _data_detail(frames: list[FrameRow], at: int) -> str:
    inner = frames[at + 1:]
    for row in reversed(inner):
        if row[2] in ("__getitem__", "__getitems__"):
            return f" (in the dataset's {row[2]}, {short(row)[len(row[2]) + 2:-1]})"
    if any(row[2] in ("_get_data", "_try_get_data") for row in inner):
        return " (waiting for a worker process's batch)"
    return ""


def _context(frames: list[FrameRow], below: int) -> str | None:
    """The first of CONTEXTS (in their order) that a frame outside the operation matches."""
    outer = [(_norm(path), function) for path, _, function in frames[:below]]
    for path, function in reversed(outer):  # a plugin's hook is the most telling place (a collective of its own, a save)
        if "harness/plugins/" in path or ("/plugins/" in path and "/site-packages/" not in path and "/tests/" not in path):
            name = path.split("plugins/", 1)[1].split("/", 1)[0].removesuffix(".py")
            if name and name != "__init__":
                return f"in plugin {name}'s {function}"
    for part, functions, words in CONTEXTS:
        if any(part in path and (functions is None or function in functions) for path, function in outer):
            return words
    return None


def name_frames(frames: Iterable[FrameRow], world_size: int = 1) -> Where:
    """Name where a thread with these frames (outermost first) waits: the operation, then where it was called from."""
    rows = [(str(p), int(n), str(f)) for p, n, f in frames]
    innermost = [short(r) for r in reversed(rows[-6:])]
    if not rows:
        return Where("in no Python frame (the thread is in native code or gone)", "other", [])
    found = _operation(rows, world_size)
    if found is None:
        path, _, function = rows[-1]
        label = WAITS.get((_norm(path).rsplit("/", 1)[-1], function))
        index = len(rows) - 1
        if label is not None:
            words, kind = f"in {label}", "wait"
            if index > 0:
                words += f", called from {short(rows[index - 1])}"
        else:
            words, kind = f"in {short(rows[-1])}", "other"
    else:
        index, words, kind = found
    context = _context(rows, index)
    return Where(f"{words} {context}" if context else words, kind, innermost)


def thread_frames(ident: int | None) -> list[FrameRow]:
    """The frames of the live thread ``ident``, outermost first ([] when it has none)."""
    frame = sys._current_frames().get(ident) if ident is not None else None
    if frame is None:
        return []
    return [(f.filename, f.lineno or 0, f.name) for f in traceback.extract_stack(frame)]


def format_stacks(training_ident: int | None, own_ident: int | None = None) -> str:
    """Every thread's Python stack, the training thread first."""
    threads = {t.ident: t for t in threading.enumerate()}
    frames = sys._current_frames()
    order = sorted(frames, key=lambda ident: (ident != training_ident, ident))
    parts = []
    for ident in order:
        thread = threads.get(ident)
        name = thread.name if thread is not None else "?"
        marks = [m for m, on in (("the training thread", ident == training_ident), ("this watchdog", ident == own_ident),
                                 ("daemon", thread is not None and thread.daemon)) if on]
        parts.append(f"--- thread {name} (ident {ident}{', ' + ', '.join(marks) if marks else ''}) ---\n"
                     "Traceback (most recent call last):\n" + "".join(traceback.format_stack(frames[ident])))
    return "\n".join(parts)


def write_stacks(path: Path, header: str, training_ident: int | None, own_ident: int | None = None) -> str:
    """Write ``header`` and every thread's stack to ``path``; returns how (``traceback`` or ``faulthandler``)."""
    try:
        text = format_stacks(training_ident, own_ident)
        path.write_text(f"{header}\n\n{text}", encoding="utf-8")
        return "traceback"
    except Exception as exc:  # noqa: BLE001 - a frame that cannot be formatted: the C dumper needs no Python objects
        with open(path, "w", encoding="utf-8") as handle:
            handle.write(f"{header}\n\n(sys._current_frames failed: {type(exc).__name__}: {exc}; faulthandler's dump follows)\n")
            handle.flush()
            faulthandler.dump_traceback(file=handle, all_threads=True)
        return "faulthandler"


__all__ = ["Where", "format_stacks", "name_frames", "short", "thread_frames", "write_stacks"]
