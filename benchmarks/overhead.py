"""Harness overhead benchmark: plain ``transformers.Trainer`` vs the same Trainer with ``harness.attach``.

Two numbers, both relative to the same run, so they mean the same on any machine:

- the time inside plugin hooks per step (the gated number: the budget is
  0.5 ms), with its share of the plain median step. It is measured on the
  harness side only and barely moves with the machine's load;
- the step-time ratio (harness median step time / plain median step time;
  the budget is 1.03). The hooks are timed in a third run per round, so
  that the timing itself is not in the ratio. Runs alternate plain, harness ... in
  one process with the same seed, model init, data and TrainingArguments, so
  drift (thermal, other load) hits both sides alike; every other round runs
  the harness first (ABBA), so a position in the round costs both alike. Whole runs used to
  land on one of two levels of step time, 10-20% apart (glibc moving its
  mmap threshold: ``bench_env.steady_allocator`` now fixes it for both
  sides); rounds on a shared 2-core machine still scatter by a few percent,
  so there are many short rounds: the table gives every round's ratio, then
  their median with its interquartile range, and the ratio of the pooled
  medians. The harness against itself (``--baseline harness``) gave pooled
  ratios of 0.990-1.013x at 16 rounds: that spread, about 0.01, is the
  measurement's own, so the default is 32 rounds (about two minutes).

    python benchmarks/overhead.py [--steps N] [--rounds R] [--warmup W] [--quick] [--plugins a,b] [--option p.key=value]

The last printed line is always
``overhead ratio (harness/plain median step time): X.XXXx``.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
import warnings
from dataclasses import dataclass, field
from typing import Any

# Offline before anything from the HF stack is imported; the harness must come
# up with its defaults only, so no config or plugin list leaks in from the shell.
from bench_env import offline_defaults, steady_allocator, time_hook_calls  # noqa: E402 - beside this script

offline_defaults()
ALLOCATOR = steady_allocator()  # before torch allocates: both sides' tensors on the same kind of memory

import torch  # noqa: E402
import yaml  # noqa: E402
from transformers import PrinterCallback, Trainer, TrainerCallback, TrainingArguments  # noqa: E402
from transformers.utils import logging as hf_logging  # noqa: E402

import harness  # noqa: E402
from harness.lib.tiny import build_tiny_llama, corpus_lines, lm_dataset, train_tokenizer  # noqa: E402

VOCAB_SIZE = 512
HIDDEN_SIZE = 256
NUM_LAYERS = 2
NUM_HEADS = 4
INTERMEDIATE_SIZE = 1024
SEQ_LEN = 64
BATCH_SIZE = 4
SEED = 0
LOGGING_STEPS = 10
EVAL_EXAMPLES = 500  # same in both runs; keeps on_log in the measured path

BENCHMARK_MODEL = (
    f"tiny Llama: {NUM_LAYERS} layers, hidden {HIDDEN_SIZE}, {NUM_HEADS} heads, "
    f"intermediate {INTERMEDIATE_SIZE}, vocab {VOCAB_SIZE}, seq len {SEQ_LEN}, batch {BATCH_SIZE}; "
    f"an eval_dataset of {EVAL_EXAMPLES} rows that the contamination plugin watches for"
)

OPTIONS: dict[str, Any] = {}  # plugin options from --option (the harness config as a dict; empty: the defaults)
RATIO_LINE = "overhead ratio (harness/plain median step time): {ratio:.3f}x"
HOOK_BUDGET_US = 500.0  # DESIGN.md: time inside hooks per step, all plugins together
RATIO_BUDGET = 1.03
BASELINE_RATIO_LINE = "overhead ratio (harness+{plugins}/harness median step time): {ratio:.3f}x"


class StepTimer(TrainerCallback):
    """Timestamps every optimizer step, so both trainers are timed by the same code.

    Step time is the interval between consecutive ``on_step_end`` calls: one
    full loop iteration (batch fetch, forward/backward, optimizer step and
    every callback, including the harness's, whatever their order). The
    ``on_step_begin`` -> ``on_step_end`` span is kept too, for information.
    """

    def __init__(self) -> None:
        self.begins: list[float] = []
        self.ends: list[float] = []
        self.plugin_seconds: dict[str, float] = {}
        self.hook_seconds = 0.0
        self.last_step_seconds = 0.0  # hooks of the run's last step (run-end waits), kept out of the per-step time
        self.by_plugin: dict[str, float] = {}

    def on_step_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> Any:
        self.begins.append(time.perf_counter())
        return control

    def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> Any:
        self.ends.append(time.perf_counter())
        return control

    def step_times(self, warmup: int) -> list[float]:
        """Full-iteration times of the steps after ``warmup`` (step k: end[k] - end[k-1])."""
        start = max(warmup, 1)
        return [self.ends[i] - self.ends[i - 1] for i in range(start, len(self.ends))]

    def span_times(self, warmup: int) -> list[float]:
        """``on_step_begin`` -> ``on_step_end`` spans of the steps after ``warmup``."""
        return [e - b for b, e in list(zip(self.begins, self.ends, strict=True))[warmup:]]


@dataclass
class Side:
    """All kept step times of one side (plain or harness), plus per-round medians for the table."""

    steps: list[float] = field(default_factory=list)
    spans: list[float] = field(default_factory=list)
    round_medians: list[float] = field(default_factory=list)
    round_span_medians: list[float] = field(default_factory=list)

    def add(self, steps: list[float], spans: list[float]) -> None:
        self.steps.extend(steps)
        self.spans.extend(spans)
        self.round_medians.append(statistics.median(steps))
        self.round_span_medians.append(statistics.median(spans))


def training_args(output_dir: str, steps: int) -> TrainingArguments:
    """Identical arguments for both sides; nothing saved, reported or shown."""
    return TrainingArguments(
        output_dir=output_dir,
        max_steps=steps,
        per_device_train_batch_size=BATCH_SIZE,
        gradient_accumulation_steps=1,
        learning_rate=1e-3,
        logging_steps=LOGGING_STEPS,
        save_strategy="no",
        eval_strategy="no",
        report_to="none",
        use_cpu=True,
        disable_tqdm=True,
        dataloader_num_workers=0,
        seed=SEED,
        data_seed=SEED,
    )


def eval_rows() -> Any:
    """An eval dataset on both sides (never evaluated: eval_strategy is "no"), so that the default ``contamination``
    plugin indexes it and checks every training micro-batch against it, as in a real run with an eval split."""
    from datasets import Dataset

    generator = torch.Generator().manual_seed(SEED + 1)
    ids = torch.randint(0, VOCAB_SIZE, (EVAL_EXAMPLES, SEQ_LEN), generator=generator)
    return Dataset.from_dict({"input_ids": ids.tolist(), "attention_mask": torch.ones_like(ids).tolist()})


def run_once(
    tokenizer: Any, dataset: Any, steps: int, warmup: int, with_harness: bool, plugins: list[str], time_hooks: bool = False
) -> StepTimer:
    """Train a fresh, identically seeded model for ``steps`` steps; harness attached or not (``time_hooks``: every
    plugin hook call timed, which costs the harness side time of its own, so those runs give no step times).

    Plugins that keep ``training_thread_seconds`` (time spent on the training
    thread, start-up excluded) have it copied to ``timer.plugin_seconds``.
    """
    timer = StepTimer()
    with tempfile.TemporaryDirectory(prefix="harness-bench-") as out:
        model = build_tiny_llama(
            tokenizer,
            seed=SEED,
            hidden_size=HIDDEN_SIZE,
            num_layers=NUM_LAYERS,
            num_heads=NUM_HEADS,
            intermediate_size=INTERMEDIATE_SIZE,
        )
        trainer = Trainer(model=model, args=training_args(out, steps), train_dataset=dataset, callbacks=[timer], eval_dataset=eval_rows())
        trainer.remove_callback(PrinterCallback)  # its log dicts would bury the table; removed on both sides
        ctx = harness.attach(trainer, config=OPTIONS or None, plugins=plugins or None) if with_harness else None
        if ctx is not None and time_hooks:
            _time_hooks(ctx.manager, timer, warmup, steps)
        trainer.train()
        if ctx is not None:
            for name in plugins:
                plugin = ctx.manager.plugin(name)
                if plugin is not None and hasattr(plugin, "training_thread_seconds"):
                    timer.plugin_seconds[name] = plugin.training_thread_seconds
    if len(timer.ends) != steps:
        raise RuntimeError(f"expected {steps} optimizer steps, timed {len(timer.ends)}")
    return timer


PER_STEP_HOOKS = {"inspect_batch", "on_loss", "on_before_optimizer_step", "on_step_agreed", "on_step_end", "on_log", "on_metrics",
                  "on_finding"}


def _time_hooks(manager: Any, timer: StepTimer, warmup: int, steps: int) -> None:
    """Accumulate the time spent inside plugin hooks after the warm-up steps: what the harness adds per ordinary step.

    Once-per-run work inside the first steps (the rerun plugin's calibration
    at step 2, the first step's extra checks) falls in the warm-up, like the
    step times that the ratio drops; the last step's (the contamination
    checker's last lookups, waited for so that they are agreed before the run
    ends) is kept apart in ``last_step_seconds``. Both are fixed costs per
    run, not per step.
    """
    def record(hook: str, plugin_name: str, kwargs: dict[str, Any], spent: float) -> None:
        # run start/end work (the dataset index, opening the ledger) is in no step's time: not counted per step
        step = getattr(kwargs.get("ctx"), "step", None)
        if hook in PER_STEP_HOOKS and step is not None and step >= steps:
            timer.last_step_seconds += spent
        elif hook in PER_STEP_HOOKS and (step is None or step > warmup):
            timer.hook_seconds += spent
            key = f"{plugin_name}.{hook}" if os.environ.get("HARNESS_BENCH_BY_HOOK") else plugin_name
            timer.by_plugin[key] = timer.by_plugin.get(key, 0.0) + spent

    time_hook_calls(manager, record)


def prime(tokenizer: Any, dataset: Any, warmup: int) -> None:
    """One short untimed plain run: the process's first Trainer pays for lazy imports,
    allocator growth and kernel selection, which would otherwise land on round 1's plain side."""
    run_once(tokenizer, dataset, warmup + 3, warmup, False, [])


def grad_sync_check_seconds(tokenizer: Any, dataset: Any, repeats: int = 20) -> float:
    """Median time of one ``grad_sync`` check on the benchmark model, in one process.

    The single-process benchmark never runs a check (there is nothing to
    compare), so this times the check's own work directly: fingerprints of
    every weight and gradient, one gather (the identity here; over gloo it
    moves a few numbers per tensor) and the comparison.
    """
    from types import SimpleNamespace

    from harness.plugins.grad_sync import GradSync

    model = build_tiny_llama(tokenizer, seed=SEED, hidden_size=HIDDEN_SIZE, num_layers=NUM_LAYERS, num_heads=NUM_HEADS,
                             intermediate_size=INTERMEDIATE_SIZE)
    batch = {k: torch.tensor(dataset[:BATCH_SIZE][k]) for k in ("input_ids", "attention_mask", "labels")}
    model(**batch).loss.backward()
    plugin = GradSync()
    plugin.mode, plugin._described, plugin._params = "ddp", "benchmark", list(model.named_parameters())
    ctx = SimpleNamespace(is_main=False, rank=0)
    times = []
    for _ in range(repeats):
        began = time.perf_counter()
        plugin.on_before_optimizer_step(ctx=ctx, step=plugin.options.every, model=model, optimizer=None)
        times.append(time.perf_counter() - began)
    return statistics.median(times)


def ms(seconds: float) -> str:
    """Milliseconds, aligned for the table."""
    return f"{seconds * 1e3:8.2f}"


def quartiles(values: list[float]) -> tuple[float, float, float]:
    """First quartile, median and third quartile (the median alone for fewer than two values)."""
    if len(values) < 2:
        return values[0], values[0], values[0]
    q1, q2, q3 = statistics.quantiles(values, n=4, method="inclusive")
    return q1, q2, q3


def print_table(plain: Side, harnessed: Side) -> None:
    """Per-round medians: full step time, the begin->end span, and the ratio of full step times."""
    print(f"{'round':>5} | {'plain ms':>8} | {'harness ms':>10} | {'ratio':>6} | {'plain span':>10} | {'harness span':>12}")
    print("-" * 70)
    rows = zip(plain.round_medians, harnessed.round_medians, plain.round_span_medians, harnessed.round_span_medians, strict=True)
    for i, (p, h, ps, hs) in enumerate(rows, start=1):
        print(f"{i:>5} | {ms(p)} | {ms(h):>10} | {h / p:6.3f} | {ms(ps):>10} | {ms(hs):>12}")
    print("-" * 70)
    p, h = statistics.median(plain.steps), statistics.median(harnessed.steps)
    ps, hs = statistics.median(plain.spans), statistics.median(harnessed.spans)
    print(f"{'all':>5} | {ms(p)} | {ms(h):>10} | {h / p:6.3f} | {ms(ps):>10} | {ms(hs):>12}")
    ratios = [h / p for p, h in zip(plain.round_medians, harnessed.round_medians, strict=True)]
    q1, q2, q3 = quartiles(ratios)
    print(f"per-round ratio: median {q2:.3f}x, interquartile range {q1:.3f}-{q3:.3f} over {len(ratios)} rounds "
          f"(min {min(ratios):.3f}, max {max(ratios):.3f})")


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    """CLI; ``--quick`` is a smoke test that finishes well under a minute."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=None, help="optimizer steps per run (default 30, quick 15)")
    parser.add_argument("--rounds", type=int, default=None, help="plain+harness pairs (default 32, quick 2)")
    parser.add_argument("--warmup", type=int, default=None, help="leading steps dropped per run (default 5, quick 3)")
    parser.add_argument("--quick", action="store_true", help="few steps and two rounds: a smoke test")
    parser.add_argument("--threads", type=int, default=os.cpu_count() or 1, help="torch.set_num_threads (default: cpu count)")
    parser.add_argument("--plugins", default="", help="comma-separated extra plugins passed to harness.attach(plugins=...)")
    parser.add_argument(
        "--option", action="append", default=[], metavar="PLUGIN.KEY=VALUE",
        help="a plugin option for the measured side (YAML value), e.g. layer_stats.interval=5 (repeatable)",
    )
    parser.add_argument(
        "--baseline",
        choices=("plain", "harness"),
        default="plain",
        help="what the measured side is compared with: the plain Trainer (default) or the harness with its "
        "default plugins only (isolates the cost of --plugins)",
    )
    args = parser.parse_args(argv)
    quick = (15, 2, 3)
    full = (30, 32, 5)
    steps, rounds, warmup = quick if args.quick else full
    args.steps = args.steps if args.steps is not None else steps
    args.rounds = args.rounds if args.rounds is not None else rounds
    args.warmup = args.warmup if args.warmup is not None else warmup
    if args.steps - max(args.warmup, 1) < 1:
        parser.error("--steps must exceed --warmup so that at least one step is timed")
    if args.rounds < 1:
        parser.error("--rounds must be at least 1")
    return args


def quiet() -> None:
    """Trainer chatter would bury the table; the benchmark prints only what it measured."""
    hf_logging.set_verbosity_error()
    warnings.filterwarnings("ignore")


def main(argv: list[str] | None = None) -> int:
    """Alternate plain and harness runs, then print per-round medians and the overall ratio last."""
    args = parse_args(argv)
    quiet()
    torch.set_num_threads(args.threads)
    plugins = [p.strip() for p in args.plugins.split(",") if p.strip()]
    for item in args.option:
        key, _, value = item.partition("=")
        plugin, _, option = key.partition(".")
        OPTIONS.setdefault(plugin, {})[option] = yaml.safe_load(value)
    tokenizer = train_tokenizer(corpus_lines(), vocab_size=VOCAB_SIZE)
    dataset = lm_dataset(tokenizer, seq_len=SEQ_LEN, n_rows=args.steps * BATCH_SIZE)
    print(f"benchmark model: {BENCHMARK_MODEL}")
    print(
        f"steps {args.steps} (warmup {args.warmup} dropped), rounds {args.rounds}, threads {args.threads}, "
        f"torch {torch.__version__}, plugins extra: {plugins or 'none'}; {ALLOCATOR}"
    )
    prime(tokenizer, dataset, args.warmup)
    plain, harnessed = Side(), Side()
    plugin_seconds: dict[str, float] = {}
    hook_seconds = 0.0
    last_step_seconds = 0.0
    by_plugin: dict[str, float] = {}
    started = time.perf_counter()
    baseline_harness = args.baseline == "harness"
    for round_index in range(args.rounds):
        # ABBA: every other round runs the measured side first, so that whatever the position in a round costs (what
        # the run before left behind) falls on both sides alike
        order = ((plain, baseline_harness, []), (harnessed, True, plugins))
        for side, with_harness, extra in order if round_index % 2 == 0 else order[::-1]:
            timer = run_once(tokenizer, dataset, args.steps, args.warmup, with_harness, extra)
            side.add(timer.step_times(args.warmup), timer.span_times(args.warmup))
            for name, seconds in timer.plugin_seconds.items():
                plugin_seconds[name] = plugin_seconds.get(name, 0.0) + seconds
        # the hooks are timed in a run of their own: timing ~30 calls a step costs the harness side ~0.5% of a step
        timer = run_once(tokenizer, dataset, args.steps, args.warmup, True, plugins, time_hooks=True)
        hook_seconds += timer.hook_seconds
        last_step_seconds += timer.last_step_seconds
        for name, seconds in timer.by_plugin.items():
            by_plugin[name] = by_plugin.get(name, 0.0) + seconds
    print(f"timed in {time.perf_counter() - started:.1f} s; step = on_step_end to on_step_end, span = begin to end")
    if baseline_harness:
        print("baseline: the harness with its default plugins; measured: the same plus " + ", ".join(plugins))
    print_table(plain, harnessed)
    timed_steps = args.rounds * max(args.steps - args.warmup - 1, 1)  # after the warm-up, as step times are; the last step apart
    hook_per_step = hook_seconds / timed_steps
    verdict = "within" if hook_per_step * 1e6 <= HOOK_BUDGET_US else "OVER"
    print(
        f"time inside plugin hooks after the warm-up: {hook_per_step * 1e6:.0f} us per step "
        f"({hook_per_step / statistics.median(plain.steps) * 100:.2f}% of the baseline median step; "
        f"{verdict} the {HOOK_BUDGET_US:.0f} us budget)"
    )
    print(f"  plus, once per run, the last step's hooks: {last_step_seconds / args.rounds * 1e3:.2f} ms "
          "(run-end waits: the contamination checker's last lookups are agreed before the run ends)")
    spent = ", ".join(f"{name} {seconds / timed_steps * 1e6:.0f}" for name, seconds in sorted(by_plugin.items(), key=lambda kv: -kv[1]))
    print(f"  by plugin (us per step): {spent}")
    for name, seconds in plugin_seconds.items():
        per_step = seconds / (args.rounds * args.steps)
        print(f"training-thread time of plugin {name}: {per_step * 1e6:.1f} us per step (logging every {LOGGING_STEPS} steps)")
    check = grad_sync_check_seconds(tokenizer, dataset)
    every = 50
    print(
        f"grad_sync check (multi-process runs only; timed here in one process): {check * 1e3:.2f} ms, "
        f"{check / statistics.median(plain.steps) * 100:.1f}% of a step, {check / every / statistics.median(plain.steps) * 100:.2f}% "
        f"amortised over its default {every} steps"
    )
    ratio = statistics.median(harnessed.steps) / statistics.median(plain.steps)
    print(f"step-time ratio {ratio:.3f}x: {'within' if ratio <= RATIO_BUDGET else 'OVER'} the {RATIO_BUDGET} budget "
          "(the pooled medians of every timed step; the per-round spread is above)")
    print(RATIO_LINE.format(ratio=ratio) if not baseline_harness else BASELINE_RATIO_LINE.format(ratio=ratio, plugins="+".join(plugins)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
