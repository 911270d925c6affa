"""The plugins that walk modules or parameter names, through a real Trainer on every family's tiny model.

layer_stats finds each family's blocks and measures every block's attention
logits (GPT-2 through its fused c_attn, BERT and T5 included) and says once
what it cannot measure; nan_guard names the family's own module and parameter
where a NaN is born; oom finds an OOM raised inside each family's first block;
packing_check measures packed rows on each family (T5 on its encoder) or says
once why not; grad_sync names the diverging tensor of a GPT-2 and a BERT.
"""
from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import pytest
import torch

import harness
from conftest import EXAMPLE, FAULTS, RankZeroCtx, findings_of, read_jsonl
from families import BLOCKS, FAMILY_TASKS, FAULT_SITES, IDS, family_rows, family_trainer
from harness.lib.layer_history import FILE

BAD = ("warning", "error", "critical")
# the tiny Llama is every other plugin test's model already: its runs here join the slow set
FAMILY_RUNS = [pytest.param(f, t, id=i, marks=pytest.mark.slow) if f == "llama" else pytest.param(f, t, id=i)
               for (f, t), i in zip(FAMILY_TASKS, IDS)]


def _serious(out: Path) -> list[dict[str, Any]]:
    return [f for f in findings_of(out) if f["severity"] in BAD]


# -- layer_stats, nan_guard and oom in one run per family ----------------------------------------------------------


@pytest.mark.parametrize(("family", "task"), FAMILY_RUNS)
def test_layer_stats_nan_guard_and_oom_walk_each_familys_modules(family: str, task: str, tmp_path: Path, tokenizer: Any) -> None:
    """Step 1 and 3 clean: every block's statistics and attention logit (GPT-2 through c_attn, BERT's and T5's encoders over all
    pairs, T5's cross-attention); step 2: the family's own module overflows; step 4: its own parameter's gradient is infinite;
    step 6: an OOM inside its first block."""
    module, param = FAULT_SITES[family]
    faults = {"overflow_module": module, "overflow_at_step": 2, "inf_grad_at_steps": [4], "inf_grad_target": param, "oom_at_step": 6}
    trainer = family_trainer(tmp_path / "out", tokenizer, family, task, max_steps=6)
    harness.attach(trainer, config={"plugins": ["layer_stats", "nan_guard", "oom", FAULTS], "fault_injector": faults,
                                    "layer_stats": {"interval": 1}})
    with pytest.raises(torch.OutOfMemoryError):
        trainer.train()
    out = Path(trainer.args.output_dir)

    rows = read_jsonl(out / "harness" / FILE)
    for step in (1, 3):
        blocks = {r["block"]: r for r in rows if r["step"] == step and r["block"] in BLOCKS[family]}
        assert sorted(blocks) == sorted(BLOCKS[family])
        for name, row in blocks.items():
            assert row["grad_norm"] > 0 and row["param_norm"] > 0, (name, row)
            assert isinstance(row["attn_logit_max"], float) and 0 < abs(row["attn_logit_max"]) < 100, (name, row)
    assert findings_of(out, "ATTENTION_LOGIT_UNMEASURED") == []

    (loss,) = findings_of(out, "NONFINITE_LOSS")
    assert loss["step"] == 2 and loss["evidence"]["reproduced_in_forward"] is True
    assert loss["evidence"]["first_nonfinite_module"] == module and module in loss["message"]
    assert loss["evidence"]["nonfinite_params_of_module"] == []  # an overflow of finite weights names no weight
    (grad,) = findings_of(out, "NONFINITE_GRAD")
    assert grad["step"] == 4 and grad["evidence"]["first_nonfinite_param"] == param
    assert grad["evidence"]["nonfinite_params"] == [param] and param in grad["message"]

    (oom,) = findings_of(out, "OUT_OF_MEMORY")
    evidence = oom["evidence"]
    assert oom["step"] == 6 and evidence["phase"] == "forward" and "_pre_forward" in evidence["failed_at"]
    assert evidence["batch"]["shapes"]["input_ids"] == [4, 32] and evidence["steps_completed"] == 5
    named = [t["name"] for t in evidence["largest_tensors"] if t["name"]]
    prefixes = {n.split(" ")[-1].split(".")[0] for n in named}  # parameter X, gradient of X, optimizer state exp_avg of X
    assert named and prefixes <= {b.split(".")[0] for b in BLOCKS[family]} | {"lm_head", "shared", "cls", "classifier", "score"}, named
    assert [f for f in _serious(out) if f["code"] not in ("NONFINITE_LOSS", "NONFINITE_GRAD", "OUT_OF_MEMORY")] == []


