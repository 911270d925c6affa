"""Host synchronisations per optimizer step: the plain ``Trainer`` vs the same Trainer with the harness and its defaults.

Every call of ``Tensor.item/tolist/cpu/numpy/__bool__/__float__/__int__``
(and ``.to("cpu")``) on the training thread stalls a GPU's queue until the
tensor is ready, so the harness should make at most one per optimizer step
(its deferred read). On this CPU-only machine nothing stalls, so the calls are
counted instead, during the training steps (from the first ``on_step_begin``
to ``on_train_end``: run start and end are left out). The patches are on
``torch.Tensor`` itself, so background threads are seen too; their reads
(contamination's worker, after a CUDA event) do not hold up the training
loop and are printed apart.

A call is the harness's when, walking out from it past torch's own frames,
the first frame of either the harness (``harness/``, ``plugins/``,
``stages/``) or the HF training loop (transformers' Trainer files,
accelerate, TRL) is the harness's: so the Trainer's own reads, made inside a
harness wrapper of ``training_step``, stay the Trainer's, while a plugin's
extra forward pass counts as the plugin's. Reads of tensors the harness built
on the host (``torch.tensor``/``as_tensor``/``from_numpy`` without a device,
and the results of a counted ``cpu()``) are free and not counted, and neither
are reads made by its control plane (``harness/core/distributed.py`` and
``harness/core/exchange.py``, on gloo tensors): those are printed apart.

The harness reads host tensors one ``tolist`` at a time (nothing to save on a
CPU); here its deferred reads are switched to the device path
(``DeferredReads.join_host``), which is what the model's tensors stand in for.

    python benchmarks/syncs.py [--steps N] [--accumulation 2]

The last line is ``harness host syncs per optimizer step: X.XX (plain Trainer: Y.YY)``.
"""
from __future__ import annotations

import argparse
import os
import sys
import tempfile
import threading
import weakref
from collections import Counter
from pathlib import Path
from typing import Any, Callable

import overhead  # the sibling benchmark: the same model, data and arguments (also sets the environment up)
import torch
from transformers import PrinterCallback, Trainer, TrainerCallback

import harness
import harness.plugins
import harness.stages
from harness.lib.tiny import build_tiny_llama, corpus_lines, lm_dataset, train_tokenizer

LAST_LINE = "harness host syncs per optimizer step: {harness:.2f} (plain Trainer: {plain:.2f})"
READS = ("item", "tolist", "cpu", "numpy", "__bool__", "__float__", "__int__", "to")
BUILDERS = ("tensor", "as_tensor", "from_numpy", "randint")


def _dir(path: str | os.PathLike[str]) -> str:
    return str(Path(path).resolve()) + os.sep


HARNESS_DIRS = tuple(_dir(next(iter(m.__path__))) for m in (harness, harness.plugins, harness.stages))
CONTROL_PLANE = ("harness/core/distributed.py:", "harness/core/exchange.py:")
TRANSFORMERS_DIR = _dir(Path(sys.modules["transformers"].__file__).parent)  # type: ignore[arg-type]
HF_LOOP_FILES = ("trainer.py", "trainer_pt_utils.py", "trainer_callback.py", "trainer_utils.py")
HF_PACKAGES = ("accelerate", "trl")


class Frames:
    """Who is responsible for a call: a harness file and function, or the HF stack (None)."""

    def __init__(self) -> None:
        self._kind: dict[str, str] = {}  # co_filename -> "harness" | "hf" | "other"

    def kind(self, filename: str) -> str:
        kind = self._kind.get(filename)
        if kind is None:
            path = os.path.realpath(filename)
            if path.startswith(HARNESS_DIRS):
                kind = "harness"
            elif path.startswith(TRANSFORMERS_DIR) and os.path.basename(path) in HF_LOOP_FILES:
                kind = "hf"
            else:
                kind = "hf" if any(f"site-packages{os.sep}{p}{os.sep}" in path for p in HF_PACKAGES) else "other"
            self._kind[filename] = kind
        return kind

    def callers(self, frame: Any) -> list[str]:
        """Every harness ``path:function`` from ``frame`` outwards up to the first HF-loop frame (innermost first)."""
        found: list[str] = []
        while frame is not None:
            kind = self.kind(frame.f_code.co_filename)
            if kind == "hf":
                break
            if kind == "harness":
                found.append(self._name(frame))
            frame = frame.f_back
        return found

    def _name(self, frame: Any) -> str:
        path = os.path.realpath(frame.f_code.co_filename)
        root = next(d for d in HARNESS_DIRS if path.startswith(d))
        return f"{Path(root).name}/{path[len(root):]}:{frame.f_code.co_name}"

    def culprit(self, frame: Any) -> str | None:
        """``path:function`` of the first harness frame met before any HF-loop frame, walking outwards; else None."""
        while frame is not None:
            kind = self.kind(frame.f_code.co_filename)
            if kind == "harness":
                return self._name(frame)
            if kind == "hf":
                return None
            frame = frame.f_back
        return None


