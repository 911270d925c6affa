"""A sentence-embedding training script in the shape of sentence-transformers' own training examples.

A SentenceTransformer (a BERT encoder and mean pooling) learns, with
``MultipleNegativesRankingLoss`` and in-batch negatives, to place the first
sentence of a corpus line near the rest of that line. The batches never hold
the same text twice (``BatchSamplers.NO_DUPLICATES``, as the loss asks).
``SentenceTransformerTrainer`` trains it, saves checkpoints and, with
``--eval_steps``, reports the loss on held-out pairs. ``--stop_after_step N``
ends the job after step N with a checkpoint (a job with a time budget); the
requeued job passes ``--resume_from_checkpoint``.

Like any user's script it knows nothing about monitoring wrappers. These
machines are offline, so the "pretrained" model is a tiny BERT built from a
config with a tokenizer trained on the shipped corpus (``harness.lib.tiny``,
``harness.lib.tiny_zoo``), saved to a local folder and loaded from there as a
hub model would be.
"""

from __future__ import annotations

import argparse
import re
import sys
import tempfile
from typing import Any

from datasets import Dataset
from transformers import TrainerCallback
from sentence_transformers import SentenceTransformer, SentenceTransformerTrainer, SentenceTransformerTrainingArguments
from sentence_transformers.base.sampler import BatchSamplers
from sentence_transformers.sentence_transformer.losses import MultipleNegativesRankingLoss
from sentence_transformers.sentence_transformer.modules import Pooling, Transformer

from harness.lib.tiny import corpus_lines, train_tokenizer
from harness.lib.tiny_zoo import build_tiny_model

EVAL_PAIRS = 16
HELD_OUT_LINES = 160  # the corpus' last lines, held out for evaluation pairs
SHARED_WORDS = 8  # a held-out pair sharing a run of this many words with a training text is dropped


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--output_dir", required=True)
    p.add_argument("--max_steps", type=int, default=12)
    p.add_argument("--save_steps", type=int, default=0, help="0 disables checkpointing")
    p.add_argument("--eval_steps", type=int, default=0, help="evaluate every N steps; 0 disables evaluation")
    p.add_argument("--learning_rate", type=float, default=1e-3)
    p.add_argument("--warmup_steps", type=int, default=0)
    p.add_argument("--per_device_train_batch_size", type=int, default=8)
    p.add_argument("--hidden_size", type=int, default=64)
    p.add_argument("--num_layers", type=int, default=2)
    p.add_argument("--max_seq_length", type=int, default=64)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--logging_steps", type=int, default=1)
    p.add_argument("--report_to", default="none", help="the Trainer's report_to: none, or a comma-separated list (tensorboard,mlflow)")
    p.add_argument(
        "--stop_after_step", type=int, default=0,
        help="end this job after step N, saving a checkpoint there (a job with a time budget that a scheduler requeues); 0: never",
    )
    p.add_argument(
        "--resume_from_checkpoint", default=None,
        help="a checkpoint directory, or True for the newest checkpoint-* of --output_dir",
    )
    return p.parse_args(argv)


def resume_value(raw: str | None) -> str | bool | None:
    """What ``Trainer.train(resume_from_checkpoint=...)`` takes: True/False from the words, else the path."""
    if raw is None or raw.lower() in ("false", "none", ""):
        return None
    return True if raw.lower() == "true" else raw


def split(line: str) -> tuple[str, str] | None:
    """A line's first sentence and the rest of it (None for a one-sentence line)."""
    parts = [s for s in re.split(r"(?<=[.!?])\s+", line) if s]
    return (parts[0], " ".join(parts[1:])) if len(parts) >= 2 else None


def word_runs(text: str, n: int = SHARED_WORDS) -> set[tuple[str, ...]]:
    words = text.split()
    return {tuple(words[i : i + n]) for i in range(len(words) - n + 1)}


def pairs() -> tuple[Dataset, Dataset]:
    """Distinct (anchor, positive) training pairs, and held-out pairs sharing no text with them.

    The corpus is templated, so held-out pairs that repeat a run of
    ``SHARED_WORDS`` words of a training text are dropped, as a careful
    user's split does.
    """
    lines = corpus_lines()
    train = [p for p in dict.fromkeys(map(split, lines[:-HELD_OUT_LINES])) if p]
    trained = {text for pair in train for text in pair}
    trained_runs = set().union(*(word_runs(text) for text in trained))
    held = [p for p in dict.fromkeys(map(split, lines[-HELD_OUT_LINES:])) if p and not set(p) & trained
            and not (word_runs(p[0]) | word_runs(p[1])) & trained_runs]
    columns = ("anchor", "positive")
    return (Dataset.from_dict({c: [p[i] for p in train] for i, c in enumerate(columns)}),
            Dataset.from_dict({c: [p[i] for p in held[:EVAL_PAIRS]] for i, c in enumerate(columns)}))


def local_base_model(folder: str, hidden_size: int, num_layers: int, seed: int) -> str:
    """Write a tiny BERT encoder and its tokenizer to ``folder`` (what a hub download would leave there)."""
    tokenizer = train_tokenizer(corpus_lines())
    encoder = build_tiny_model("bert", tokenizer, "masked_lm", seed=seed, hidden_size=hidden_size, num_layers=num_layers).bert
    encoder.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder


class StopAfter(TrainerCallback):
    """Save and end the job after step ``step`` (the requeued job resumes from that checkpoint with the same arguments)."""

    def __init__(self, step: int) -> None:
        self.step = step

    def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        if state.global_step == self.step:
            control.should_save = control.should_training_stop = True


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    train_dataset, eval_dataset = pairs()
    with tempfile.TemporaryDirectory(prefix="tiny-bert-") as folder:
        encoder = Transformer(local_base_model(folder, args.hidden_size, args.num_layers, args.seed), max_seq_length=args.max_seq_length)
        model = SentenceTransformer(modules=[encoder, Pooling(encoder.get_embedding_dimension(), "mean")], device="cpu")
    training_args = SentenceTransformerTrainingArguments(
        output_dir=args.output_dir,
        max_steps=args.max_steps,
        per_device_train_batch_size=args.per_device_train_batch_size,
        per_device_eval_batch_size=args.per_device_train_batch_size,
        learning_rate=args.learning_rate,
        warmup_steps=args.warmup_steps,
        seed=args.seed,
        batch_sampler=BatchSamplers.NO_DUPLICATES,
        save_strategy="steps" if args.save_steps > 0 else "no",
        save_steps=args.save_steps if args.save_steps > 0 else 500,
        eval_strategy="steps" if args.eval_steps > 0 else "no",
        eval_steps=args.eval_steps if args.eval_steps > 0 else None,
        logging_steps=args.logging_steps,
        report_to=args.report_to.split(","),
        use_cpu=True,
        dataloader_num_workers=0,
    )
    trainer = SentenceTransformerTrainer(
        model=model,
        args=training_args,
        train_dataset=train_dataset,
        eval_dataset=eval_dataset if args.eval_steps > 0 else None,
        loss=MultipleNegativesRankingLoss(model),
    )
    if args.stop_after_step > 0:
        trainer.add_callback(StopAfter(args.stop_after_step))
    trainer.train(resume_from_checkpoint=resume_value(args.resume_from_checkpoint))
    return 0


if __name__ == "__main__":
    sys.exit(main())