def _mamba(tokenizer: Any) -> Any:
    import transformers as tf

    torch.manual_seed(0)
    return tf.MambaForCausalLM(tf.MambaConfig(vocab_size=len(tokenizer), hidden_size=32, num_hidden_layers=2, state_size=4,
                                              pad_token_id=tokenizer.pad_token_id, bos_token_id=tokenizer.bos_token_id,
                                              eos_token_id=tokenizer.eos_token_id))


def _gpt2_with_cross_attention(tokenizer: Any) -> Any:
    from harness.lib.tiny_zoo import build_tiny_model

    return build_tiny_model("gpt2", tokenizer, add_cross_attention=True)


def _bart_decoder(tokenizer: Any) -> Any:
    """BART's decoder as a causal LM (as in encoder-decoder stacks): its cross-attention has no encoder states to attend to."""
    import transformers as tf

    torch.manual_seed(0)
    return tf.BartForCausalLM(tf.BartConfig(vocab_size=len(tokenizer), d_model=32, decoder_layers=2, encoder_layers=2,
                                            decoder_attention_heads=4, encoder_attention_heads=4, decoder_ffn_dim=64,
                                            encoder_ffn_dim=64, max_position_embeddings=64, pad_token_id=tokenizer.pad_token_id,
                                            bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
                                            decoder_start_token_id=tokenizer.bos_token_id))


@pytest.mark.parametrize(("build", "nulls", "why"), [
    (_mamba, ["backbone.layers.0", "backbone.layers.1"], "backbone.layers.0: no attention module in this block"),
    (_gpt2_with_cross_attention, [],
     "transformer.h.0.crossattention: GPT2Attention.c_attn of a cross-attention holds keys and values only"),
    (_bart_decoder, [], "model.decoder.layers.0.encoder_attn: no value at step 1: its hooks did not fire"),
], ids=["mamba", "gpt2-cross-attention", "bart-decoder"])
def test_what_layer_stats_cannot_measure_is_said_once_and_in_the_report(build: Any, nulls: list[str], why: str, tmp_path: Path,
                                                                         tokenizer: Any) -> None:
    trainer = family_trainer(tmp_path / "out", tokenizer, "llama", "causal_lm", model=build(tokenizer), max_steps=3)
    ctx = harness.attach(trainer, config={"plugins": ["layer_stats"], "layer_stats": {"interval": 1}})
    trainer.train()
    out = Path(trainer.args.output_dir)
    (finding,) = findings_of(out, "ATTENTION_LOGIT_UNMEASURED")
    assert finding["severity"] == "info" and finding["step"] == 1 and why in finding["message"]
    assert finding["evidence"]["blocks"] == nulls and f"{len(nulls)} of 2 blocks have attn_logit_max null" in finding["message"]
    rows = read_jsonl(out / "harness" / FILE)
    blocks = [r for r in rows if r["block"].rpartition(".")[0] in ("backbone.layers", "transformer.h", "model.decoder.layers")]
    assert len(blocks) == 6 and all((r["attn_logit_max"] is None) == (r["block"] in nulls) for r in blocks)
    report = (ctx.run_dir / "report.md").read_text(encoding="utf-8").split("## Layer statistics", 1)[1]
    assert "Not measured: " in report and why in report and "`ATTENTION_LOGIT_UNMEASURED`" in report
    assert _serious(out) == []


