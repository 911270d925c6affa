"""A causal-LM fine-tuning script in the shape of transformers' ``examples/pytorch/language-modeling/run_clm.py``.

Like the original it knows nothing about any monitoring wrapper: every
``TrainingArguments`` flag comes from the command line (``--do_eval``,
``--report_to mlflow``, ``--resume_from_checkpoint``, ``--ignore_data_skip``,
``--learning_rate`` ...), text files are read with ``datasets``' ``text``
builder, tokenised line by line and grouped into ``--block_size`` blocks, the
model is trained, saved and evaluated, and the script exits 0 whatever the
training did (as run_clm does). Two things differ because these machines are
offline: without ``--model_name_or_path`` the tokenizer is trained on the
training file and a tiny Llama is built from a config; and
``--loss_per_micro_batch`` swaps in a Trainer subclass whose ``compute_loss``
averages each micro-batch on its own, the gradient-accumulation trap many
custom trainers fall into. ``examples/clm_data.py`` writes matching files.
"""

from __future__ import annotations

import logging
import math
import os
import sys
from dataclasses import dataclass, field
from itertools import chain
from typing import Any

from datasets import load_dataset
from transformers import (
    AutoModelForCausalLM,
    AutoTokenizer,
    HfArgumentParser,
    Trainer,
    TrainingArguments,
    default_data_collator,
    set_seed,
)
from transformers.trainer_utils import get_last_checkpoint

logger = logging.getLogger(__name__)


@dataclass
class ModelArguments:
    model_name_or_path: str | None = field(default=None, metadata={"help": "a local model directory; default: a tiny Llama from a config"})
    config_overrides: str | None = field(default=None, metadata={"help": "tiny model settings, e.g. hidden_size=64,num_layers=2"})
    loss_per_micro_batch: bool = field(default=False, metadata={"help": "compute_loss averages each micro-batch alone (the GA trap)"})


@dataclass
class DataTrainingArguments:
    train_file: str | None = field(default=None, metadata={"help": "a .txt file, one line per example"})
    validation_file: str | None = field(default=None, metadata={"help": "a .txt file, one line per example"})
    block_size: int = field(default=64, metadata={"help": "tokens per training block"})
    max_train_samples: int | None = field(default=None)
    max_eval_samples: int | None = field(default=None)
    keep_linebreaks: bool = field(default=True, metadata={"help": "keep line breaks in the text files"})


class MeanPerMicroBatchTrainer(Trainer):
    """A subclass whose ``compute_loss`` ignores ``num_items_in_batch`` and returns each micro-batch's own mean."""

    def compute_loss(self, model: Any, inputs: dict[str, Any], return_outputs: bool = False, num_items_in_batch: Any = None) -> Any:
        outputs = model(**inputs)
        loss = outputs.loss
        return (loss, outputs) if return_outputs else loss


def tokenizer_and_model(model_args: ModelArguments, train_file: str | None, seed: int) -> tuple[Any, Any]:
    """A local pretrained model, or (offline stand-in for a hub config) a tokenizer trained on the text and a tiny Llama."""
    if model_args.model_name_or_path:
        tokenizer = AutoTokenizer.from_pretrained(model_args.model_name_or_path)
        return tokenizer, AutoModelForCausalLM.from_pretrained(model_args.model_name_or_path)
    from harness.lib.tiny import build_tiny_llama, corpus_lines, train_tokenizer

    lines = corpus_lines(train_file) if train_file else corpus_lines()
    tokenizer = train_tokenizer(lines)
    overrides: dict[str, Any] = {}
    for item in filter(None, (model_args.config_overrides or "").split(",")):
        key, _, value = item.partition("=")
        overrides[key.strip()] = int(value) if value.strip().isdigit() else value.strip()
    return tokenizer, build_tiny_llama(tokenizer, seed=seed, **overrides)


def main(argv: list[str] | None = None) -> int:
    parser = HfArgumentParser((ModelArguments, DataTrainingArguments, TrainingArguments))
    model_args, data_args, training_args = parser.parse_args_into_dataclasses(args=argv)
    logging.basicConfig(format="%(asctime)s - %(levelname)s - %(name)s - %(message)s", level=logging.INFO, handlers=[logging.StreamHandler(sys.stdout)])

    last_checkpoint = None
    if os.path.isdir(training_args.output_dir) and training_args.do_train and not getattr(training_args, "overwrite_output_dir", False):
        last_checkpoint = get_last_checkpoint(training_args.output_dir)
        if last_checkpoint is not None and training_args.resume_from_checkpoint is None:
            logger.info("Checkpoint detected, resuming training at %s.", last_checkpoint)
    set_seed(training_args.seed)

    data_files = {}
    if data_args.train_file:
        data_files["train"] = data_args.train_file
    if data_args.validation_file:
        data_files["validation"] = data_args.validation_file
    raw = load_dataset("text", data_files=data_files, keep_linebreaks=data_args.keep_linebreaks)
    tokenizer, model = tokenizer_and_model(model_args, data_args.train_file, training_args.seed)

    def tokenize(examples: dict[str, list[str]]) -> Any:
        return tokenizer(examples["text"])

    def group_texts(examples: dict[str, list[Any]]) -> dict[str, list[Any]]:
        concatenated = {k: list(chain(*examples[k])) for k in examples}
        total = (len(concatenated["input_ids"]) // data_args.block_size) * data_args.block_size
        result = {k: [t[i : i + data_args.block_size] for i in range(0, total, data_args.block_size)] for k, t in concatenated.items()}
        result["labels"] = result["input_ids"].copy()
        return result

    with training_args.main_process_first(desc="grouping texts together"):
        tokenized = raw.map(tokenize, batched=True, remove_columns=["text"])
        lm_datasets = tokenized.map(group_texts, batched=True)

    train_dataset = eval_dataset = None
    if training_args.do_train:
        train_dataset = lm_datasets["train"]
        if data_args.max_train_samples is not None:
            train_dataset = train_dataset.select(range(min(len(train_dataset), data_args.max_train_samples)))
    if training_args.do_eval:
        eval_dataset = lm_datasets["validation"]
        if data_args.max_eval_samples is not None:
            eval_dataset = eval_dataset.select(range(min(len(eval_dataset), data_args.max_eval_samples)))

    trainer_class = MeanPerMicroBatchTrainer if model_args.loss_per_micro_batch else Trainer
    trainer = trainer_class(
        model=model,
        args=training_args,
        train_dataset=train_dataset,
        eval_dataset=eval_dataset,
        processing_class=tokenizer,
        data_collator=default_data_collator,
    )

    if training_args.do_train:
        checkpoint = training_args.resume_from_checkpoint or last_checkpoint
        train_result = trainer.train(resume_from_checkpoint=checkpoint)
        trainer.save_model()
        metrics = train_result.metrics
        metrics["train_samples"] = len(train_dataset)
        trainer.log_metrics("train", metrics)
        trainer.save_metrics("train", metrics)
        trainer.save_state()

    if training_args.do_eval:
        metrics = trainer.evaluate()
        metrics["eval_samples"] = len(eval_dataset)
        try:
            metrics["perplexity"] = math.exp(metrics["eval_loss"])
        except OverflowError:
            metrics["perplexity"] = float("inf")
        trainer.log_metrics("eval", metrics)
        trainer.save_metrics("eval", metrics)
    return 0


if __name__ == "__main__":
    sys.exit(main())
