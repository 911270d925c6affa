"""Contamination check throughput: the harness n-gram index vs the janitor algorithm on token ids.

Both sides get the same generated data: an eval set of token-id examples
and training batches of token ids, a few eval examples planted in them.
The harness side is what the ``contamination`` plugin runs per micro-batch
(``NgramIndex.query_rows``: rolling hashes, bitmap prefilter, binary search,
exact confirmation); the baseline is the janitor algorithm lm-evaluation-harness
uses (``lm_eval/decontamination/janitor.py``), with token ids for words: a
Python set of the eval set's n-gram keys (the n units joined by spaces), and
every training window's key looked up. Both run on one core, and both must
find the same planted examples. Prints tokens/s of each and their ratio.

    python benchmarks/contamination.py [--tokens N] [--baseline-tokens N] [--n 13]
"""
from __future__ import annotations

import argparse
import os
import sys
import time

os.environ.setdefault("OMP_NUM_THREADS", "1")  # one core, on both sides

import numpy as np  # noqa: E402

from harness.lib.ngrams import EvalExample, NgramIndex  # noqa: E402

VOCAB = 32_000
ROW = 2048
BATCH = 8


def generate(tokens: int, examples: int, seed: int = 0) -> tuple[list[np.ndarray], np.ndarray, list[int]]:
    """Eval examples (100-300 tokens), training batches [k, BATCH, ROW] with every 50th example planted once."""
    rng = np.random.default_rng(seed)
    evals = [rng.integers(0, VOCAB, rng.integers(100, 300)) for _ in range(examples)]
    batches = rng.integers(0, VOCAB, (max(tokens // (BATCH * ROW), 1), BATCH, ROW))
    planted = list(range(0, examples, 50))
    for k, e in enumerate(planted):
        b, r = k % len(batches), (k // len(batches)) % BATCH
        batches[b, r, 100 : 100 + len(evals[e])] = evals[e]
    return evals, batches, planted


def harness_side(index: NgramIndex, batches: np.ndarray) -> tuple[float, set[int]]:
    found: set[int] = set()
    began = time.perf_counter()
    for batch in batches:
        found.update(hit.example for hit in index.query_rows(batch))
    return time.perf_counter() - began, found


def baseline_side(evals: list[np.ndarray], batches: np.ndarray, n: int) -> tuple[float, set[int]]:
    """The janitor algorithm on token ids: a set of n-gram keys (ids joined by spaces), every training window's key looked up."""
    grams: dict[str, int] = {}
    for e, units in enumerate(evals):
        words = [str(u) for u in units.tolist()]
        for i in range(len(words) - n + 1):
            grams.setdefault(" ".join(words[i : i + n]), e)
    found: set[int] = set()
    began = time.perf_counter()
    for batch in batches:
        for row in batch.tolist():
            words = [str(u) for u in row]
            for i in range(len(words) - n + 1):
                e = grams.get(" ".join(words[i : i + n]))
                if e is not None:
                    found.add(e)
    return time.perf_counter() - began, found


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=16_000_000, help="training tokens for the harness side (default 16M)")
    parser.add_argument("--baseline-tokens", type=int, default=1_000_000, help="training tokens for the baseline (default 1M)")
    parser.add_argument("--examples", type=int, default=2000, help="eval examples (default 2000)")
    parser.add_argument("--n", type=int, default=13)
    args = parser.parse_args(argv)
    evals, batches, planted = generate(args.tokens, args.examples)
    index = NgramIndex.build([EvalExample("bench", str(i), None, [u]) for i, u in enumerate(evals)], n=args.n)
    harness_side(index, batches[:1])  # warm the power tables
    seconds, found = harness_side(index, batches)
    tokens = batches.size
    rate = tokens / seconds
    base_batches = batches[: max(args.baseline_tokens // (BATCH * ROW), 1)]
    base_seconds, base_found = baseline_side(evals, base_batches, args.n)
    base_rate = base_batches.size / base_seconds
    expected = {e for k, e in enumerate(planted) if k % len(batches) < len(batches)}
    assert expected <= found, f"harness missed planted examples: {sorted(expected - found)}"
    in_base = {e for k, e in enumerate(planted) if k % len(batches) < len(base_batches)}
    assert found & in_base == base_found & in_base, "the two sides disagree on the planted examples"
    print(f"eval index: {args.examples} examples, {index.windows:,} {args.n}-grams; batches of {BATCH} x {ROW} tokens, one core")
    print(f"harness n-gram index: {tokens:,} tokens in {seconds:.2f} s = {rate / 1e6:.1f} M tokens/s")
    print(f"janitor baseline:     {base_batches.size:,} tokens in {base_seconds:.2f} s = {base_rate / 1e6:.2f} M tokens/s")
    print(f"speed-up (harness/baseline tokens per second): {rate / base_rate:.1f}x")
    return 0


if __name__ == "__main__":
    sys.exit(main())