# -- packing_check ---------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def packed_rows(tokenizer: Any) -> Any:
    from datasets import Dataset

    from harness.lib.tiny import corpus_lines
    from harness.stages.packing import packed_lm_dataset

    texts = [s.strip() + "." for line in corpus_lines()[:60] for s in line.split(".") if len(s.strip()) > 20]
    return packed_lm_dataset(Dataset.from_dict({"text": texts}), tokenizer, seq_len=64, keep_doc_ids=True)


PACKED = [pytest.param("llama", "causal_lm", "LlamaModel", marks=pytest.mark.slow), ("gpt2", "causal_lm", "GPT2Model"),
          ("qwen3", "causal_lm", "Qwen3Model"), ("qwen3_moe", "causal_lm", "Qwen3MoeModel"), ("gemma3", "causal_lm", "Gemma3TextModel"),
          ("bert", "masked_lm", "BertModel")]


@pytest.mark.parametrize(("family", "task", "reader"), PACKED, ids=["llama", "gpt2", "qwen3", "qwen3_moe", "gemma3", "bert"])
def test_packing_check_measures_packed_rows_on_each_family(family: str, task: str, reader: str, tmp_path: Path, tokenizer: Any,
                                                          packed_rows: Any) -> None:
    """Restarting position_ids: transformers builds the block mask from them (BERT's bidirectional one too), so no leak."""
    sys.path.insert(0, str(EXAMPLE.parent))
    from train_trainer import PackedCollator  # the example script's collator

    trainer = family_trainer(tmp_path / "out", tokenizer, family, task, train_dataset=packed_rows,
                             data_collator=PackedCollator("position_ids"), max_steps=1, remove_unused_columns=False)
    harness.attach(trainer, config={"plugins": ["packing_check"]})
    trainer.train()
    out = Path(trainer.args.output_dir)
    (result,) = read_jsonl(out / "harness" / "packing_check.jsonl")
    assert result["boundaries"] == "position_ids" and result["documents"] >= 2 and result["measured"] == reader
    assert result["perturbed_document_change"] > 0.01 and result["verdict"] == "separate" and result["leak"] < 1e-6, result
    assert findings_of(out, "PACKING_CHECK_SKIPPED") == [] and _serious(out) == []


def _eos_separated(tokenizer: Any) -> Any:
    """T5 rows of two documents joined by EOS (its encoder reads them; the labels are a separate target)."""
    from datasets import Dataset

    rows = family_rows(tokenizer, "seq2seq")
    eos = tokenizer.eos_token_id
    ids = [[t if t != eos else 7 for t in row[:16]] + [eos] + [t if t != eos else 7 for t in row[17:]] for row in rows["input_ids"]]
    return Dataset.from_dict({"input_ids": ids, "attention_mask": rows["attention_mask"], "labels": rows["labels"]})


def test_packing_check_measures_t5_on_its_encoder(tmp_path: Path, tokenizer: Any) -> None:
    """The packed row is the encoder's input: its outputs are compared (before, the decoder stack ran on the encoder's ids).
    T5's encoder attends over the whole row, so the documents leak."""
    trainer = family_trainer(tmp_path / "out", tokenizer, "t5", "seq2seq", train_dataset=_eos_separated(tokenizer), max_steps=1)
    harness.attach(trainer, config={"plugins": ["packing_check"], "packing_check": {"boundaries": "eos"}})
    trainer.train()
    out = Path(trainer.args.output_dir)
    (result,) = read_jsonl(out / "harness" / "packing_check.jsonl")
    assert result["measured"] == "T5Stack (the encoder)" and result["documents"] == 2 and result["verdict"] == "leak", result
    (finding,) = findings_of(out, "PACKING_CROSS_DOC_ATTENTION")
    assert finding["evidence"]["measured"] == "T5Stack (the encoder)" and findings_of(out, "PACKING_CHECK_SKIPPED") == []


