"""One plain Hugging Face training script for the model families and tasks users train, written the way users write them.

``--family`` picks the architecture (GPT-2, Llama, Qwen3, a Qwen3-MoE, Gemma3
text, BERT, T5) and ``--task`` the head and the data:

- ``causal_lm``: fixed 64-token blocks of the corpus, ``default_data_collator``;
- ``sequence_classification``: one corpus line per row, labelled by what the
  line says (how many sentences it holds: 1, 2, 3 or more; ``--num_labels 2``:
  one or more than one), ``DataCollatorWithPadding``, accuracy at evaluation;
- ``masked_lm``: one line per row, ``DataCollatorForLanguageModeling`` masking
  15% of the tokens (a ``<mask>`` token is added to the tokenizer);
- ``seq2seq``: ``Seq2SeqTrainer`` with ``DataCollatorForSeq2Seq``: the model
  reads a line and writes its first sentence; evaluation generates
  (``predict_with_generate``) and scores exact matches.

``--stop_after_step N`` ends the job after step N with a checkpoint, as a job
with a time budget does; the requeued job passes ``--resume_from_checkpoint``
(a path, or True for the newest). A Qwen3-MoE's experts are saved converted
(one tensor per expert) and the Trainer's resume loads saved names as they
are, so its requeued job should also pass ``--model_name_or_path`` with the
checkpoint: ``from_pretrained`` converts them back.

Like any user's script it knows nothing about monitoring wrappers. The only
non-standard imports stand in for a hub model on these offline machines: a
tokenizer trained on the shipped corpus and a tiny model built from a config
(``harness.lib.tiny``, ``harness.lib.tiny_zoo``). Evaluation rows are held-out
corpus lines that share no run of 8 words with a training line.
"""

from __future__ import annotations

import argparse
import re
import sys
from typing import Any

import numpy as np
from datasets import Dataset
from transformers import (
    AutoModelForCausalLM,
    AutoModelForMaskedLM,
    AutoModelForSeq2SeqLM,
    AutoModelForSequenceClassification,
    AutoTokenizer,
    DataCollatorForLanguageModeling,
    DataCollatorForSeq2Seq,
    DataCollatorWithPadding,
    Seq2SeqTrainer,
    Seq2SeqTrainingArguments,
    Trainer,
    TrainerCallback,
    TrainingArguments,
    default_data_collator,
)

from harness.lib.tiny import corpus_lines, lm_dataset, train_tokenizer
from harness.lib.tiny_zoo import FAMILIES, build_tiny_model

AUTO_MODELS = {
    "causal_lm": AutoModelForCausalLM,
    "sequence_classification": AutoModelForSequenceClassification,
    "masked_lm": AutoModelForMaskedLM,
    "seq2seq": AutoModelForSeq2SeqLM,
}
TASKS = tuple(AUTO_MODELS)
MAX_LENGTH = 64
EVAL_LINES = 96  # held out from the end of the corpus, then decontaminated (see split_lines)
SHARED_WORDS = 8  # an evaluation line sharing a run of this many words with a training line is dropped


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--family", required=True, choices=sorted(FAMILIES), help="the model architecture")
    p.add_argument("--task", default="causal_lm", choices=TASKS, help="the head and the data (each family trains some of them)")
    p.add_argument(
        "--model_name_or_path", default=None,
        help="a local model directory (a saved model or a checkpoint) to start from; default: a tiny model built from a config",
    )
    p.add_argument("--output_dir", required=True)
    p.add_argument("--max_steps", type=int, default=12)
    p.add_argument("--save_steps", type=int, default=0, help="0 disables checkpointing")
    p.add_argument("--eval_steps", type=int, default=0, help="evaluate every N steps; 0 disables evaluation")
    p.add_argument("--learning_rate", type=float, default=1e-3)
    p.add_argument("--warmup_steps", type=int, default=0)
    p.add_argument("--per_device_train_batch_size", type=int, default=4)
    p.add_argument("--per_device_eval_batch_size", type=int, default=8)
    p.add_argument("--gradient_accumulation_steps", type=int, default=1)
    p.add_argument("--num_labels", type=int, default=3, help="classes of sequence_classification (2 or 3)")
    p.add_argument("--hidden_size", type=int, default=64)
    p.add_argument("--num_layers", type=int, default=2)
    p.add_argument("--vocab_size", type=int, default=512, help="size of the BPE tokenizer trained on the corpus")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--logging_steps", type=int, default=1)
    p.add_argument(
        "--average_tokens_across_devices", default="true", choices=("true", "false"),
        help="the TrainingArguments option of that name (transformers' default: true)",
    )
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