def is_control_plane(where: str) -> bool:
    return where.startswith(CONTROL_PLANE)


class SyncCounter:
    """Patches torch.Tensor's host reads (all threads) and counts them while ``active``."""

    def __init__(self) -> None:
        self.frames = Frames()
        self.active = False
        self.step = 0
        self.harness: Counter[tuple[str, str]] = Counter()  # (where, method)
        self.control: Counter[tuple[str, str]] = Counter()
        self.background: Counter[tuple[str, str]] = Counter()
        self.owner: Counter[str] = Counter()  # the plugin (or core file) on whose behalf a counted read was made
        self.other: Counter[str] = Counter()  # method -> count, everything not the harness's
        self.per_step: Counter[int] = Counter()  # step -> harness syncs
        self._host: dict[int, weakref.ref[torch.Tensor]] = {}
        self._inside = threading.local()
        self._saved: list[tuple[Any, str, Any]] = []

    def _mark_host(self, tensor: Any) -> None:
        if isinstance(tensor, torch.Tensor):
            key = id(tensor)
            self._host[key] = weakref.ref(tensor, lambda _r, k=key: self._host.pop(k, None))

    def _is_host(self, tensor: Any) -> bool:
        ref = self._host.get(id(tensor))
        return ref is not None and ref() is tensor

    def _record(self, name: str, tensor: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> bool:
        """Count one read; True when its result is a host copy (to be marked)."""
        if name == "to" and not _to_cpu(args, kwargs):
            return False
        if self._is_host(tensor):
            return name in ("cpu", "to")
        chain = self.frames.callers(sys._getframe(2))
        where = chain[0] if chain else None
        if where is None and name == "to":
            return False  # the HF stack's ``.to(args.device)`` moves batches to the device: on a GPU that is no read
        if where is None:
            self.other[name] += 1
        elif threading.current_thread() is not threading.main_thread():
            self.background[(where, name)] += 1  # waits on its own thread (after an event): the training loop goes on
        elif is_control_plane(where):
            self.control[(where, name)] += 1
        else:
            self.harness[(where, name)] += 1
            self.owner[next((c for c in chain if c.startswith("plugins/")), where).split(":")[0]] += 1
            self.per_step[self.step] += 1
        return name in ("cpu", "to", "numpy")

    def _wrap_read(self, name: str, original: Callable[..., Any]) -> Callable[..., Any]:
        counter = self

        def read(self: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
            if not counter.active or getattr(counter._inside, "busy", False):
                return original(self, *args, **kwargs)
            counter._inside.busy = True  # reads made inside this one (``__format__`` -> ``item``) are not counted again
            try:
                host = counter._record(name, self, args, kwargs)
                result = original(self, *args, **kwargs)
            finally:
                counter._inside.busy = False
            if host:
                counter._mark_host(result)
            return result

        return read

    def _wrap_builder(self, original: Callable[..., Any]) -> Callable[..., Any]:
        counter = self

        def build(*args: Any, **kwargs: Any) -> Any:
            result = original(*args, **kwargs)
            device = kwargs.get("device")
            if counter.active and (device is None or torch.device(device).type == "cpu"):
                if counter.frames.culprit(sys._getframe(1)) is not None:
                    counter._mark_host(result)  # built by the harness on the host: reading it syncs nothing
            return result

        return build

    def install(self) -> None:
        for name in READS:
            original = getattr(torch.Tensor, name)
            self._saved.append((torch.Tensor, name, original))
            setattr(torch.Tensor, name, self._wrap_read(name, original))
        for name in BUILDERS:
            original = getattr(torch, name)
            self._saved.append((torch, name, original))
            setattr(torch, name, self._wrap_builder(original))

    def uninstall(self) -> None:
        for owner, name, original in reversed(self._saved):
            setattr(owner, name, original)
        self._saved.clear()


def _to_cpu(args: tuple[Any, ...], kwargs: dict[str, Any]) -> bool:
    """``.to("cpu")`` written out: a move to a computed device (``tensor.device``, the model's) stays on a GPU there."""
    return any(isinstance(v, str) and v.split(":")[0] == "cpu" for v in (*args, kwargs.get("device")))


class Window(TrainerCallback):
    """Opens the count at the first optimizer step, numbers the steps, and closes it at the end of training."""

    def __init__(self, counter: SyncCounter) -> None:
        self.counter = counter
        self.steps = 0

    def on_step_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> Any:
        self.steps += 1
        self.counter.step = self.steps
        self.counter.active = True
        return control

    def on_train_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> Any:
        self.counter.active = False
        return control


def run(tokenizer: Any, dataset: Any, steps: int, accumulation: int, with_harness: bool) -> tuple[SyncCounter, int]:
    counter = SyncCounter()
    window = Window(counter)
    with tempfile.TemporaryDirectory(prefix="harness-syncs-") as out:
        model = build_tiny_llama(tokenizer, seed=overhead.SEED, hidden_size=overhead.HIDDEN_SIZE, num_layers=overhead.NUM_LAYERS,
                                 num_heads=overhead.NUM_HEADS, intermediate_size=overhead.INTERMEDIATE_SIZE)
        args = overhead.training_args(out, steps)
        args.gradient_accumulation_steps = accumulation
        trainer = Trainer(model=model, args=args, train_dataset=dataset, callbacks=[window], eval_dataset=overhead.eval_rows())
        trainer.remove_callback(PrinterCallback)
        if with_harness:
            ctx = harness.attach(trainer, config=None)
            # the model's tensors stand in for a GPU's here: read them as a GPU run reads its device tensors (joined, one
            # copy); on a real CPU run the harness reads host tensors one by one, which syncs nothing
            ctx.reads.join_host = True
        counter.install()
        try:
            trainer.train()
        finally:
            counter.active = False
            counter.uninstall()
    if window.steps != steps:
        raise RuntimeError(f"expected {steps} optimizer steps, saw {window.steps}")
    return counter, steps


def report(plain: SyncCounter, harnessed: SyncCounter, steps: int) -> None:
    plain_total = sum(plain.other.values()) + sum(plain.harness.values())
    print(f"plain Trainer: {plain_total} host reads in {steps} steps ({dict(plain.other)})")
    print(f"with the harness, the HF stack's own: {sum(harnessed.other.values())} ({dict(harnessed.other)})")
    print("harness host syncs by plugin, or core file (per step):")
    for file, count in harnessed.owner.most_common():
        print(f"  {file:<40} {count / steps:6.2f}")
    print("harness host syncs by place (total in the run):")
    for (where, name), count in harnessed.harness.most_common():
        print(f"  {count:5d}  {name:<9} {where}")
    for title, apart in (("control plane (gloo tensors)", harnessed.control), ("background threads", harnessed.background)):
        if apart:
            print(f"harness {title}, not counted: " + ", ".join(f"{w} {n} x{c}" for (w, n), c in apart.items()))
    per_step = [harnessed.per_step.get(s, 0) for s in range(1, steps + 1)]
    ordinary = sorted(per_step[1:]) or [0]
    print(f"harness syncs per step, steps 1..{steps}: {per_step}")
    print(f"ordinary steps (2..{steps}): median {ordinary[len(ordinary) // 2]}, max {max(ordinary)}")
    print(LAST_LINE.format(harness=sum(per_step) / steps, plain=plain_total / steps))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=20, help="optimizer steps per run (default 20)")
    parser.add_argument("--accumulation", type=int, default=2, help="gradient accumulation steps (default 2)")
    parser.add_argument("--threads", type=int, default=os.cpu_count() or 1, help="torch.set_num_threads")
    args = parser.parse_args(argv)
    if args.steps < 2:
        parser.error("--steps must be at least 2")
    overhead.quiet()
    torch.set_num_threads(args.threads)
    tokenizer = train_tokenizer(corpus_lines(), vocab_size=overhead.VOCAB_SIZE)
    dataset = lm_dataset(tokenizer, seq_len=overhead.SEQ_LEN, n_rows=args.steps * overhead.BATCH_SIZE * args.accumulation)
    print(f"benchmark model: {overhead.BENCHMARK_MODEL}; gradient accumulation {args.accumulation}, {args.steps} steps")
    plain, steps = run(tokenizer, dataset, args.steps, args.accumulation, with_harness=False)
    harnessed, _ = run(tokenizer, dataset, args.steps, args.accumulation, with_harness=True)
    report(plain, harnessed, steps)
    return 0


if __name__ == "__main__":
    sys.exit(main())
