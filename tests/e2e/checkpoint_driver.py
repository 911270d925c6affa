"""A plain HF Trainer script with ``save_total_limit`` (which examples/train_trainer.py does not take), for torchrun."""
from __future__ import annotations

import argparse

import torch
from transformers import Trainer, TrainingArguments, default_data_collator

from harness.lib.tiny import build_tiny_llama, corpus_lines, lm_dataset, train_tokenizer


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--output_dir", required=True)
    p.add_argument("--max_steps", type=int, default=10)
    p.add_argument("--save_steps", type=int, default=5)
    p.add_argument("--save_total_limit", type=int, default=None)
    args = p.parse_args()
    tokenizer = train_tokenizer(corpus_lines(), vocab_size=256)
    training_args = TrainingArguments(
        output_dir=args.output_dir, max_steps=args.max_steps, per_device_train_batch_size=4, learning_rate=1e-3, seed=0,
        save_strategy="steps", save_steps=args.save_steps, save_total_limit=args.save_total_limit, logging_steps=1,
        report_to="none", use_cpu=True, dataloader_num_workers=0, disable_tqdm=True,
    )
    trainer = Trainer(model=build_tiny_llama(tokenizer, seed=0), args=training_args, train_dataset=lm_dataset(tokenizer, seq_len=32, n_rows=96),
                      data_collator=default_data_collator)
    trainer.train()
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
