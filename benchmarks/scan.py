"""`harness scan` throughput in words mode against the janitor algorithm lm-evaluation-harness uses.

One generated raw-text corpus (a document per line, words drawn from a
Zipf-distributed vocabulary, mixed case and punctuation; default 30 M words
in 4 files), an eval set of 1,000 examples of 20-60 words, 40 of them planted
in training documents with other case and punctuation. Generated once and
cached (``--cache``, default ~/.cache/train-harness/bench-scan, a marker file
holds the parameters).

Three sides, each timed from reading the eval file and the training files to
the finished per-example verdicts:

* the janitor algorithm (lower case, punctuation deleted, split on
  whitespace, a Python set of word n-grams of the eval set, every training
  n-gram looked up), written here after lm-eval's ``janitor.py``, one process;
* ``harness.tools.scan.scan()`` with ``workers=1``;
* the same with ``workers=2``.

Each harness side runs ``--repeat`` times (default 3) and its fastest run
counts, so a burst of load on a shared machine does not decide a run of one
second; the janitor side runs once (tens of seconds). All three must find exactly the planted examples (exit 1 otherwise). Prints
words/s of each, the 2-worker/1-worker ratio and, last, the speed-up of one
worker over the janitor baseline.

    python benchmarks/scan.py [--words N] [--examples N] [--planted N] [--files N] [--n 13] [--repeat 3] [--cache DIR]
"""
from __future__ import annotations

import argparse
import json
import os
import string
import sys
import time
from pathlib import Path

import numpy as np

from harness.tools.scan import ScanOptions, scan  # imported before any clock starts

DEFAULTS = {"words": 30_000_000, "examples": 1000, "planted": 40, "files": 4, "n": 13, "vocabulary": 50_000, "seed": 0}


def _vocabulary(size: int, rng: np.random.Generator) -> list[str]:
    letters = np.frombuffer(string.ascii_lowercase.encode(), dtype=np.uint8)
    lengths = rng.integers(2, 11, size)
    words = {bytes(letters[rng.integers(0, 26, k)]).decode() for k in lengths}
    return sorted(words)


def _restyle(words: list[str], rng: np.random.Generator) -> str:
    """The same words with other case and punctuation (what the normalisation must see through)."""
    out = []
    for word in words:
        form = rng.integers(0, 4)
        word = word.upper() if form == 0 else word.capitalize() if form == 1 else word
        out.append(word + [",", ";", "!", "", ""][rng.integers(0, 5)])
    return " ".join(out) + "."


