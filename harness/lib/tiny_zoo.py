"""Tiny models of the families users train, built from configs (no hub), for examples, tests and benchmarks.

The harness must be right on every model the Trainer trains, not only the
Llama of ``harness.lib.tiny``: GPT-2's fused ``c_attn`` Conv1D, Qwen3's
q/k norms, a Qwen3-MoE's experts (saved per expert by transformers 5),
Gemma3's scaled embeddings and sliding layers, BERT's encoder with a
classification or masked-LM head, T5's encoder-decoder. Each builder gives a
model a CPU trains in seconds whose special-token ids agree with the
tokenizer of :func:`harness.lib.tiny.train_tokenizer`.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Any, Literal

if TYPE_CHECKING:
    from transformers import PreTrainedModel, PreTrainedTokenizerBase

Task = Literal["causal_lm", "sequence_classification", "masked_lm", "seq2seq"]

# family -> the tasks it is built for here (the model classes are chosen in build_tiny_model)
FAMILIES: dict[str, tuple[Task, ...]] = {
    "llama": ("causal_lm", "sequence_classification"),
    "gpt2": ("causal_lm", "sequence_classification"),
    "qwen3": ("causal_lm", "sequence_classification"),
    "qwen3_moe": ("causal_lm",),
    "gemma3": ("causal_lm",),
    "bert": ("sequence_classification", "masked_lm"),
    "t5": ("seq2seq",),
}


def _config(family: str, vocab: int, ids: dict[str, Any], hidden: int, layers: int, **overrides: Any) -> Any:
    import transformers as tf

    heads = 4
    common: dict[str, Any] = {"vocab_size": vocab, **ids}
    if family == "gpt2":
        cfg = tf.GPT2Config(n_embd=hidden, n_layer=layers, n_head=heads, n_positions=512, resid_pdrop=0.0, embd_pdrop=0.0,
                            attn_pdrop=0.0, **common)
    elif family == "bert":
        cfg = tf.BertConfig(hidden_size=hidden, num_hidden_layers=layers, num_attention_heads=heads, intermediate_size=4 * hidden,
                            max_position_embeddings=512, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0, **common)
    elif family == "t5":
        cfg = tf.T5Config(d_model=hidden, d_kv=hidden // heads, d_ff=4 * hidden, num_layers=layers, num_decoder_layers=layers,
                          num_heads=heads, dropout_rate=0.0, decoder_start_token_id=ids["pad_token_id"], **common)
    else:
        decoder: dict[str, Any] = dict(hidden_size=hidden, num_hidden_layers=layers, num_attention_heads=heads,
                                       num_key_value_heads=heads // 2, intermediate_size=4 * hidden, max_position_embeddings=512,
                                       **common)
        if family == "llama":
            cfg = tf.LlamaConfig(**decoder)
        elif family == "qwen3":
            cfg = tf.Qwen3Config(head_dim=hidden // heads, **decoder)
        elif family == "qwen3_moe":
            cfg = tf.Qwen3MoeConfig(head_dim=hidden // heads, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=hidden,
                                    decoder_sparse_step=1, **decoder)
        elif family == "gemma3":
            cfg = tf.Gemma3TextConfig(head_dim=hidden // heads, sliding_window=16, **decoder)
        else:
            raise ValueError(f"unknown model family {family!r}; known: {', '.join(FAMILIES)}")
    for key, value in overrides.items():
        setattr(cfg, key, value)
    return cfg


def build_tiny_model(
    family: str,
    tokenizer: PreTrainedTokenizerBase,
    task: Task = "causal_lm",
    num_labels: int = 2,
    seed: int = 0,
    hidden_size: int = 64,
    num_layers: int = 2,
    **config_overrides: Any,
) -> PreTrainedModel:
    """A seeded tiny ``family`` model for ``task`` whose token ids agree with ``tokenizer``."""
    import torch
    import transformers as tf

    if task not in FAMILIES.get(family, ()):
        raise ValueError(f"no tiny {family!r} model for task {task!r}; {family!r} is built for {FAMILIES.get(family)}")
    ids = {"pad_token_id": tokenizer.pad_token_id, "bos_token_id": tokenizer.bos_token_id, "eos_token_id": tokenizer.eos_token_id}
    config = _config(family, len(tokenizer), ids, hidden_size, num_layers, **config_overrides)
    if task == "sequence_classification":
        config.num_labels = num_labels
    torch.manual_seed(seed)
    auto = {
        "causal_lm": tf.AutoModelForCausalLM,
        "sequence_classification": tf.AutoModelForSequenceClassification,
        "masked_lm": tf.AutoModelForMaskedLM,
        "seq2seq": tf.AutoModelForSeq2SeqLM,
    }[task]
    return auto.from_config(config)
