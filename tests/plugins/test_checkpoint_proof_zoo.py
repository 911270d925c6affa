"""checkpoint_proof on every kind of model the Trainer saves (issue 43 item 3), each a real run that saves twice.

A Qwen3-MoE (saved with its experts split per expert), a BERT classifier (one
label per row), T5 through ``Seq2SeqTrainer`` (labels of their own length), a
BERT masked LM (``DataCollatorForLanguageModeling``), a LoRA adapter on the
tiny Llama (only the adapter is saved) and a SentenceTransformer (a BERT plus
pooling, trained with ``MultipleNegativesRankingLoss``): every checkpoint is
proven, and ``harness resume-point`` names the newest. Before, all but the
masked LM were left unverified and resume-point exited 1. A checkpoint
damaged after its save (an expert's tensor gone, one tensor of a classifier
changed) is still CHECKPOINT_CORRUPT, and resume-point passes over it.
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch

import harness
from cli_in_process import harness_in_process
from conftest import findings_of
from harness.lib.proven import CHECKED, MARKER

ROWS, LENGTH, TARGET = 32, 32, 12
PROVEN_BY_LOSS = ["complete", "weights_finite", "shapes", "reference_loss"]


def _lines() -> list[str]:
    from harness.lib.tiny import corpus_lines

    return corpus_lines()[:ROWS]


def _padded(tokenizer: Any, texts: list[str], length: int) -> Any:
    return tokenizer(texts, truncation=True, max_length=length, padding="max_length")


def classification_rows(tokenizer: Any) -> Any:
    from datasets import Dataset

    encoded = _padded(tokenizer, _lines(), LENGTH)
    return Dataset.from_dict({"input_ids": encoded["input_ids"], "attention_mask": encoded["attention_mask"],
                              "labels": [i % 3 for i in range(ROWS)]})


def seq2seq_rows(tokenizer: Any) -> Any:
    """Read a line, write its first words: labels of another length than the inputs, padding masked."""
    from datasets import Dataset

    source, target = _padded(tokenizer, _lines(), LENGTH), _padded(tokenizer, [line.split(".")[0] for line in _lines()], TARGET)
    labels = [[t if m else -100 for t, m in zip(ids, mask)] for ids, mask in zip(target["input_ids"], target["attention_mask"])]
    return Dataset.from_dict({"input_ids": source["input_ids"], "attention_mask": source["attention_mask"], "labels": labels})


def _run(model: Any, rows: Any, out: Path, collator: Any = None, callbacks: list[Any] | None = None, seq2seq: bool = False,
         trainer_class: Any = None, args_class: Any = None, **extra: Any) -> Path:
    """Four steps of a real Trainer with the default plugins, saving checkpoint-2 and checkpoint-4."""
    from transformers import Seq2SeqTrainer, Seq2SeqTrainingArguments, Trainer, TrainingArguments

    trainer_class = trainer_class or (Seq2SeqTrainer if seq2seq else Trainer)
    args_class = args_class or (Seq2SeqTrainingArguments if seq2seq else TrainingArguments)
    args = args_class(output_dir=str(out), max_steps=4, save_strategy="steps", save_steps=2, per_device_train_batch_size=4,
                      learning_rate=1e-3, report_to="none", logging_steps=1, use_cpu=True, disable_tqdm=True,
                      dataloader_num_workers=0, seed=0)
    trainer = trainer_class(model=model, args=args, train_dataset=rows, data_collator=collator, callbacks=callbacks, **extra)
    harness.attach(trainer, config={"plugins": ["defaults"]})
    trainer.train()
    return out


def _record(out: Path, step: int) -> dict[str, Any]:
    return json.loads((out / f"checkpoint-{step}" / MARKER).read_text(encoding="utf-8"))


def _assert_proven(out: Path, checks: list[str], capsys: Any, monkeypatch: pytest.MonkeyPatch) -> Any:
    """Both checkpoints proven, no CHECKPOINT_* finding, resume-point names checkpoint-4 (exit 0)."""
    said = [f for f in findings_of(out) if f["code"].startswith("CHECKPOINT_")]
    assert said == [], said
    for step in (2, 4):
        record = _record(out, step)
        assert record["checks"] == checks, record
        if record["loss_at_save"] is not None:
            assert record["loss_from_disk"] == pytest.approx(record["loss_at_save"], rel=1e-4)
    point = harness_in_process(capsys, monkeypatch, "resume-point", str(out))
    assert (point.returncode, point.stdout.strip()) == (0, str(out / "checkpoint-4")), point
    return point


def test_a_moe_checkpoint_in_the_saved_format_is_proven_and_the_trainers_own_resume_is_warned_of(
        tokenizer: Any, tmp_path: Path, capsys: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """transformers 5 writes the fused experts per expert; the proof compares through its saved format and loading."""
    from harness.lib.tiny import lm_dataset
    from harness.lib.tiny_zoo import build_tiny_model

    out = _run(build_tiny_model("qwen3_moe", tokenizer, "causal_lm", seed=0, hidden_size=32), lm_dataset(tokenizer, seq_len=LENGTH, n_rows=ROWS),
               tmp_path / "out")
    from safetensors import safe_open

    with safe_open(str(out / "checkpoint-4" / "model.safetensors"), framework="pt") as handle:
        assert "model.layers.0.mlp.experts.3.down_proj.weight" in handle.keys()  # the saved format, not the names in memory
    point = _assert_proven(out, PROVEN_BY_LOSS, capsys, monkeypatch)
    # the file is good, but transformers' Trainer resumes it by raw names and leaves the fused experts as built: said once
    assert "warning: checkpoint-4 is good, but the Trainer's own resume loads checkpoint-4's tensors by their saved names" in point.stderr
    assert "leave 4 of the model's tensors as the resumed script builds them, e.g. model.layers.0.mlp.experts.gate_up_proj" in point.stderr
    assert "from_pretrained(<the checkpoint-4 folder>) before train(resume_from_checkpoint=...)" in point.stderr


def test_a_bert_classifier_checkpoint_is_proven_by_its_classification_loss(
        tokenizer: Any, tmp_path: Path, capsys: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    from harness.lib.tiny_zoo import build_tiny_model

    model = build_tiny_model("bert", tokenizer, "sequence_classification", num_labels=3, seed=0, hidden_size=32)
    out = _run(model, classification_rows(tokenizer), tmp_path / "out")
    point = _assert_proven(out, PROVEN_BY_LOSS, capsys, monkeypatch)
    assert point.stderr == ""
    assert _record(out, 4)["loss_at_save"] == pytest.approx(1.1, abs=0.3)  # three labels: about ln 3, not a token loss


def test_a_t5_checkpoint_of_seq2seq_trainer_is_proven_by_its_target_loss(
        tokenizer: Any, tmp_path: Path, capsys: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    from harness.lib.tiny_zoo import build_tiny_model

    out = _run(build_tiny_model("t5", tokenizer, "seq2seq", seed=0, hidden_size=32), seq2seq_rows(tokenizer), tmp_path / "out",
               seq2seq=True)
    _assert_proven(out, PROVEN_BY_LOSS, capsys, monkeypatch)


def test_a_bert_masked_lm_checkpoint_is_proven_with_the_collators_masked_batches(
        tokenizer: Any, tmp_path: Path, capsys: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """The collator masks anew each batch, token_type_ids included: the batch is cut to what BertForMaskedLM takes."""
    import copy

    from datasets import Dataset
    from transformers import DataCollatorForLanguageModeling

    from harness.lib.tiny_zoo import build_tiny_model

    masking = copy.deepcopy(tokenizer)  # the session's tokenizer stays as it is
    masking.add_special_tokens({"mask_token": "<mask>"})
    rows = Dataset.from_dict(dict(masking(_lines(), truncation=True, max_length=LENGTH)))
    collator = DataCollatorForLanguageModeling(masking, mlm=True, mlm_probability=0.3, seed=0)
    out = _run(build_tiny_model("bert", masking, "masked_lm", seed=0, hidden_size=32), rows, tmp_path / "out", collator=collator)
    _assert_proven(out, PROVEN_BY_LOSS, capsys, monkeypatch)


def test_a_lora_adapter_checkpoint_is_proven_by_its_tensors(tokenizer: Any, tmp_path: Path, capsys: Any,
                                                            monkeypatch: pytest.MonkeyPatch) -> None:
    """PEFT saves the adapter only (adapter_model.safetensors under PEFT's names): each tensor equals the adapter's at the save."""
    from peft import LoraConfig, get_peft_model

    from harness.lib.tiny import build_tiny_llama, lm_dataset

    model = get_peft_model(build_tiny_llama(tokenizer, seed=0), LoraConfig(r=4, target_modules=["q_proj", "v_proj"], task_type="CAUSAL_LM"))
    out = _run(model, lm_dataset(tokenizer, seq_len=LENGTH, n_rows=ROWS), tmp_path / "out")
    assert (out / "checkpoint-4" / "adapter_model.safetensors").is_file() and not (out / "checkpoint-4" / "model.safetensors").exists()
    _assert_proven(out, ["complete", "weights_finite", "shapes", "adapter_weights"], capsys, monkeypatch)


def test_a_sentence_transformer_checkpoint_is_proven_through_its_bert(tokenizer: Any, tmp_path: Path, capsys: Any,
                                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    """SentenceTransformerTrainer saves the BERT inside at the checkpoint's top, the pooling beside it; the batches hold
    one set of inputs per text column and no labels: the BERT's output on one column's inputs is the reference."""
    from datasets import Dataset
    from sentence_transformers import SentenceTransformer, SentenceTransformerTrainer, SentenceTransformerTrainingArguments, losses
    from sentence_transformers import models as st_models
    from transformers import BertConfig, BertModel

    base = tmp_path / "tiny-bert"  # a tiny BERT from a config, saved where the Transformer module reads it (no download)
    torch.manual_seed(0)
    BertModel(BertConfig(vocab_size=len(tokenizer), hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=64,
                         max_position_embeddings=64, pad_token_id=tokenizer.pad_token_id)).save_pretrained(base)
    tokenizer.save_pretrained(base)
    encoder = st_models.Transformer(str(base), max_seq_length=LENGTH)
    model = SentenceTransformer(modules=[encoder, st_models.Pooling(encoder.get_word_embedding_dimension(), "mean")], device="cpu")
    pairs = Dataset.from_dict({"anchor": [line.split(".")[0] for line in _lines()], "positive": _lines()})
    out = _run(model, pairs, tmp_path / "out", trainer_class=SentenceTransformerTrainer, args_class=SentenceTransformerTrainingArguments,
               loss=losses.MultipleNegativesRankingLoss(model))
    assert (out / "checkpoint-4" / "modules.json").is_file()
    _assert_proven(out, ["complete", "weights_finite", "shapes", "reference_output"], capsys, monkeypatch)


# -- the proof keeps its power on these families ------------------------------------------------------------------------

def damage_after_save(damage: Any) -> Any:
    """A callback that rewrites checkpoint-4's weights right after the Trainer wrote them, through ``damage(tensors) ->
    tensors``: before the harness's save hook, since the callbacks a script passes run first."""
    from safetensors.torch import load_file, save_file
    from transformers import TrainerCallback

    class DamageAfterSave(TrainerCallback):
        def on_save(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
            if state.global_step == 4:
                path = Path(args.output_dir) / "checkpoint-4" / "model.safetensors"
                save_file(damage(load_file(str(path))), str(path), metadata={"format": "pt"})

    return DamageAfterSave()


def _assert_refused(out: Path, what: str, capsys: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    (corrupt,) = findings_of(out, "CHECKPOINT_CORRUPT")
    assert corrupt["step"] == 4 and corrupt["severity"] == "error" and corrupt["evidence"]["files"] == ["model.safetensors"]
    assert what in corrupt["message"], corrupt["message"]
    assert corrupt["evidence"]["last_proven"] == str(out / "checkpoint-2")
    assert not (out / "checkpoint-4" / MARKER).exists() and not (out / "checkpoint-4" / CHECKED).exists()
    assert _record(out, 2)["checks"] == PROVEN_BY_LOSS
    point = harness_in_process(capsys, monkeypatch, "resume-point", str(out))
    assert (point.returncode, point.stdout.strip()) == (0, str(out / "checkpoint-2")), point


def test_a_moe_checkpoint_that_lost_an_experts_tensor_is_corrupt(tokenizer: Any, tmp_path: Path, capsys: Any,
                                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    from harness.lib.tiny import lm_dataset
    from harness.lib.tiny_zoo import build_tiny_model

    gone = "model.layers.1.mlp.experts.2.up_proj.weight"
    out = _run(build_tiny_model("qwen3_moe", tokenizer, "causal_lm", seed=0, hidden_size=32), lm_dataset(tokenizer, seq_len=LENGTH, n_rows=ROWS),
               tmp_path / "out", callbacks=[damage_after_save(lambda tensors: {k: v for k, v in tensors.items() if k != gone})])
    _assert_refused(out, f"model.safetensors: lacks 1 tensor(s) of the model (transformers' saved format), e.g. {gone}", capsys, monkeypatch)


def test_a_moe_checkpoint_holding_another_familys_weights_is_corrupt(tokenizer: Any, tmp_path: Path, capsys: Any,
                                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    """model.safetensors replaced by a BERT's (the folder otherwise the MoE's): names that fit neither the MoE's own nor its
    saved format, both known, are another model's weights, not a format the proof cannot handle (before: harness_checked,
    which resume-point named when nothing newer was proven)."""
    from safetensors.torch import load_file

    from harness.lib.tiny import lm_dataset
    from harness.lib.tiny_zoo import build_tiny_model

    build_tiny_model("bert", tokenizer, "masked_lm", seed=0, hidden_size=32).save_pretrained(tmp_path / "bert")
    bert = load_file(str(tmp_path / "bert" / "model.safetensors"))
    out = _run(build_tiny_model("qwen3_moe", tokenizer, "causal_lm", seed=0, hidden_size=32), lm_dataset(tokenizer, seq_len=LENGTH, n_rows=ROWS),
               tmp_path / "out", callbacks=[damage_after_save(lambda tensors: bert)])
    _assert_refused(out, "model.safetensors: the saved names fit none of the model's layouts (the model's own names, transformers' "
                         "saved format)", capsys, monkeypatch)
    assert "another model's weights, not those of Qwen3MoeForCausalLM" in findings_of(out, "CHECKPOINT_CORRUPT")[0]["message"]


def test_a_bert_classifier_checkpoint_with_a_changed_tensor_is_corrupt(tokenizer: Any, tmp_path: Path, capsys: Any,
                                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    """Every tensor readable, finite and of the right shape; one holds other values: the classification loss tells."""
    from harness.lib.tiny_zoo import build_tiny_model

    def other_values(tensors: dict[str, Any]) -> dict[str, Any]:
        name = "bert.encoder.layer.1.intermediate.dense.weight"
        return {**tensors, name: torch.flip(tensors[name], dims=[0]).contiguous()}

    model = build_tiny_model("bert", tokenizer, "sequence_classification", num_labels=3, seed=0, hidden_size=32)
    out = _run(model, classification_rows(tokenizer), tmp_path / "out", callbacks=[damage_after_save(other_values)])
    _assert_refused(out, "not the weights that were training", capsys, monkeypatch)
