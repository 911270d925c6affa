"""Every model family the Trainer trains, as tiny real models, with fixed-length rows for its task (no hub, no padding).

For the tests that walk modules or parameter names (layer groups, attention
probes, the first bad tensor, OOM forensics, the packing experiment,
gradient-sync naming): each family's own names, and a module and a parameter
that only that family has, where a fault is injected and must be named.
"""
from __future__ import annotations

from pathlib import Path
from typing import Any

FAMILY_TASKS = [("llama", "causal_lm"), ("gpt2", "causal_lm"), ("qwen3", "causal_lm"), ("qwen3_moe", "causal_lm"),
                ("gemma3", "causal_lm"), ("bert", "masked_lm"), ("bert", "sequence_classification"), ("t5", "seq2seq")]
IDS = [f"{family}-{task}" for family, task in FAMILY_TASKS]

# the transformer blocks each family's layer groups must find
BLOCKS = {
    "llama": ["model.layers.0", "model.layers.1"],
    "gpt2": ["transformer.h.0", "transformer.h.1"],
    "qwen3": ["model.layers.0", "model.layers.1"],
    "qwen3_moe": ["model.layers.0", "model.layers.1"],
    "gemma3": ["model.layers.0", "model.layers.1"],
    "bert": ["bert.encoder.layer.0", "bert.encoder.layer.1"],
    "t5": ["encoder.block.0", "encoder.block.1", "decoder.block.0", "decoder.block.1"],
}

# (module, parameter) only that family has: a forward overflow is born in the module, a NaN gradient in the parameter
FAULT_SITES = {
    "llama": ("model.layers.1.mlp.up_proj", "model.layers.0.self_attn.k_proj.weight"),
    "gpt2": ("transformer.h.1.mlp.c_fc", "transformer.h.0.attn.c_attn.weight"),  # Conv1D: weights stored [in, out]
    "qwen3": ("model.layers.1.self_attn.q_norm", "model.layers.0.self_attn.k_norm.weight"),
    "qwen3_moe": ("model.layers.1.mlp.experts", "model.layers.0.mlp.experts.gate_up_proj"),  # the experts' fused 3D weights
    "gemma3": ("model.layers.1.pre_feedforward_layernorm", "model.layers.0.post_feedforward_layernorm.weight"),
    "bert": ("bert.encoder.layer.1.attention.self.query", "bert.encoder.layer.0.intermediate.dense.weight"),
    "t5": ("decoder.block.1.layer.1.EncDecAttention.k", "encoder.block.0.layer.0.SelfAttention.relative_attention_bias.weight"),
}

LENGTH = 32
TARGET = 12  # seq2seq: the decoder's target length


def family_rows(tokenizer: Any, task: str, n_rows: int = 48, length: int = LENGTH) -> Any:
    """Rows of ``task`` cut from the shipped corpus, all ``length`` tokens long (no collator padding needed)."""
    from datasets import Dataset

    from harness.lib.tiny import lm_dataset

    base = lm_dataset(tokenizer, seq_len=length, n_rows=n_rows)
    ids = base["input_ids"]
    if task == "causal_lm":
        return base
    if task == "masked_lm":  # every seventh token a target (the inputs keep it: the plumbing matters here, not the task)
        labels = [[t if i % 7 == 3 else -100 for i, t in enumerate(row)] for row in ids]
        return Dataset.from_dict({"input_ids": ids, "attention_mask": base["attention_mask"], "labels": labels})
    if task == "sequence_classification":
        return Dataset.from_dict({"input_ids": ids, "attention_mask": base["attention_mask"], "labels": [i % 2 for i in range(len(ids))]})
    if task == "seq2seq":  # read the row, write its first TARGET tokens
        return Dataset.from_dict({"input_ids": ids, "attention_mask": base["attention_mask"], "labels": [row[:TARGET] for row in ids]})
    raise ValueError(f"no rows for task {task!r}")


def family_trainer(output_dir: Path, tokenizer: Any, family: str, task: str, train_dataset: Any = None,
                   data_collator: Any = None, model: Any = None, **overrides: Any) -> Any:
    """A real ``transformers.Trainer`` on the tiny ``family`` model for ``task``; other keyword arguments go to TrainingArguments."""
    from transformers import Trainer, TrainingArguments

    from harness.lib.tiny_zoo import build_tiny_model

    settings: dict[str, Any] = dict(output_dir=str(output_dir), max_steps=2, per_device_train_batch_size=4, learning_rate=1e-3,
                                    report_to="none", logging_steps=1, use_cpu=True, save_strategy="no", disable_tqdm=True,
                                    dataloader_num_workers=0, seed=0)
    settings.update(overrides)
    return Trainer(model=model if model is not None else build_tiny_model(family, tokenizer, task, seed=0),
                   args=TrainingArguments(**settings),
                   train_dataset=train_dataset if train_dataset is not None else family_rows(tokenizer, task),
                   data_collator=data_collator)
