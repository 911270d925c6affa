"""A plain Hugging Face Trainer script, written the way users already have them.

It deliberately knows nothing about any monitoring wrapper: wrappers are
expected to run it unmodified (python, torchrun, DeepSpeed). The only
non-standard import is harness.lib.tiny, which stands in for a hub model because
these machines are offline.
"""

from __future__ import annotations

import argparse
import os
import random
import sys
import time

from typing import Any, Iterator

import torch
from datasets import Dataset
from torch.utils.data import DataLoader, IterableDataset
from torch.utils.data import Dataset as TorchDataset
from transformers import Trainer, TrainerCallback, TrainingArguments, default_data_collator

from harness.stages.packing import packed_data_collator, packed_lm_dataset
from harness.lib.tiny import build_tiny_llama, corpus_lines, lm_dataset, train_tokenizer


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--output_dir", required=True)
    p.add_argument("--max_steps", type=int, default=8)
    p.add_argument("--per_device_train_batch_size", type=int, default=4)
    p.add_argument("--gradient_accumulation_steps", type=int, default=1)
    p.add_argument("--learning_rate", type=float, default=1e-3)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--save_steps", type=int, default=0, help="0 disables checkpointing")
    p.add_argument("--deepspeed", default=None, help="path to a DeepSpeed config json")
    p.add_argument("--exit_code", type=int, default=0, help="exit status after training")
    p.add_argument("--resume_from_checkpoint", default=None, help="checkpoint directory to resume from")
    p.add_argument("--dropout", type=float, default=0.0, help="attention dropout (training then draws from the RNG every step)")
    p.add_argument("--ignore_data_skip", action="store_true", help="on resume, do not skip the batches already seen")
    p.add_argument(
        "--own_dataloader", action="store_true",
        help="stream the rows through a hand-built DataLoader over an IterableDataset (a common custom-Trainer pattern "
        "that bypasses accelerate's sharding, so every rank reads the same rows)",
    )
    p.add_argument("--attn_implementation", default="sdpa", choices=["sdpa", "eager"], help="attention implementation of the model")
    p.add_argument(
        "--packing", default="none", choices=["none", "position_ids", "mask4d", "mask2d"],
        help="pack documents into rows: restarting position_ids only; plus a 4D boolean block-diagonal causal mask; or "
        "plus an all-ones 2D attention_mask (what a padding collator adds)",
    )
    p.add_argument("--slow_data_rank", type=int, default=-1, help="this rank's dataset sleeps in every __getitem__ (a straggler)")
    p.add_argument("--slow_data_seconds", type=float, default=0.0, help="seconds each __getitem__ of --slow_data_rank sleeps")
    # torchrun passes --local-rank only with --use-env off; accept it anyway.
    p.add_argument("--num_train_epochs", type=float, default=3.0, help="epochs when --max_steps is -1")
    p.add_argument("--short_data_rank", type=int, default=-1,
                   help="this rank loads a shorter training set (uneven shards: it runs out of steps before the others)")
    p.add_argument("--shuffle_rank", type=int, default=-1,
                   help="this rank shuffles its training rows without a seed before the Trainer gets them (another order than the other ranks)")
    p.add_argument("--prompt_masking", action="store_true",
                   help="mask the labels of a prefix of random length in every row, as SFT masks its prompts (uneven label counts)")
    p.add_argument("--report_to", default="none", help="the Trainer's report_to: none, or a comma-separated list (tensorboard,wandb)")
    p.add_argument("--crash_rank", type=int, default=-1, help="this rank raises ValueError at the start of --crash_step")
    p.add_argument("--crash_step", type=int, default=-1, help="the step (1-based) at whose start --crash_rank raises")
    p.add_argument("--freeze_rank", type=int, default=-1, help="this rank freezes --freeze_param at the start of --freeze_step")
    p.add_argument("--freeze_step", type=int, default=-1, help="the step (1-based) at whose start --freeze_rank freezes --freeze_param")
    p.add_argument("--freeze_param", default="", help="the parameter --freeze_rank calls requires_grad_(False) on (after DDP wrapped the model)")
    p.add_argument("--local_rank", "--local-rank", type=int, default=-1)
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    tokenizer = train_tokenizer(corpus_lines())
    model = build_tiny_llama(tokenizer, seed=args.seed, attention_dropout=args.dropout, attn_implementation=args.attn_implementation)
    train_dataset: Any = lm_dataset(tokenizer, seq_len=64)
    collator: Any = default_data_collator
    if args.packing != "none":
        train_dataset = packed_lm_dataset(Dataset.from_dict({"text": corpus_lines()}), tokenizer, seq_len=128, keep_doc_ids=True)
        collator = PackedCollator(args.packing)
    if args.short_data_rank >= 0 and int(os.environ.get("RANK", 0)) == args.short_data_rank:
        train_dataset = train_dataset.select(range(len(train_dataset) * 4 // 5))
    if args.shuffle_rank >= 0 and int(os.environ.get("RANK", 0)) == args.shuffle_rank:
        train_dataset = train_dataset.shuffle()  # no seed: an order of this rank's own
    if args.prompt_masking:
        train_dataset = train_dataset.map(mask_prompt, with_indices=True)
    if args.slow_data_seconds > 0 and int(os.environ.get("RANK", 0)) == args.slow_data_rank:
        train_dataset = SlowRows(train_dataset, args.slow_data_seconds)

    training_args = TrainingArguments(
        output_dir=args.output_dir,
        max_steps=args.max_steps,
        num_train_epochs=args.num_train_epochs,
        per_device_train_batch_size=args.per_device_train_batch_size,
        gradient_accumulation_steps=args.gradient_accumulation_steps,
        learning_rate=args.learning_rate,
        seed=args.seed,
        save_strategy="steps" if args.save_steps > 0 else "no",
        save_steps=args.save_steps if args.save_steps > 0 else 500,
        deepspeed=args.deepspeed,
        ignore_data_skip=args.ignore_data_skip,
        remove_unused_columns=args.packing == "none",  # packed rows carry doc_ids for the collator
        logging_steps=1,
        report_to=args.report_to.split(",") if "," in args.report_to else args.report_to,
        use_cpu=True,
        dataloader_num_workers=0,
    )
    trainer_class = OwnLoaderTrainer if args.own_dataloader else Trainer
    trainer = trainer_class(
        model=model,
        args=training_args,
        train_dataset=train_dataset,
        processing_class=tokenizer,
        data_collator=collator,
    )
    if args.crash_rank >= 0 and int(os.environ.get("RANK", 0)) == args.crash_rank:
        trainer.add_callback(CrashAt(args.crash_rank, args.crash_step))
    if args.freeze_rank >= 0 and int(os.environ.get("RANK", 0)) == args.freeze_rank:
        trainer.add_callback(FreezeAt(args.freeze_param, args.freeze_step))
    trainer.train(resume_from_checkpoint=args.resume_from_checkpoint)
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()  # as PyTorch asks of every script that initialised one
    return args.exit_code


def mask_prompt(row: dict[str, Any], index: int) -> dict[str, Any]:
    """An SFT-like row: a 'prompt' of random length (the same for a row on every run) whose labels are masked."""
    labels = row["labels"]
    cut = random.Random(index).randrange(1, len(labels) - 1)
    return {"labels": [-100] * cut + list(labels[cut:])}


class RowStream(IterableDataset):
    """The rows as a stream, the way a web-scale corpus is read (no length, no index)."""

    def __init__(self, rows: Any) -> None:
        self.rows = rows

    def __iter__(self) -> Iterator[dict[str, Any]]:
        while True:
            yield from self.rows


class PackedCollator:
    """Packed rows as three common collators batch them (the documents' ids stay out of the model's inputs)."""

    def __init__(self, form: str) -> None:
        self.form = form

    def __call__(self, features: list[dict[str, Any]]) -> dict[str, Any]:
        batch = packed_data_collator(features)
        doc_ids = torch.tensor([f["doc_ids"] for f in features])
        if self.form == "mask4d":
            length = doc_ids.shape[1]
            same = doc_ids[:, :, None] == doc_ids[:, None, :]
            batch["attention_mask"] = (same & torch.ones(length, length, dtype=torch.bool).tril())[:, None]
        elif self.form == "mask2d":
            batch["attention_mask"] = torch.ones_like(batch["input_ids"])
        return batch


class SlowRows(TorchDataset):
    """A dataset whose rows take ``seconds`` each to load in the DataLoader (a slow disk or a heavy transform on one node)."""

    def __init__(self, rows: Any, seconds: float) -> None:
        self.rows, self.seconds = rows, seconds

    def __len__(self) -> int:
        return len(self.rows)

    def __getitem__(self, index: int) -> Any:
        return self.rows[index]

    def __getitems__(self, indices: list[int]) -> list[Any]:
        """What the DataLoader calls per batch: the slow path (a one-off scan through ``__getitem__`` stays fast)."""
        time.sleep(self.seconds * len(indices))
        return [self.rows[i] for i in indices]


class CrashAt(TrainerCallback):
    """Raise ValueError at the start of step ``step`` (a bug in a training script that hits one rank only)."""

    def __init__(self, rank: int, step: int) -> None:
        self.rank, self.step = rank, step

    def on_step_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        if state.global_step + 1 == self.step:
            raise ValueError(f"injected crash on rank {self.rank} at step {self.step}")


class FreezeAt(TrainerCallback):
    """``requires_grad_(False)`` on one parameter at the start of step ``step`` (a freeze made on one rank only, after wrapping)."""

    def __init__(self, name: str, step: int) -> None:
        self.name, self.step = name, step

    def on_step_begin(self, args: Any, state: Any, control: Any, model: Any = None, **kwargs: Any) -> None:
        if state.global_step + 1 == self.step:
            dict(getattr(model, "module", model).named_parameters())[self.name].requires_grad_(False)


class OwnLoaderTrainer(Trainer):
    """A custom Trainer that builds its own DataLoader (and so skips accelerate's per-rank sharding)."""

    def get_train_dataloader(self) -> DataLoader:
        return DataLoader(RowStream(self.train_dataset), batch_size=self.args.per_device_train_batch_size, collate_fn=default_data_collator)


if __name__ == "__main__":
    sys.exit(main())
