"""Long-run benchmark: the harness's cost per step must stay flat over 100,000 optimizer steps.

No model is trained. The harness is attached exactly as ``harness.attach``
attaches it (the real Bridge, PluginManager, every default plugin, a run
directory in a temp folder) to a real ``transformers.Trainer``, and this
script drives the Trainer's inner loop by hand, in the Trainer's order, with
the bridge's own wrappers in the path:

- ``callback_handler.on_step_begin``, then per micro-batch the trainer's
  ``training_step`` (wrapped by the harness's tap: ``inspect_batch``, then
  ``compute_loss``, wrapped: ``on_loss``);
- the Trainer's real ``_get_grad_norm`` (wrapped: the grad norm the guard reads);
- ``optimizer.step()`` (guarded: the step's one read, ``on_before_optimizer_step``,
  ``ctx.agree()``, ``on_step_agreed``), the LR scheduler;
- ``callback_handler.on_step_end`` (``on_step_end``), and ``on_log`` with the
  Trainer's log dict every ``logging_steps``; ``on_metrics`` fires wherever
  plugins emit metrics;
- run end through the bridge's ``train`` wrapper (``on_run_end``, the run-end
  report), then ``harness report`` rebuilt in process (``print_report``), timed.

What stands in for the model: the inner ``training_step``/``compute_loss`` are
replaced (before attaching, so the harness wraps them as it wraps the real
ones) by ones that return a synthetic loss: a slowly decaying curve with
bounded noise (no spikes). The micro-batches are fresh int64
``input_ids``/``labels``/``attention_mask`` from a seeded generator (distinct
data, the worst case for ``data_hash``). The model is a tiny real module
(embedding 512x16 + linear 16x512) whose gradients are set once, so the grad
norm and ``nan_guard``'s parameter checks run their real code; the rerun
plugin's calibration and loss_baseline's GA check recompute through it (once).
One process: ``grad_sync``'s cross-rank checks and the exchange's collectives
do not run (``benchmarks/collectives.py`` counts those). The optimizer
is the Trainer's own (SGD, lr 1e-6). ``model.zero_grad()`` is not called, so
the recorded gradients stay for every step.

Printed at 1k, 10k, 30k and 100k steps (or the --steps marks), over the
window of steps before each mark (1000, or half the mark when smaller): the
median wall time per step of the long run (the whole step: the harness's
wrappers and hooks, plus the few tens of microseconds of the synthetic
stand-ins, the tiny optimizer and the Trainer's callback handler), the median
of a *fresh* harness (a second Trainer, attached the same way, at its steps
1..window) driven in the same window, step for step, alternating which goes
first, and their ratio; the mean step time (periodic work: fsyncs, checks
every N steps), the median time inside plugin hooks, RSS, and the bytes
written per step under harness/. The interleaved fresh run is the reference
because this benchmark runs on shared machines: two minutes apart, the same
step can take twice as long (the unpaired ratio is printed too, to show it).
Then the verdicts: the ratio at the last mark within 10%, RSS growth from the
first step to the last under 100 MB, and the time of ``harness report``.

What the harness keeps in memory for a whole run, and its bound (checked
with tracemalloc over 10k steps of this driver: only the data_hash tables grew):

- ``ctx.recent_batches``: the last ``recent_batches`` (4) micro-batches, by reference;
- ``ctx.findings``: one entry per finding; each code is rate-limited per plugin (``limit``);
- ``spike_capture``: baselines of the last ``window`` steps, a history of
  ``history`` steps and a ring of ``ring_size`` micro-batches (deques);
  ``resume_check``: ``loss_window`` losses; ``throughput``: ``window`` steps;
  ``oom``: 512 padded lengths; ``run_card``: ``measure_after`` step times, once;
- ``metrics_log``: at most ``flush_every`` step records between writes;
- ``data_hash``: two exact tables of 64-bit keys (:mod:`harness.lib.seentable`),
  grown by doubling up to ``seen_capacity`` keys each (2M: 128 MiB for both at
  most); this run adds 8 distinct samples per step and has no sample ids, so
  the seen table alone fills: 800k keys, 2^21 slots, 32 MiB by 100k steps,
  most of the RSS growth printed (with sample ids the content table fills alike);
- ``contamination``: the eval set's n-gram index (sized by the eval set) and
  at most ``KEEP`` sightings per eval example;
- ``dpo_health`` (DPO runs): the last ``2 x saturated_logs`` logged points, and
  two floats per logged point in sorted thirds (:mod:`harness.lib.early_late`),
  so a log costs O(log n) and not a re-sort of the whole history (before:
  0.37 ms per log at 2k logs, 31 ms at 10k);
- ``nan_guard``: one int per skipped step (events, not steps); ``lr_schedule``:
  one float per scheduler position, only for schedules that are not a LambdaLR;
  ``checkpoint_proof``: one timing per checkpoint;
- files under ``harness/`` grow with the run by a constant number of bytes
  per step (steps.jsonl about 260 B, the data ledger about 390 B at 8 rows per
  step): printed per window, it must not grow.

The report reads steps.jsonl, metrics.jsonl and the findings once; markers
for spike findings are found in one pass over the steps (``records_of``), so
the build is O(steps + findings). It holds the step records in memory while
it builds: at 100k steps RSS rises by some 180 MB over the report (its imports
and plots included), once, at run end.

    python benchmarks/long_run.py [--steps N] [--quick] [--window W] [--no-plots] [--keep DIR]
"""
from __future__ import annotations