class RowClassifier(torch.nn.Module):
    """A user's own model (not a transformers one): one logit vector per row, none per token."""

    def __init__(self, vocab: int) -> None:
        super().__init__()
        self.embed = torch.nn.Embedding(vocab, 16)
        self.head = torch.nn.Linear(16, 2)

    def forward(self, input_ids: torch.Tensor, position_ids: torch.Tensor | None = None, labels: torch.Tensor | None = None) -> Any:
        logits = self.head(self.embed(input_ids).mean(dim=1))
        loss = torch.nn.functional.cross_entropy(logits, labels[:, 1] % 2) if labels is not None else None
        return {"loss": loss, "logits": logits}


def test_packing_check_says_once_why_it_cannot_measure_a_model_without_per_token_outputs(tmp_path: Path, tokenizer: Any,
                                                                                          packed_rows: Any) -> None:
    sys.path.insert(0, str(EXAMPLE.parent))
    from train_trainer import PackedCollator

    torch.manual_seed(0)
    trainer = family_trainer(tmp_path / "out", tokenizer, "llama", "causal_lm", model=RowClassifier(len(tokenizer)),
                             train_dataset=packed_rows, data_collator=PackedCollator("position_ids"), max_steps=3,
                             remove_unused_columns=False)
    harness.attach(trainer, config={"plugins": ["packing_check"], "packing_check": {"every": 1}})
    trainer.train()
    out = Path(trainer.args.output_dir)
    (finding,) = findings_of(out, "PACKING_CHECK_SKIPPED")
    assert finding["severity"] == "info" and finding["step"] == 1
    assert "RowClassifier gives outputs of shape [2] for a row of 64 tokens, not one per token" in finding["message"]
    assert not (out / "harness" / "packing_check.jsonl").exists() and findings_of(out, "INTERNAL_PLUGIN_ERROR") == []


# -- grad_sync -------------------------------------------------------------------------------------------------




@pytest.mark.parametrize(("family", "task", "drifted", "bad_grad"), [
    ("gpt2", "causal_lm", "transformer.h.1.attn.c_attn.weight", "transformer.h.0.mlp.c_proj.bias"),
    ("bert", "sequence_classification", "bert.encoder.layer.1.attention.self.key.weight", "bert.pooler.dense.weight"),
], ids=["gpt2", "bert"])
def test_grad_sync_names_the_diverging_tensor_of_each_family(family: str, task: str, drifted: str, bad_grad: str, tmp_path: Path,
                                                             tokenizer: Any) -> None:
    """Two replicas of the family's model as two ranks would hold them (same seed, same batch): one ulp in one weight of
    "rank 1", then a scaled gradient of one tensor; the fingerprints each rank computes, compared as rank 0 compares them."""
    from harness.lib.replicas import Parallelism
    from harness.lib.tiny_zoo import build_tiny_model
    from harness.testing import perturb_one_ulp
    from plugins.grad_sync import GradSync

    replicas = [build_tiny_model(family, tokenizer, task, seed=0) for _ in range(2)]
    batch = {k: torch.tensor(v[:2]) for k, v in family_rows(tokenizer, task)[:2].items()}
    plugins = []
    for model in replicas:
        plugin = GradSync()
        plugin.mode, plugin._described, plugin._group = "ddp", "DistributedDataParallel", (0, 1)
        plugin._parallelism = Parallelism("ddp", "DistributedDataParallel", (0, 1))
        plugin._params = list(model.named_parameters())  # as on_run_start takes them: the model's own names, tied weights once
        plugin._micro_batches = 1
        plugins.append(plugin)
    ctx = RankZeroCtx(tmp_path)
    plugins[0].ctx = ctx

    assert perturb_one_ulp(replicas[1], drifted) == drifted
    for model in replicas:
        model(**batch).loss.backward()
    plugins[0]._compare(ctx, 5, [p._local_fingerprints(5, None) for p in plugins])
    (params,) = [f for f in ctx.findings if f["code"] == "PARAM_DESYNC"]
    assert params["evidence"]["tensors"][0]["tensor"] == drifted and params["evidence"]["diverging_tensors"] == 1
    assert params["evidence"]["ranks"] == [1] and drifted in params["message"]

    ctx.findings.clear()
    perturb_one_ulp(replicas[0], drifted)  # the weights agree again
    for model in replicas:
        model.zero_grad()
        model(**batch).loss.backward()
    with torch.no_grad():
        dict(replicas[1].named_parameters())[bad_grad].grad.mul_(1.5)
    plugins[0]._compare(ctx, 10, [p._local_fingerprints(10, None) for p in plugins])
    (grads,) = [f for f in ctx.findings if f["code"] == "GRAD_DESYNC"]
    assert [t["tensor"] for t in grads["evidence"]["tensors"]] == [bad_grad] and grads["evidence"]["ranks"] == [1]
    assert [f["code"] for f in ctx.findings] == ["GRAD_DESYNC"]


