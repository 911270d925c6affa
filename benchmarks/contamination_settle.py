"""The contamination plugin's step-end verdicts on joined eval rows: time per step on the training thread.

A ``run_clm.py``-style eval set: validation lines of 6-40 tokens joined and
cut into 64-token blocks (each block's line breaks are its cuts), a fifth of
the lines copied into training, and training text made the same way (its
lines shuffled, joined, cut into 64-token rows, 8 rows a step by default). Each step the
matched windows go into the ledger with a sighting per matched row, and
the plugin's ``_settle`` runs as at a step end in one process (the ranks'
agreement, the verdicts, a CONTAMINATION finding for each block that became
dirty): this is what the per-step hook budget (0.5 ms for all plugins) pays
for. The
lookups themselves run in the background thread and are not timed here
(``benchmarks/contamination.py`` measures them). Prints the time per step
(median, 90th percentile, max, mean over steps with matches), how many full
judgements ran and how many blocks became dirty.

    python benchmarks/contamination_settle.py [--lines 1200] [--train-lines 6000] [--rows 8] [--seed 0]
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time

from types import SimpleNamespace
from typing import Any

import numpy as np

from harness.lib.ngrams import EvalExample, NgramIndex
from harness.lib.overlap_ledger import MatchLedger, example_keys
from harness.plugins.contamination import Contamination
from harness.plugins.contamination.checker import Found, Job

NL = 1  # the line-break token
BLOCK = 64


def lines_of(rng: np.random.Generator, count: int, first_id: int) -> list[np.ndarray]:
    """Lines of 6-40 tokens ending in the line break; ids of their own (no n-gram shared by chance)."""
    out, next_id = [], first_id
    for _ in range(count):
        length = int(rng.integers(6, 41))
        out.append(np.r_[np.arange(next_id, next_id + length - 1), NL].astype(np.int64))
        next_id += length
    return out


def blocks(lines: list[np.ndarray]) -> np.ndarray:
    """``run_clm.py``'s group_texts: the lines joined and cut into whole blocks (the tail dropped)."""
    joined = np.concatenate(lines)
    return joined[: len(joined) // BLOCK * BLOCK].reshape(-1, BLOCK)


def eval_examples(rows: np.ndarray) -> list[EvalExample]:
    """One example per block; its cuts are where a line starts inside it."""
    return [EvalExample("eval_dataset", str(b), None, [row], [np.flatnonzero(row[:-1] == NL) + 1]) for b, row in enumerate(rows)]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--lines", type=int, default=1200, help="validation lines (default 1200)")
    parser.add_argument("--train-lines", type=int, default=6000, help="training lines besides the copies (default 6000)")
    parser.add_argument("--copied", type=float, default=0.2, help="share of the validation lines copied into training")
    parser.add_argument("--rows", type=int, default=8, help="training rows per step (default 8)")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    rng = np.random.default_rng(args.seed)
    evals = lines_of(rng, args.lines, 2)
    own = lines_of(rng, args.train_lines, 10_000_000)
    copied = [evals[i] for i in rng.choice(len(evals), int(args.copied * len(evals)), replace=False)]
    train = own + copied
    order = rng.permutation(len(train))
    train_rows = blocks([train[i] for i in order])
    plugin = Contamination()
    examples = eval_examples(blocks(evals))
    plugin.index = NgramIndex.build(examples, plugin.options.n, plugin.options.template_min_examples, plugin.options.min_length)
    plugin.ledger = ledger = MatchLedger(example_keys((e.eval_set, e.example_id) for e in examples))
    plugin._judge(0, {0: (1 << plugin.index.windows_of(0, 0)) - 1})  # numpy's lazy imports on first use: not in a step
    judged = 0
    full_judge = plugin._judge

    def counted(example: int, bits: dict[int, int]) -> dict:
        nonlocal judged
        judged += 1
        return full_judge(example, bits)

    plugin._judge = counted  # type: ignore[method-assign]
    found: list[Any] = []
    ctx = SimpleNamespace(rank=0, report=lambda code, message, **kwargs: found.append(code))
    plugin.__dict__["ctx"] = ctx
    per_step = []
    for step, start in enumerate(range(0, len(train_rows), args.rows), 1):
        rows = train_rows[start : start + args.rows]
        hits = plugin.index.query_rows(rows)
        if not hits:
            continue
        plugin._absorb(Found(Job(step, 0, 0, None, None), hits, rows))  # the windows, row edges and sightings, as in a run
        began = time.perf_counter()
        plugin._settle(ctx, [ledger.outgoing(None)])
        per_step.append(time.perf_counter() - began)
    dirty = len(ledger.reported)  # the findings stop at max_reports (20); every dirty block is marked reported
    steps = -(-len(train_rows) // args.rows)
    q = statistics.quantiles(per_step, n=10) if len(per_step) > 1 else per_step * 9
    print(f"eval: {len(examples)} blocks of {BLOCK} tokens from {args.lines} lines; training: {len(train_rows)} rows, "
          f"{steps} steps of {args.rows} rows, {len(per_step)} of them with matches")
    print(f"step end (_settle) per step with matches: median {statistics.median(per_step) * 1e6:.1f} us, 90th percentile "
          f"{q[8] * 1e6:.1f} us, max {max(per_step) * 1e6:.1f} us, mean {statistics.fmean(per_step) * 1e6:.1f} us")
    print(f"full judgements: {judged}; blocks dirty: {dirty} of {len(examples)}; "
          f"blocks with matches: {len(ledger.agreed)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
