"""Collectives per optimizer step that the harness issues, at 2 and 4 processes (torchrun, gloo, CPU).

The launcher runs ``torchrun --nproc_per_node N`` of this file in worker mode:
a tiny-Llama ``Trainer`` (DDP over gloo) with the harness and all its default
plugins. Each worker patches the ``torch.distributed`` collectives (in
``torch.distributed`` and ``distributed_c10d``, before the harness is
imported) and counts a call as the harness's when, walking out from it, the
first frame of the harness or the HF training loop is the harness's (the
rule of ``benchmarks/syncs.py``: the Trainer's own gathers, made inside a
harness wrapper, stay the Trainer's). A collective made inside another
(``all_gather_object`` -> ``all_gather``) counts once. DDP's gradient
all-reduce runs in C++ and is not seen (nor counted).

An ordinary step is neither the first step, nor a step with a checkpoint or
an evaluation, nor a ``grad_sync`` check step (every ``grad_sync.every``).

    python benchmarks/collectives.py [--nproc 2,4] [--steps 12] [--accumulation 2]

The last line is ``harness collectives per ordinary step: A (2 processes), B (4 processes)``.
"""
from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
import tempfile
import threading
from collections import Counter
from pathlib import Path
from typing import Any, Callable

LAST_LINE = "harness collectives per ordinary step: {parts}"
COLLECTIVES = (
    "all_gather", "all_gather_into_tensor", "all_gather_object", "all_reduce", "all_to_all", "all_to_all_single",
    "barrier", "monitored_barrier", "broadcast", "broadcast_object_list", "gather", "gather_object", "reduce",
    "reduce_scatter", "reduce_scatter_tensor", "scatter", "scatter_object_list", "send", "recv", "isend", "irecv",
    "batch_isend_irecv",
)
CORE_PLUMBING = ("harness/core/distributed.py", "harness/core/exchange.py", "harness/core/context.py")  # not "who asked"
GRAD_SYNC_EVERY = 50  # grad_sync's default `every`


class CollectiveCounter:
    """Counts the torch.distributed collectives issued while training, by who issued them and in which step."""

    def __init__(self) -> None:
        self.frames: Any = None  # set once the harness may be imported (after ``install``)
        self.active = False
        self.step = 0
        self.special: set[int] = set()  # steps with a checkpoint or an evaluation
        self.harness: Counter[str] = Counter()  # "where name" -> count
        self.others = 0
        self.per_step: Counter[int] = Counter()
        self.all_per_step: Counter[int] = Counter()
        self._inside = threading.local()

    def _wrap(self, name: str, original: Callable[..., Any]) -> Callable[..., Any]:
        counter = self

        def collective(*args: Any, **kwargs: Any) -> Any:
            if not counter.active or getattr(counter._inside, "busy", False):
                return original(*args, **kwargs)
            counter._inside.busy = True
            try:
                chain = counter.frames.callers(sys._getframe(1))
                counter.all_per_step[counter.step] += 1
                if not chain:
                    counter.others += 1
                else:
                    via = next((c for c in chain if not c.startswith(CORE_PLUMBING)), None)
                    counter.harness[f"{chain[0]} {name}" + (f" (for {via})" if via and via != chain[0] else "")] += 1
                    counter.per_step[counter.step] += 1
                return original(*args, **kwargs)
            finally:
                counter._inside.busy = False

        collective.__wrapped__ = original  # type: ignore[attr-defined]
        return collective

    def install(self) -> None:
        import torch.distributed as dist
        import torch.distributed.distributed_c10d as c10d

        for name in COLLECTIVES:
            original = getattr(c10d, name, None) or getattr(dist, name, None)
            if original is None:
                continue
            wrapped = self._wrap(name, original)
            for module in (dist, c10d):
                if hasattr(module, name):
                    setattr(module, name, wrapped)

    def summary(self, steps: int) -> dict[str, Any]:
        ordinary = [s for s in range(2, steps + 1) if s not in self.special and s % GRAD_SYNC_EVERY]
        return {
            "steps": steps,
            "per_step": [self.per_step.get(s, 0) for s in range(1, steps + 1)],
            "all_per_step": [self.all_per_step.get(s, 0) for s in range(1, steps + 1)],
            "ordinary": ordinary,
            "harness": dict(self.harness),
            "others": self.others,
        }