import argparse
import contextlib
import io
import logging
import math
import os
import statistics
import sys
import tempfile
import time
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from bench_env import offline_defaults, time_hook_calls  # noqa: E402 - beside this script

offline_defaults()

import torch  # noqa: E402
from transformers import PrinterCallback, Trainer, TrainingArguments  # noqa: E402
from transformers.modeling_outputs import CausalLMOutput  # noqa: E402
from transformers.utils import logging as hf_logging  # noqa: E402

import harness  # noqa: E402
from harness.core.mapped_lines import written_end  # noqa: E402

VOCAB_SIZE = 512
HIDDEN = 16
SEQ_LEN = 64
BATCH_SIZE = 4
GRAD_ACCUM = 2
SEED = 0
LOGGING_STEPS = 10
MARKS = (1_000, 10_000, 30_000, 100_000)
TIME_TOLERANCE = 0.10  # per-step time at the last mark within 10% of the first
RSS_BUDGET_MB = 100.0
TABLE_HEADER = (f"{'step':>7} | {'step us':>8} | {'fresh us':>8} | {'ratio':>6} | {'mean us':>8} | {'hooks us':>8} | {'RSS MB':>7} | "
                f"{'bytes/step':>10} | {'harness/ MB':>11}")


class TinyLM(torch.nn.Module):
    """The stand-in model: real parameters and gradients, a forward for the rerun plugin's one calibration."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = torch.nn.Embedding(VOCAB_SIZE, HIDDEN)
        self.head = torch.nn.Linear(HIDDEN, VOCAB_SIZE)

    def forward(self, input_ids: torch.Tensor, attention_mask: Any = None, labels: Any = None, **_: Any) -> CausalLMOutput:
        logits = self.head(self.embed(input_ids))
        loss = None
        if labels is not None:
            loss = torch.nn.functional.cross_entropy(logits[:, :-1].reshape(-1, VOCAB_SIZE), labels[:, 1:].reshape(-1))
        return CausalLMOutput(loss=loss, logits=logits)


class SyntheticLoss:
    """A slowly decaying loss curve with bounded noise: nothing a spike detector should flag."""

    def __init__(self, seed: int, steps: int) -> None:
        self.generator = torch.Generator().manual_seed(seed)
        self.scale = max(steps / 3.0, 1.0)
        self.t = 0

    def next(self) -> torch.Tensor:
        self.t += 1
        noise = (float(torch.rand((), generator=self.generator)) - 0.5) * 0.02
        return torch.tensor(2.0 + 3.0 * math.exp(-self.t / self.scale) + noise)


class Batches:
    """Fresh micro-batches from a seeded generator, so that every sample is distinct data."""

    def __init__(self, seed: int) -> None:
        self.generator = torch.Generator().manual_seed(seed)

    def next(self) -> dict[str, torch.Tensor]:
        ids = torch.randint(0, VOCAB_SIZE, (BATCH_SIZE, SEQ_LEN), generator=self.generator)
        return {"input_ids": ids, "labels": ids.clone(), "attention_mask": torch.ones_like(ids)}


class HookTimer:
    """Time inside plugin hooks, accumulated per step (through the manager's call monitor, as benchmarks/overhead.py does)."""

    def __init__(self, manager: Any) -> None:
        self.seconds = 0.0
        time_hook_calls(manager, self._add)

    def _add(self, hook: str, plugin: str, kwargs: dict[str, Any], seconds: float) -> None:
        self.seconds += seconds

    def take(self) -> float:
        seconds, self.seconds = self.seconds, 0.0
        return seconds


def rss_mb() -> float:
    """Resident set size of this process, from /proc (MB)."""
    with open("/proc/self/statm", encoding="ascii") as f:
        pages = int(f.read().split()[1])
    return pages * os.sysconf("SC_PAGE_SIZE") / 2**20


def tree_bytes(folder: Path) -> int:
    """Total size of the files under ``folder`` (what the harness wrote so far).

    An open data ledger is longer than its lines: its mapped window (``harness.core.mapped_lines``) is allocated ahead,
    a megabyte at a time, and holds NULs past the last line. Only the lines count (``written_end``), so bytes per step
    measure what was written, not when the next window happened to be allocated.
    """
    total = 0
    for root, _, files in os.walk(folder):
        for name in files:
            with contextlib.suppress(OSError):
                with open(os.path.join(root, name), "rb") as handle:
                    total += written_end(handle.fileno())
    return total


def build_trainer(out: str, steps: int) -> Trainer:
    """A real Trainer on the tiny module; training_step/compute_loss are replaced below, before attach."""
    torch.manual_seed(SEED)
    model = TinyLM()
    args = TrainingArguments(
        output_dir=out, max_steps=steps, per_device_train_batch_size=BATCH_SIZE, gradient_accumulation_steps=GRAD_ACCUM,
        learning_rate=1e-6, optim="sgd", logging_steps=LOGGING_STEPS, save_strategy="no", eval_strategy="no",
        report_to="none", use_cpu=True, disable_tqdm=True, dataloader_num_workers=0, seed=SEED,
    )
    from datasets import Dataset

    rows = Batches(SEED + 7).next()  # a small recorded train set: inspect_dataset sees a real dataset
    train = Dataset.from_dict({k: v.tolist() for k, v in rows.items()})
    trainer = Trainer(model=model, args=args, train_dataset=train)
    trainer.remove_callback(PrinterCallback)
    return trainer


def stand_ins(trainer: Trainer, losses: SyntheticLoss) -> None:
    """Instance-level ``compute_loss``/``training_step`` that skip the model: the harness wraps these like the real ones."""

    def compute_loss(model: Any, inputs: Any, return_outputs: bool = False, num_items_in_batch: Any = None) -> Any:
        return losses.next()

    def training_step(model: Any, inputs: Any, num_items_in_batch: Any = None) -> Any:
        loss = trainer.compute_loss(model, inputs, num_items_in_batch=num_items_in_batch)  # the harness's wrapper
        return loss.detach() / GRAD_ACCUM

    trainer.compute_loss = compute_loss  # type: ignore[method-assign]
    trainer.training_step = training_step  # type: ignore[method-assign]


class Driver:
    """The Trainer's inner loop by hand (transformers' ``_inner_training_loop`` order), one optimizer step at a time."""

    def __init__(self, trainer: Trainer, steps: int, seed: int) -> None:
        self.trainer = trainer
        self.batches = Batches(seed)
        trainer.create_optimizer_and_scheduler(num_training_steps=steps)
        for p in trainer.model.parameters():  # recorded gradients: set once, kept (no zero_grad)
            p.grad = torch.randn_like(p) * 1e-3
        self.tr_loss = torch.zeros(())
        self.last_logged = 0

    def begin(self) -> None:
        t = self.trainer
        t.control = t.callback_handler.on_train_begin(t.args, t.state, t.control)

    def next_micro_batches(self) -> list[dict[str, torch.Tensor]]:
        return [self.batches.next() for _ in range(GRAD_ACCUM)]

    def step(self, micro: list[dict[str, torch.Tensor]]) -> None:
        t = self.trainer
        t.control = t.callback_handler.on_step_begin(t.args, t.state, t.control)
        t.current_gradient_accumulation_steps = GRAD_ACCUM
        for inputs in micro:
            self.tr_loss += t.training_step(t.model, inputs, None)
        grad_norm = t._get_grad_norm(t.model, grad_norm=None)
        t.control = t.callback_handler.on_pre_optimizer_step(t.args, t.state, t.control)
        t.optimizer.step()
        t.control = t.callback_handler.on_optimizer_step(t.args, t.state, t.control)
        learning_rate = t._get_learning_rate()
        t.lr_scheduler.step()
        t.state.global_step += 1
        t.control = t.callback_handler.on_step_end(t.args, t.state, t.control)
        if t.control.should_log and t.state.global_step > self.last_logged:
            logs = {"loss": float(self.tr_loss) / (t.state.global_step - self.last_logged),
                    "grad_norm": float(grad_norm), "learning_rate": learning_rate}
            self.tr_loss.zero_()
            self.last_logged = t.state.global_step
            t.control = t.callback_handler.on_log(t.args, t.state, t.control, logs)  # Trainer.log, without its log_history

    def end(self) -> None:
        t = self.trainer
        t.control = t.callback_handler.on_train_end(t.args, t.state, t.control)


class Harnessed:
    """One Trainer with the harness attached (all default plugins), driven step by step."""

    def __init__(self, out: str, steps: int, seed: int, config: dict[str, Any] | None = None) -> None:
        self.trainer = trainer = build_trainer(out, steps)
        stand_ins(trainer, SyntheticLoss(seed + 1, steps))
        self.ctx = harness.attach(trainer, config=config)
        self.run_dir = Path(self.ctx.run_dir)
        self.hooks = HookTimer(self.ctx.manager)
        self.driver = Driver(trainer, steps, seed)

    def step(self) -> tuple[float, float]:
        """One optimizer step: (its wall time, the time inside plugin hooks); the batches are made before the clock starts."""
        micro = self.driver.next_micro_batches()
        began = time.perf_counter()
        self.driver.step(micro)
        return time.perf_counter() - began, self.hooks.take()

    def train(self, body: Any) -> None:
        """``body()`` between train begin and train end, inside what ``trainer.train()`` runs: the run lock, run.json,
        ``on_run_start``, and at the end ``on_run_end`` and the run-end report."""

        def train(*_: Any, **__: Any) -> None:
            self.driver.begin()
            body()
            self.driver.end()

        with quiet_harness_log():
            self.trainer._harness_bridge.run_train(train, (), {})


@dataclass
class Window:
    """The steps before one mark, the long run's and the fresh reference's, interleaved."""

    walls: list[float] = field(default_factory=list)
    hooks: list[float] = field(default_factory=list)
    fresh: list[float] = field(default_factory=list)
    bytes_at_open: int = 0

    def row(self, step: int, written: int) -> dict[str, float]:
        n = max(len(self.walls), 1)
        long_us, fresh_us = statistics.median(self.walls) * 1e6, statistics.median(self.fresh) * 1e6
        return {"step": step, "fresh_steps": len(self.fresh), "wall_us": long_us, "fresh_us": fresh_us, "ratio": long_us / fresh_us,
                "mean_us": statistics.fmean(self.walls) * 1e6, "hooks_us": statistics.median(self.hooks) * 1e6, "rss": rss_mb(),
                "bytes_per_step": (written - self.bytes_at_open) / n, "tree_mb": written / 2**20}


def format_row(row: dict[str, float]) -> str:
    return (f"{row['step']:>7} | {row['wall_us']:>8.0f} | {row['fresh_us']:>8.0f} | {row['ratio']:>6.3f} | {row['mean_us']:>8.0f} | "
            f"{row['hooks_us']:>8.0f} | {row['rss']:>7.1f} | {row['bytes_per_step']:>10.1f} | {row['tree_mb']:>11.2f}")


def marks_for(steps: int) -> list[int]:
    """1k, 10k, 30k, 100k up to ``steps``; a short run gets steps/10, steps/2 and steps."""
    marks = [m for m in MARKS if m <= steps]
    if len(marks) < 2:
        marks = sorted({max(steps // 10, 1), max(steps // 2, 1), steps})
    elif marks[-1] != steps:
        marks.append(steps)
    return marks


class LongRun:
    """The long run, with a fresh reference harness interleaved step by step over the window before each mark."""

    def __init__(self, out: str, steps: int, window: int) -> None:
        self.out = out
        self.steps = steps
        self.window = window
        self.marks = marks_for(steps)
        self.long = Harnessed(out, steps, SEED)
        self.rows: list[dict[str, float]] = []
        self.step = 0
        self.rss_start = self.rss_loop_end = 0.0
        self.ended = 0.0

    def body(self) -> None:
        self.rss_start = rss_mb()
        for mark in self.marks:
            width = min(self.window, max(mark // 2, 1))
            while self.step < mark - width:
                self.long.step()
                self.step += 1
            window = Window(bytes_at_open=tree_bytes(self.long.run_dir))
            with tempfile.TemporaryDirectory(prefix="harness-longrun-fresh-") as fresh_out:
                fresh = Harnessed(fresh_out, width, SEED + 100 + mark, config={"report": False})
                fresh.train(lambda: self._interleave(fresh, window, width))
                del fresh
            row = window.row(self.step, tree_bytes(self.long.run_dir))
            self.rows.append(row)
            print(format_row(row), flush=True)
        self.rss_loop_end = rss_mb()
        self.ended = time.perf_counter()

    def _interleave(self, fresh: Harnessed, window: Window, width: int) -> None:
        """``width`` steps of each, alternating which goes first, so that load on the machine hits both alike."""
        for i in range(width):
            pair = (self.long, fresh) if i % 2 == 0 else (fresh, self.long)
            for side in pair:
                wall, hooks = side.step()
                if side is self.long:
                    window.walls.append(wall)
                    window.hooks.append(hooks)
                else:
                    window.fresh.append(wall)
            self.step += 1


def run(steps: int, window: int, plots: bool, keep: Path | None = None) -> dict[str, Any]:
    """Drive ``steps`` steps, print one table row per mark, end the run, time ``harness report``; return what the verdicts need."""
    with contextlib.ExitStack() as stack:
        out = str(keep) if keep is not None else stack.enter_context(tempfile.TemporaryDirectory(prefix="harness-longrun-"))
        long_run = LongRun(out, steps, window)
        ctx = long_run.long.ctx
        print(f"plugins: {', '.join(ctx.manager.names)}")
        print(TABLE_HEADER)
        print("-" * len(TABLE_HEADER))
        began = time.perf_counter()
        long_run.long.train(long_run.body)
        run_end = time.perf_counter() - long_run.ended
        loop_seconds = long_run.ended - began
        codes = sorted({f.code for f in ctx.findings})
        for finding in ctx.findings[:5]:  # a synthetic run should make none: say what they were
            print(f"finding {finding.code} at step {finding.step}: {' '.join(str(finding.message).split())[:300]}")
        from harness.tools.report import print_report

        report_began = time.perf_counter()
        with contextlib.redirect_stdout(io.StringIO()) as printed:
            rc = print_report(Path(out), plots=plots)
        report_seconds = time.perf_counter() - report_began
        verdict = next((line for line in printed.getvalue().splitlines() if ": " in line), "").split(": ", 1)[-1]
        return {"rows": long_run.rows, "rss_start": long_run.rss_start, "rss_loop_end": long_run.rss_loop_end, "rss_end": rss_mb(),
                "run_end": run_end, "report": report_seconds, "report_rc": rc, "findings": len(ctx.findings), "codes": codes,
                "loop_seconds": loop_seconds, "verdict": verdict, "harness_mb": tree_bytes(long_run.long.run_dir) / 2**20}


@contextlib.contextmanager
def quiet_harness_log() -> Any:
    """The harness's info lines (report written, calibration) would break up the table."""
    logger = logging.getLogger("harness")
    level = logger.level
    logger.setLevel(logging.WARNING)
    try:
        yield
    finally:
        logger.setLevel(level)


def print_verdicts(result: dict[str, Any], steps: int) -> bool:
    """The verdict lines; True when both budgets hold."""
    rows = result["rows"]
    first, last = rows[0], rows[-1]
    ratio = last["ratio"]
    time_ok = ratio <= 1.0 + TIME_TOLERANCE
    growth = result["rss_loop_end"] - result["rss_start"]
    rss_ok = growth < RSS_BUDGET_MB
    print(f"run: {steps} steps in {result['loop_seconds']:.1f} s; {result['findings']} findings ({', '.join(result['codes']) or 'none'}); "
          f"run end with its report {result['run_end']:.2f} s; harness/ holds {result['harness_mb']:.2f} MB")
    print(f"per-step time at step {last['step']} vs a fresh run's first {last['fresh_steps']} steps: {last['wall_us']:.0f} us / "
          f"{last['fresh_us']:.0f} us = {ratio:.3f}x, interleaved step by step ({'within' if time_ok else 'OVER'} the "
          f"{1 + TIME_TOLERANCE:.2f}x budget); unpaired, step {last['step']} vs step {first['step']} of this run: "
          f"{last['wall_us'] / first['wall_us']:.3f}x (moved by other load on the machine)")
    print(f"RSS growth over the run: {growth:+.1f} MB ({result['rss_start']:.1f} MB at the first step -> {result['rss_loop_end']:.1f} MB "
          f"at the last; {'within' if rss_ok else 'OVER'} the {RSS_BUDGET_MB:.0f} MB budget); after run end and the report: "
          f"{result['rss_end']:.1f} MB (one-off: the report's imports and plots)")
    print(f"harness report build time: {result['report']:.2f} s (exit {result['report_rc']}; {result['verdict']})")
    return time_ok and rss_ok


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=None, help="optimizer steps (default 100000, --quick 2000)")
    parser.add_argument("--quick", action="store_true", help="a short run (2000 steps): a smoke test")
    parser.add_argument("--window", type=int, default=1000, help="steps before each mark whose median is printed (default 1000)")
    parser.add_argument("--no-plots", action="store_true", help="build the report without plots")
    parser.add_argument("--keep", type=Path, default=None, metavar="DIR",
                        help="train into DIR (a new folder) and keep it, e.g. to time `harness report DIR` again")
    args = parser.parse_args(argv)
    args.steps = args.steps if args.steps is not None else (2000 if args.quick else 100_000)
    if args.steps < 10:
        parser.error("--steps must be at least 10")
    if args.window < 2:
        parser.error("--window must be at least 2")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    hf_logging.set_verbosity_error()
    warnings.filterwarnings("ignore")
    torch.set_num_threads(1)
    print(f"long run: {args.steps} optimizer steps, grad accumulation {GRAD_ACCUM}, micro-batch {BATCH_SIZE}x{SEQ_LEN}, "
          f"logging every {LOGGING_STEPS}, torch {torch.__version__}; medians over the {args.window} steps before each mark "
          "(half the mark when smaller), a fresh harness interleaved there as the reference")
    if args.keep is not None and args.keep.exists():
        raise SystemExit(f"long_run.py: --keep {args.keep} exists; the run needs a new folder. Fix: remove it or name another.")
    result = run(args.steps, args.window, plots=not args.no_plots, keep=args.keep)
    ok = print_verdicts(result, args.steps)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
