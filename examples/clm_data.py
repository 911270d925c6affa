"""Write text files for ``examples/run_clm.py``: templated arithmetic questions, like many small eval suites.

Every line is one question in one template (``Question: What is 7 times 3?
Answer: 21.``), so training and eval text share template n-grams by design:
the case where a contamination check must not cry wolf. Train and eval
questions are disjoint pairs. ``--plant START:COUNT`` copies eval lines
``START..START+COUNT-1`` verbatim into the training file (a real leak, the
lines together); ``--leak FRACTION`` makes that share of the eval lines
copies of training lines, each from its own place (a leak line by line, as
when a validation file was drawn from the training text);
``--questions_per_line K`` puts K questions on a line (longer lines); and
``--poison_line N`` inserts one line of random characters at line ``N`` of the
training file (a corrupt record: a loss spike wherever its block is drawn).
"""

from __future__ import annotations

import argparse
import random
import string
import sys
from pathlib import Path

TEMPLATE = "Question: What is {a} times {b}? Answer: {c}."


def questions(seed: int) -> list[str]:
    """Every pair 0..19 x 0..19 once, shuffled by ``seed``."""
    pairs = [(a, b) for a in range(20) for b in range(20)]
    random.Random(seed).shuffle(pairs)
    return [TEMPLATE.format(a=a, b=b, c=a * b) for a, b in pairs]


def poison(seed: int, length: int = 240) -> str:
    """A line of random characters (what a broken decoder or a binary file in the corpus looks like)."""
    rng = random.Random(seed + 1)
    alphabet = string.ascii_letters + string.digits + string.punctuation
    return "".join(rng.choice(alphabet) for _ in range(length))


def write(out: Path, eval_lines: int, seed: int, plant: str | None, poison_line: int | None, repeats: int,
          leak: float = 0.0, per_line: int = 1) -> tuple[Path, Path]:
    qs = questions(seed)
    lines = [" ".join(qs[i : i + per_line]) for i in range(0, len(qs) - per_line + 1, per_line)]
    eval_qs, train_qs = lines[:eval_lines], lines[eval_lines:]
    if leak:
        rng = random.Random(seed + 2)
        copied = rng.sample(range(len(eval_qs)), round(len(eval_qs) * leak))
        for i, source in zip(sorted(copied), rng.sample(range(len(train_qs)), len(copied))):
            eval_qs[i] = train_qs[source]
    train = [q for _ in range(repeats) for q in train_qs]
    if plant:
        start, _, count = plant.partition(":")
        leaked = eval_qs[int(start) : int(start) + int(count)]
        at = len(train) // 2
        train[at:at] = leaked
    if poison_line is not None:
        train.insert(poison_line, poison(seed))
    out.mkdir(parents=True, exist_ok=True)
    train_path, eval_path = out / "train.txt", out / "validation.txt"
    train_path.write_text("\n".join(train) + "\n", encoding="utf-8")
    eval_path.write_text("\n".join(eval_qs) + "\n", encoding="utf-8")
    return train_path, eval_path


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--out", required=True, help="folder for train.txt and validation.txt")
    p.add_argument("--eval_lines", type=int, default=80, help="lines held out for eval")
    p.add_argument("--questions_per_line", type=int, default=1, help="questions on one line (longer lines)")
    p.add_argument("--leak", type=float, default=0.0, help="share of the eval lines that are copies of training lines, each from its own place")
    p.add_argument("--repeats", type=int, default=1, help="how often the training questions are repeated")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--plant", default=None, help="START:COUNT eval lines copied into training")
    p.add_argument("--poison_line", type=int, default=None, help="insert one line of random characters at this line")
    args = p.parse_args(argv)
    train, evals = write(Path(args.out), args.eval_lines, args.seed, args.plant, args.poison_line, args.repeats, args.leak,
                         args.questions_per_line)
    print(f"wrote {train} and {evals}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