def worker(args: argparse.Namespace) -> int:
    """One rank: train with the harness, then write this rank's counts to ``--out``."""
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    for var in ("HARNESS_CONFIG", "HARNESS_PLUGINS"):
        os.environ.pop(var, None)
    counter = CollectiveCounter()
    counter.install()  # before the harness is imported, so that no module holds an unpatched function
    from syncs import Frames  # imports the harness

    counter.frames = Frames()
    import torch
    from transformers import PrinterCallback, Trainer, TrainerCallback

    import harness
    import overhead
    from harness.lib.tiny import build_tiny_llama, corpus_lines, lm_dataset, train_tokenizer

    class Window(TrainerCallback):
        def on_step_begin(self, a: Any, state: Any, control: Any, **kw: Any) -> Any:
            counter.step += 1
            counter.active = True
            return control

        def on_save(self, a: Any, state: Any, control: Any, **kw: Any) -> Any:
            counter.special.add(counter.step)
            return control

        def on_evaluate(self, a: Any, state: Any, control: Any, **kw: Any) -> Any:
            counter.special.add(counter.step)
            return control

        def on_train_end(self, a: Any, state: Any, control: Any, **kw: Any) -> Any:
            counter.active = False
            return control

    overhead.quiet()
    torch.set_num_threads(1)
    tokenizer = train_tokenizer(corpus_lines(), vocab_size=overhead.VOCAB_SIZE)
    world = int(os.environ.get("WORLD_SIZE", "1"))
    dataset = lm_dataset(tokenizer, seq_len=overhead.SEQ_LEN, n_rows=args.steps * overhead.BATCH_SIZE * args.accumulation * world)
    with tempfile.TemporaryDirectory(prefix="harness-collectives-") as scratch:
        out = os.environ.get("HARNESS_BENCH_OUTPUT_DIR") or scratch  # every rank must name the same folder
        model = build_tiny_llama(tokenizer, seed=overhead.SEED, hidden_size=overhead.HIDDEN_SIZE, num_layers=overhead.NUM_LAYERS,
                                 num_heads=overhead.NUM_HEADS, intermediate_size=overhead.INTERMEDIATE_SIZE)
        training = overhead.training_args(out, args.steps)
        training.gradient_accumulation_steps = args.accumulation
        trainer = Trainer(model=model, args=training, train_dataset=dataset, callbacks=[Window()], eval_dataset=overhead.eval_rows())
        trainer.remove_callback(PrinterCallback)
        harness.attach(trainer, config=None)
        trainer.train()
    rank = int(os.environ.get("RANK", "0"))
    Path(args.out, f"rank-{rank}.json").write_text(json.dumps(counter.summary(args.steps)), encoding="utf-8")
    return 0


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def launch(nproc: int, args: argparse.Namespace) -> dict[str, Any]:
    """Run the workers under torchrun; rank 0's counts, checked against the other ranks'."""
    with tempfile.TemporaryDirectory(prefix="harness-collectives-") as tmp:
        env = {**os.environ, "OMP_NUM_THREADS": "1", "HARNESS_BENCH_OUTPUT_DIR": str(Path(tmp, "run")), "HARNESS_REPORT_PLOTS": "0"}
        command = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(nproc), "--master_addr", "127.0.0.1",
                   "--master_port", str(_free_port()), __file__, "--worker", "--out", tmp, "--steps", str(args.steps),
                   "--accumulation", str(args.accumulation)]
        result = subprocess.run(command, env=env, capture_output=True, text=True, timeout=args.timeout)
        if result.returncode != 0:
            sys.stderr.write(result.stdout[-4000:] + result.stderr[-8000:])
            raise SystemExit(f"torchrun with {nproc} processes failed (exit {result.returncode})")
        ranks = [json.loads(Path(tmp, f"rank-{r}.json").read_text(encoding="utf-8")) for r in range(nproc)]
    for r, other in enumerate(ranks[1:], start=1):
        if other["per_step"] != ranks[0]["per_step"]:
            print(f"  note: rank {r} issued {other['per_step']} per step, rank 0 {ranks[0]['per_step']}")
    return ranks[0]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--nproc", default="2,4", help="process counts to measure (default 2,4)")
    parser.add_argument("--steps", type=int, default=12, help="optimizer steps per run (default 12)")
    parser.add_argument("--accumulation", type=int, default=2, help="gradient accumulation steps (default 2)")
    parser.add_argument("--timeout", type=int, default=900, help="seconds allowed per torchrun")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--out", default="", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker:
        return worker(args)
    if args.steps < 3:
        parser.error("--steps must be at least 3 (the first step is not an ordinary one)")
    parts = []
    for nproc in [int(n) for n in args.nproc.split(",") if n.strip()]:
        counts = launch(nproc, args)
        ordinary = [counts["per_step"][s - 1] for s in counts["ordinary"]]
        mean = sum(ordinary) / max(len(ordinary), 1)
        print(f"{nproc} processes, {counts['steps']} steps, gradient accumulation {args.accumulation}:")
        print(f"  harness collectives per step, steps 1..{counts['steps']}: {counts['per_step']}")
        print(f"  all python-level collectives per step (Trainer's included): {counts['all_per_step']}")
        print(f"  harness total per step: {sum(counts['per_step']) / counts['steps']:.2f}; "
              f"per ordinary step: mean {mean:.2f}, max {max(ordinary, default=0)}")
        for where, count in sorted(counts["harness"].items(), key=lambda kv: -kv[1]):
            print(f"    {count:5d}  {where}")
        parts.append(f"{mean:.2f} ({nproc} processes)")
    print(LAST_LINE.format(parts=", ".join(parts)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
