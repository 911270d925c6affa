"""Tiny, fully offline models, tokenizers and datasets.

The machines that run tests, examples and benchmarks have no access to the
Hugging Face Hub, so everything a training run needs (a tokenizer, a small
Llama, a language-modelling dataset, an SFT dataset) is built here from the
corpus shipped in ``harness/data``. Everything is seeded so repeated runs see
identical models and data.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterable
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

if TYPE_CHECKING:  # heavy imports stay lazy so `import harness.lib.tiny` is cheap
    from datasets import Dataset
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

CORPUS_PATH: Path = Path(__file__).resolve().parents[1] / "data" / "corpus.txt"

BOS_TOKEN = "<s>"
EOS_TOKEN = "</s>"
PAD_TOKEN = "<pad>"
UNK_TOKEN = "<unk>"
ROLE_TOKENS = ("<|system|>", "<|user|>", "<|assistant|>")
SPECIAL_TOKENS = [PAD_TOKEN, BOS_TOKEN, EOS_TOKEN, UNK_TOKEN, *ROLE_TOKENS]
MODEL_MAX_LENGTH = 512

# Minimal chat format. The {% generation %} markers let TRL compute
# assistant-only loss masks; the assistant turn ends with eos so generation
# learns to stop, and the generation prompt is a strict prefix of the
# rendered conversation (TRL's prompt/completion handling relies on that).
CHAT_TEMPLATE = (
    "{%- for message in messages -%}"
    "{%- if message['role'] == 'assistant' -%}"
    "{{ '<|assistant|>\n' }}{% generation %}{{ message['content'] + eos_token }}{% endgeneration %}{{ '\n' }}"
    "{%- else -%}"
    "{{ '<|' + message['role'] + '|>\n' + message['content'] + '\n' }}"
    "{%- endif -%}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{ '<|assistant|>\n' }}{%- endif -%}"
)


def corpus_lines(path: Path | str = CORPUS_PATH) -> list[str]:
    """Non-empty, stripped lines of the corpus (one short paragraph per line)."""
    text = Path(path).read_text(encoding="utf-8")
    return [line.strip() for line in text.splitlines() if line.strip()]


def train_tokenizer(texts: Iterable[str], vocab_size: int = 512) -> PreTrainedTokenizerFast:
    """Train a byte-level BPE tokenizer locally (no hub), wrapped for transformers.

    Byte-level means any text is encodable without ``<unk>``; no BOS is added
    automatically (like Qwen), so chat templates and packing never double it.
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE(unk_token=UNK_TOKEN))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer=trainer)
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token=BOS_TOKEN,
        eos_token=EOS_TOKEN,
        pad_token=PAD_TOKEN,
        unk_token=UNK_TOKEN,
        additional_special_tokens=list(ROLE_TOKENS),
        model_max_length=MODEL_MAX_LENGTH,
        chat_template=CHAT_TEMPLATE,
    )


def tiny_llama_config(
    vocab_size: int,
    hidden_size: int = 64,
    num_layers: int = 2,
    num_heads: int = 4,
    intermediate_size: int | None = None,
    max_position_embeddings: int = MODEL_MAX_LENGTH,
    bos_token_id: int = 1,
    eos_token_id: int = 2,
    pad_token_id: int = 0,
    **overrides: Any,
) -> LlamaConfig:
    """A Llama config small enough to train in seconds on CPU.

    Default token ids match ``SPECIAL_TOKENS`` order from ``train_tokenizer``.
    """
    from transformers import LlamaConfig

    kwargs: dict[str, Any] = dict(
        vocab_size=vocab_size,
        hidden_size=hidden_size,
        num_hidden_layers=num_layers,
        num_attention_heads=num_heads,
        num_key_value_heads=num_heads,
        intermediate_size=intermediate_size or 4 * hidden_size,
        max_position_embeddings=max_position_embeddings,
        bos_token_id=bos_token_id,
        eos_token_id=eos_token_id,
        pad_token_id=pad_token_id,
    )
    kwargs.update(overrides)
    return LlamaConfig(**kwargs)


def build_tiny_llama(tokenizer: PreTrainedTokenizerFast, seed: int = 0, **config_kwargs: Any) -> LlamaForCausalLM:
    """Deterministically initialised tiny Llama whose ids agree with ``tokenizer``."""
    import torch
    from transformers import LlamaForCausalLM

    config = tiny_llama_config(
        len(tokenizer),
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        **config_kwargs,
    )
    torch.manual_seed(seed)
    return LlamaForCausalLM(config)


def save_tiny_model_dir(path: Path | str, vocab_size: int = 512, seed: int = 0, **config_kwargs: Any) -> Path:
    """Write a local model directory loadable with ``Auto*.from_pretrained(path)``.

    This stands in for a hub model id in scripts such as ``trl.scripts.sft``.
    """
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    tokenizer = train_tokenizer(corpus_lines(), vocab_size=vocab_size)
    model = build_tiny_llama(tokenizer, seed=seed, **config_kwargs)
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


def lm_dataset(
    tokenizer: PreTrainedTokenizerFast, seq_len: int = 64, n_rows: int | None = None, lines: list[str] | None = None
) -> Dataset:
    """Fixed-length causal-LM rows from the corpus (or ``lines``), no padding needed.

    Lines are tokenized, joined with eos and cut into ``seq_len`` chunks (the
    ragged tail is dropped). If ``n_rows`` exceeds what the corpus yields, the
    rows are repeated in order so benchmarks can ask for any size.
    """
    from datasets import Dataset

    ids: list[int] = []
    for row in tokenizer(corpus_lines() if lines is None else lines, add_special_tokens=False)["input_ids"]:
        ids.extend(row)
        ids.append(tokenizer.eos_token_id)
    chunks = [ids[i : i + seq_len] for i in range(0, len(ids) - seq_len + 1, seq_len)]
    if n_rows is not None:
        chunks = [chunks[i % len(chunks)] for i in range(n_rows)]
    return Dataset.from_dict(
        {
            "input_ids": chunks,
            "attention_mask": [[1] * seq_len for _ in chunks],
            "labels": [list(c) for c in chunks],
        }
    )


def write_tiny_sft_jsonl(
    directory: Path | str,
    n_rows: int = 64,
    fmt: Literal["messages", "prompt_completion"] = "messages",
) -> Path:
    """Write ``directory/train.jsonl``, an SFT dataset derived from the corpus.

    Each row asks the model to continue the first sentence of a corpus line
    with the rest of it. Pass ``directory`` as ``--dataset_name`` to
    ``trl.scripts.sft`` (``load_dataset`` on a local dir infers the json
    builder and a ``train`` split). Returns the jsonl file path.
    """
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    rows: list[dict[str, Any]] = []
    for line in corpus_lines():
        parts = re.split(r"(?<=\.)\s+", line, maxsplit=1)
        if len(parts) < 2:
            continue
        prompt, completion = f"Continue: {parts[0]}", parts[1]
        if fmt == "messages":
            rows.append(
                {"messages": [{"role": "user", "content": prompt}, {"role": "assistant", "content": completion}]}
            )
        else:
            rows.append({"prompt": prompt, "completion": " " + completion})
        if len(rows) == n_rows:
            break
    out = directory / "train.jsonl"
    out.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    return out