@pytest.mark.slow  # two processes under torchrun
@pytest.mark.parametrize(("family", "task", "suffix", "drifted"), [
    ("gpt2", "causal_lm", "attn.c_attn.weight", "transformer.h.0.attn.c_attn.weight"),
    ("bert", "sequence_classification", "attention.self.key.weight", "bert.encoder.layer.0.attention.self.key.weight"),
], ids=["gpt2", "bert"])
def test_grad_sync_names_the_drifted_tensor_of_each_family_under_ddp(family: str, task: str, suffix: str, drifted: str,
                                                                      tmp_path: Path) -> None:
    """The project's zoo script, unmodified, on two DDP ranks: one ulp added to a family-specific weight on rank 1."""
    from conftest import EXAMPLES, harness_cli, torchrun, write_yaml

    out = tmp_path / "run"
    config = write_yaml(tmp_path / "h.yaml", {
        "plugins": ["grad_sync", FAULTS], "grad_sync": {"every": 2},
        "fault_injector": {"perturb_param_at_step": 3, "perturb_param": suffix, "fault_rank": 1}})
    script = [str(EXAMPLES / "train_zoo.py"), "--family", family, "--task", task, "--output_dir", str(out), "--max_steps", "4"]
    result = harness_cli("wrap", "--config", str(config), "--", *torchrun(), *script, env={"DS_ACCELERATOR": "cpu"})
    assert result.returncode == 0, result.stderr[-4000:]
    assert (out / "harness" / "perturbed.rank-1.txt").read_text() == drifted
    (finding,) = findings_of(out, "PARAM_DESYNC")
    assert finding["step"] == 4 and finding["evidence"]["ranks"] == [1] and finding["evidence"]["diverging_tensors"] == 1
    assert finding["evidence"]["tensors"][0]["tensor"] == drifted and drifted in finding["message"]
    assert findings_of(out, "GRAD_DESYNC") == []


@pytest.mark.parametrize("family", ["llama", "gpt2", "bert", "t5"])
def test_the_fault_injector_poisons_each_family_s_attention_output(family: str, tokenizer: Any) -> None:
    """nan_param_at_step once looked for `o_proj.weight` only and raised StopIteration on GPT-2, BERT and T5."""
    from harness.lib.tiny_zoo import FAMILIES, build_tiny_model
    from harness.testing.faults import poison_parameter

    model = build_tiny_model(family, tokenizer, FAMILIES[family][0], hidden_size=32)
    name = poison_parameter(model)
    assert {"llama": "o_proj", "gpt2": "attn.c_proj", "bert": "attention.output.dense", "t5": "SelfAttention.o"}[family] in name
    assert torch.isnan(dict(model.named_parameters())[name]).any()