def generate(root: Path, words: int, examples: int, planted: int, files: int, n: int, vocabulary: int, seed: int) -> dict[str, object]:
    """Write the corpus under ``root`` unless a marker with the same parameters is there; returns the marker."""
    params = {"words": words, "examples": examples, "planted": planted, "files": files, "n": n, "vocabulary": vocabulary, "seed": seed, "version": 1}
    marker = root / "corpus.json"
    if marker.exists():
        stored = json.loads(marker.read_text())
        if stored.get("params") == params:
            return stored
    root.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(seed)
    vocab = np.array(_vocabulary(vocabulary, rng), dtype=object)
    ranks = np.arange(1, len(vocab) + 1, dtype=np.float64)
    weights = 1.0 / ranks**1.05
    weights /= weights.sum()
    styled = np.array([w.capitalize() for w in vocab], dtype=object)
    evals = [list(vocab[rng.choice(len(vocab), int(rng.integers(20, 61)), p=weights)]) for _ in range(examples)]
    chosen = sorted(rng.choice(examples, planted, replace=False).tolist())
    per_file = words // files
    plants = {e: (int(rng.integers(0, files)), float(rng.random())) for e in chosen}
    for f in range(files):
        ids = rng.choice(len(vocab), per_file, p=weights)
        tokens = vocab[ids].copy()
        caps = rng.random(per_file) < 0.1
        tokens[caps] = styled[ids[caps]]
        punct = rng.random(per_file)
        tokens[punct < 0.06] = tokens[punct < 0.06] + ","
        tokens[(punct >= 0.06) & (punct < 0.1)] = tokens[(punct >= 0.06) & (punct < 0.1)] + "."
        lengths = rng.integers(50, 500, per_file // 50 + 1)
        cuts = np.cumsum(lengths)
        cuts = cuts[cuts < per_file]
        documents = [" ".join(part) for part in np.split(tokens, cuts)]
        for e, (target, where) in plants.items():
            if target == f:
                d = int(where * len(documents))
                parts = documents[d].split(" ")
                documents[d] = " ".join(parts[: len(parts) // 2] + [_restyle(evals[e], rng)] + parts[len(parts) // 2 :])
        (root / f"train-{f}.txt").write_text("\n".join(documents) + "\n", encoding="utf-8")
    with open(root / "eval.jsonl", "w", encoding="utf-8") as handle:
        for e, example in enumerate(evals):
            handle.write(json.dumps({"id": f"e{e}", "text": " ".join(example)}) + "\n")
    total = sum(len(p.read_bytes().split()) for p in root.glob("train-*.txt"))
    stored = {"params": params, "planted": [f"e{e}" for e in chosen], "words": total}
    marker.write_text(json.dumps(stored), encoding="utf-8")
    return stored


# -- the janitor algorithm (after lm-evaluation-harness lm_eval/decontamination/janitor.py, python mode) ------------

def janitor(train: list[Path], eval_path: Path, n: int) -> set[str]:
    """Ids of eval examples with a training n-gram, from a set of normalised word n-grams; every training n-gram looked up."""
    table = str.maketrans(string.ascii_lowercase + string.ascii_uppercase, string.ascii_lowercase * 2, string.punctuation)
    grams: dict[str, list[int]] = {}
    ids: list[str] = []
    sizes: list[int] = []
    with open(eval_path, encoding="utf-8") as handle:
        for line in handle:
            record = json.loads(line)
            words = record["text"].translate(table).split()
            mine = {" ".join(words[i : i + n]) for i in range(len(words) - n + 1)}
            for gram in mine:
                grams.setdefault(gram, []).append(len(ids))
            ids.append(str(record["id"]))
            sizes.append(len(mine))
    matched: dict[int, set[str]] = {}
    for path in train:
        with open(path, encoding="utf-8") as handle:
            for line in handle:
                words = line.translate(table).split()
                for i in range(len(words) - n + 1):
                    gram = " ".join(words[i : i + n])
                    owners = grams.get(gram)
                    if owners is not None:
                        for e in owners:
                            matched.setdefault(e, set()).add(gram)
    return {ids[e] for e, found in matched.items() if found and sizes[e]}


def _harness(train: list[Path], eval_path: Path, n: int, workers: int, range_bytes: int | None) -> set[str]:
    extra = {"range_bytes": range_bytes} if range_bytes else {}
    result = scan([str(p) for p in train], [str(eval_path)], workers=workers, options=ScanOptions(n=n), progress=False, **extra)
    return {r["id"] for r in result.rows if r["documents_hit"]}


def _cpu_seconds() -> float:
    """User + system time of this process and its finished children (the scan's workers): shows a busy machine."""
    import resource

    own, children = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return own.ru_utime + own.ru_stime + children.ru_utime + children.ru_stime


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    for name, value in DEFAULTS.items():
        parser.add_argument(f"--{name}", type=int, default=value)
    parser.add_argument("--cache", default=str(Path.home() / ".cache" / "train-harness" / "bench-scan"))
    parser.add_argument("--range-bytes", type=int, default=0, help="bytes per work range of harness scan (default: its own)")
    parser.add_argument("--repeat", type=int, default=3, help="runs of each harness side, the fastest counts (default 3; "
                        "the janitor side, tens of seconds, runs once)")
    args = parser.parse_args(argv)
    root = Path(args.cache) / f"w{args.words}-e{args.examples}-p{args.planted}-f{args.files}-n{args.n}-v{args.vocabulary}-s{args.seed}"
    corpus = generate(root, args.words, args.examples, args.planted, args.files, args.n, args.vocabulary, args.seed)
    train = sorted(root.glob("train-*.txt"))
    eval_path = root / "eval.jsonl"
    planted = set(corpus["planted"])  # type: ignore[arg-type]
    words = int(corpus["words"])  # type: ignore[arg-type]
    print(f"corpus: {words:,} words in {len(train)} files ({sum(p.stat().st_size for p in train) / 1e6:.0f} MB), "
          f"{args.examples} eval examples, {len(planted)} planted, {args.n}-grams; cores: {os.cpu_count()}")
    rates: dict[str, float] = {}
    failed = False
    sides = [("janitor baseline", lambda: janitor(train, eval_path, args.n)),
             ("harness scan, 1 worker", lambda: _harness(train, eval_path, args.n, 1, args.range_bytes)),
             ("harness scan, 2 workers", lambda: _harness(train, eval_path, args.n, 2, args.range_bytes))]
    for name, side in sides:
        seconds = cpu = float("inf")
        for _ in range(1 if name.startswith("janitor") else max(args.repeat, 1)):  # the short sides: best of --repeat
            spent, began = _cpu_seconds(), time.perf_counter()
            found = side()
            elapsed = time.perf_counter() - began
            if elapsed < seconds:
                seconds, cpu = elapsed, _cpu_seconds() - spent
        rates[name] = words / seconds
        exact = found == planted
        failed |= not exact
        print(f"{name + ':':25} {seconds:7.2f} s = {rates[name] / 1e6:6.2f} M words/s  (cpu {cpu:.2f} s, all processes)"
              + ("" if exact else f"  WRONG: missed {sorted(planted - found)}, extra {sorted(found - planted)}"))
    one, two, base = rates["harness scan, 1 worker"], rates["harness scan, 2 workers"], rates["janitor baseline"]
    print(f"2 workers / 1 worker: {two / one:.2f}x")
    print(f"speed-up of harness scan (1 worker) over the janitor baseline: {one / base:.1f}x")
    if failed:
        print("FAILED: a side did not find exactly the planted examples", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