def sentences(line: str) -> list[str]:
    return [s for s in re.split(r"(?<=[.!?])\s+", line.strip()) if s]


def word_runs(line: str, n: int = SHARED_WORDS) -> set[tuple[str, ...]]:
    words = line.split()
    return {tuple(words[i : i + n]) for i in range(len(words) - n + 1)}


def split_lines() -> tuple[list[str], list[str]]:
    """Distinct training lines, and evaluation lines decontaminated against them.

    The corpus is templated, so a held-out line often repeats most of a
    training line: such lines (and exact copies) leave the evaluation set, as
    a careful user's split does.
    """
    lines = corpus_lines()
    train = list(dict.fromkeys(lines[:-EVAL_LINES]))
    seen, trained_runs = set(train), set().union(*map(word_runs, train))
    held = [line for line in dict.fromkeys(lines[-EVAL_LINES:]) if line not in seen and not word_runs(line) & trained_runs]
    return train, held


def classification_data(tokenizer: Any, lines: list[str], num_labels: int) -> Dataset:
    labels = [min(len(sentences(line)), num_labels) - 1 for line in lines]
    encoded = tokenizer(lines, truncation=True, max_length=MAX_LENGTH)
    return Dataset.from_dict({**encoded, "labels": labels})


def masked_lm_data(tokenizer: Any, lines: list[str]) -> Dataset:
    encoded = tokenizer(lines, truncation=True, max_length=MAX_LENGTH, return_special_tokens_mask=True)
    return Dataset.from_dict(dict(encoded))


def seq2seq_data(tokenizer: Any, lines: list[str]) -> Dataset:
    """Read a line, write its first sentence (eos closes both sides, as T5's tokenizer would add)."""
    eos = tokenizer.eos_token_id
    sources = tokenizer([f"first sentence: {line}" for line in lines], truncation=True, max_length=MAX_LENGTH - 1)["input_ids"]
    targets = tokenizer([sentences(line)[0] for line in lines], truncation=True, max_length=23)["input_ids"]
    return Dataset.from_dict({
        "input_ids": [ids + [eos] for ids in sources],
        "attention_mask": [[1] * (len(ids) + 1) for ids in sources],
        "labels": [ids + [eos] for ids in targets],
    })


def accuracy(prediction: Any) -> dict[str, float]:
    logits = prediction.predictions[0] if isinstance(prediction.predictions, tuple) else prediction.predictions
    return {"accuracy": float((np.argmax(logits, axis=-1) == prediction.label_ids).mean())}


def exact_match_of(tokenizer: Any) -> Any:
    def exact_match(prediction: Any) -> dict[str, float]:
        generated = np.where(prediction.predictions < 0, tokenizer.pad_token_id, prediction.predictions)
        labels = np.where(prediction.label_ids < 0, tokenizer.pad_token_id, prediction.label_ids)
        said = tokenizer.batch_decode(generated, skip_special_tokens=True)
        wanted = tokenizer.batch_decode(labels, skip_special_tokens=True)
        return {"exact_match": float(np.mean([a.strip() == b.strip() for a, b in zip(said, wanted)]))}

    return exact_match


def tokenizer_and_model(args: argparse.Namespace) -> tuple[Any, Any]:
    """The model and tokenizer saved in ``--model_name_or_path``, or (offline stand-in for a hub model) tiny ones."""
    if args.model_name_or_path:
        return AutoTokenizer.from_pretrained(args.model_name_or_path), AUTO_MODELS[args.task].from_pretrained(args.model_name_or_path)
    tokenizer = train_tokenizer(corpus_lines(), vocab_size=args.vocab_size)
    if args.task == "masked_lm":
        tokenizer.add_special_tokens({"mask_token": "<mask>"})
    model = build_tiny_model(args.family, tokenizer, args.task, num_labels=args.num_labels, seed=args.seed,
                             hidden_size=args.hidden_size, num_layers=args.num_layers)
    return tokenizer, model


class StopAfter(TrainerCallback):
    """Save and end the job after step ``step`` (the requeued job resumes from that checkpoint with the same arguments)."""

    def __init__(self, step: int) -> None:
        self.step = step

    def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        if state.global_step == self.step:
            control.should_save = control.should_training_stop = True


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.task not in FAMILIES[args.family]:
        sys.exit(f"train_zoo.py: {args.family} is built here for {', '.join(FAMILIES[args.family])}, not {args.task}")
    train_lines, eval_lines = split_lines()
    tokenizer, model = tokenizer_and_model(args)

    compute_metrics: Any = None
    if args.task == "causal_lm":
        train_dataset = lm_dataset(tokenizer, seq_len=MAX_LENGTH, lines=train_lines)
        eval_dataset = lm_dataset(tokenizer, seq_len=MAX_LENGTH, lines=eval_lines)
        collator: Any = default_data_collator
    elif args.task == "sequence_classification":
        train_dataset = classification_data(tokenizer, train_lines, args.num_labels)
        eval_dataset = classification_data(tokenizer, eval_lines, args.num_labels)
        collator, compute_metrics = DataCollatorWithPadding(tokenizer), accuracy
    elif args.task == "masked_lm":
        train_dataset, eval_dataset = masked_lm_data(tokenizer, train_lines), masked_lm_data(tokenizer, eval_lines)
        collator = DataCollatorForLanguageModeling(tokenizer, mlm=True, mlm_probability=0.15, seed=args.seed)
    else:
        train_dataset, eval_dataset = seq2seq_data(tokenizer, train_lines), seq2seq_data(tokenizer, eval_lines)
        collator, compute_metrics = DataCollatorForSeq2Seq(tokenizer, model=model), exact_match_of(tokenizer)
    eval_dataset = eval_dataset.select(range(min(len(eval_dataset), 16)))

    settings: dict[str, Any] = dict(
        output_dir=args.output_dir,
        max_steps=args.max_steps,
        per_device_train_batch_size=args.per_device_train_batch_size,
        per_device_eval_batch_size=args.per_device_eval_batch_size,
        gradient_accumulation_steps=args.gradient_accumulation_steps,
        learning_rate=args.learning_rate,
        warmup_steps=args.warmup_steps,
        seed=args.seed,
        save_strategy="steps" if args.save_steps > 0 else "no",
        save_steps=args.save_steps if args.save_steps > 0 else 500,
        eval_strategy="steps" if args.eval_steps > 0 else "no",
        eval_steps=args.eval_steps if args.eval_steps > 0 else None,
        logging_steps=args.logging_steps,
        report_to=args.report_to.split(","),
        average_tokens_across_devices=args.average_tokens_across_devices == "true",
        use_cpu=True,
        dataloader_num_workers=0,
    )
    if args.task == "seq2seq":
        training_args: TrainingArguments = Seq2SeqTrainingArguments(
            predict_with_generate=True, generation_max_length=24, generation_num_beams=1, **settings)
        trainer_class: type[Trainer] = Seq2SeqTrainer
    else:
        training_args, trainer_class = TrainingArguments(**settings), Trainer
    trainer = trainer_class(
        model=model,
        args=training_args,
        train_dataset=train_dataset,
        eval_dataset=eval_dataset if args.eval_steps > 0 else None,
        processing_class=tokenizer,
        data_collator=collator,
        compute_metrics=compute_metrics,
    )
    if args.stop_after_step > 0:
        trainer.add_callback(StopAfter(args.stop_after_step))
    trainer.train(resume_from_checkpoint=resume_value(args.resume_from_checkpoint))
    return 0


if __name__ == "__main__":
    sys.exit(main())
