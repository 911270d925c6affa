"""rank_rng in one process: options, silence, where a model's dropout is, and the verdict on two ranks' rows.

The two-process runs (the rows really carried by the step exchange) are in
tests/e2e/test_rank_rng_ranks.py; a clean two-process run under the default
plugins (dropout 0, the Trainer's own seeding) is tests/e2e/test_multiprocess.py,
which asserts no finding at all.
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

import harness
from conftest import findings_of
from harness.core.config import Catalog, load_config
from harness.core.errors import HarnessError
from harness.lib.dropout import config_dropouts, describe, dropout_sources
from harness.lib.rng_digest import ABSENT
from harness.lib.rng_ranks import pack, rows_of
from harness.lib.tiny_zoo import FAMILIES, build_tiny_model
from harness.lib.sampler_seed import SamplerSeed, sampler_seed, train_loader


def test_options_are_checked_with_the_plugin_name_and_a_suggestion() -> None:
    with pytest.raises(HarnessError) as error:
        load_config({"rank_rng": {"dropout_onyl": False}}, Catalog.build(autoload=False))
    assert "rank_rng" in str(error.value) and "dropout_onyl" in str(error.value) and "dropout_only" in str(error.value)
    with pytest.raises(HarnessError):
        load_config({"rank_rng": {"check_sampler_seed": "sometimes"}}, Catalog.build(autoload=False))
    assert load_config({"rank_rng": {"dropout_only": False}}, Catalog.build(autoload=False)) is not None


def test_the_plugin_is_on_by_default() -> None:
    assert Catalog.build(autoload=False).entries["rank_rng"].default_enabled


# -- where the dropout is ---------------------------------------------------------------------------------------


def test_dropout_in_a_llama_attention_and_none_without(tokenizer: Any) -> None:
    from harness.lib.tiny import build_tiny_llama

    # Llama applies attention dropout functionally (no module): its attention modules hold the probability they pass as dropout_p
    assert dropout_sources(build_tiny_llama(tokenizer, attention_dropout=0.1)) == [
        "model.layers.*.self_attn.attention_dropout (functional, p=0.1, 2 modules)"]
    assert dropout_sources(build_tiny_llama(tokenizer)) == []
    assert dropout_sources(None) == []


ZOO = [(family, task) for family, tasks in FAMILIES.items() for task in tasks]


@pytest.mark.parametrize(("family", "task"), ZOO, ids=[f"{f}-{t}" for f, t in ZOO])
def test_a_zoo_model_with_its_dropout_at_zero_draws_no_mask(tokenizer: Any, family: str, task: str) -> None:
    """What the model runs decides: config keys no module reads (GPT-2's summary_first_dropout=0.1) are no dropout."""
    model = build_tiny_model(family, tokenizer, task, hidden_size=32)
    assert dropout_sources(model) == []
    if family == "gpt2":  # the key that made every 2-process GPT-2 run warn: only GPT2DoubleHeadsModel's summary head reads it
        assert model.config.summary_first_dropout == 0.1


# the dropout settings of each family's default config: GPT-2, BERT and T5 train with dropout unless told not to
DEFAULT_DROPOUT = {"gpt2": ("GPT2Config", ("resid_pdrop", "embd_pdrop", "attn_pdrop")),
                   "bert": ("BertConfig", ("hidden_dropout_prob", "attention_probs_dropout_prob")),
                   "t5": ("T5Config", ("dropout_rate",))}


@pytest.mark.parametrize(("family", "task"), ZOO, ids=[f"{f}-{t}" for f, t in ZOO])
def test_a_zoo_model_with_its_default_dropout_draws_masks_only_where_the_default_is_above_zero(tokenizer: Any, family: str, task: str) -> None:
    import transformers

    name, keys = DEFAULT_DROPOUT.get(family, ("", ()))
    defaults = {key: getattr(getattr(transformers, name)(), key) for key in keys}  # tiny_zoo sets these to 0: restore the defaults
    model = build_tiny_model(family, tokenizer, task, hidden_size=32, **defaults)
    sources = dropout_sources(model)
    if family in DEFAULT_DROPOUT:
        assert all(v == 0.1 for v in defaults.values()) and sources and all("p=0.1" in s for s in sources), sources
    else:  # Llama, Qwen3, a Qwen3-MoE, Gemma3: attention_dropout=0.0 by default, and no dropout module
        assert model.config.attention_dropout == 0.0 and sources == []
    if family == "gpt2":
        assert "transformer.h.*.mlp.dropout (Dropout p=0.1, 2 modules)" in sources and "transformer.drop (Dropout p=0.1)" in sources
    if family == "t5":  # T5's attention applies config.dropout_rate functionally, its feed-forward through modules
        assert "encoder.block.*.layer.*.SelfAttention.dropout (functional, p=0.1, 2 modules)" in sources
        assert "encoder.block.*.layer.*.DenseReluDense.dropout (Dropout p=0.1, 2 modules)" in sources


@pytest.mark.parametrize("family", ["llama", "qwen3", "qwen3_moe", "gemma3"])
def test_functional_attention_dropout_of_each_decoder_family_counts(tokenizer: Any, family: str) -> None:
    (source,) = dropout_sources(build_tiny_model(family, tokenizer, "causal_lm", hidden_size=32, attention_dropout=0.2))
    assert source == "model.layers.*.self_attn.attention_dropout (functional, p=0.2, 2 modules)"


def test_a_gpt2_summary_head_draws_from_summary_first_dropout() -> None:
    from transformers import GPT2Config, GPT2DoubleHeadsModel

    model = GPT2DoubleHeadsModel(GPT2Config(vocab_size=64, n_positions=16, n_embd=8, n_layer=1, n_head=2, resid_pdrop=0.0, embd_pdrop=0.0,
                                            attn_pdrop=0.0))
    assert dropout_sources(model) == ["multiple_choice_head.first_dropout (Dropout p=0.1)"]
    assert describe([f"m{i}" for i in range(10)]).endswith("and 2 more")


def test_the_modules_copy_decides_and_the_config_counts_only_where_forward_reads_it(tokenizer: Any) -> None:
    import torch
    from harness.lib.tiny import build_tiny_llama

    edited = build_tiny_llama(tokenizer)
    edited.config.attention_dropout = 0.1  # set after building: the attention modules keep 0.0, which is what they pass to sdpa
    assert dropout_sources(edited) == []

    class ReadsItsConfig(torch.nn.Module):  # as Falcon/GPT-Neo-style code that reads self.config.attention_dropout inside forward
        def __init__(self, config: dict[str, Any]) -> None:
            super().__init__()
            self.config = config
            self.proj = torch.nn.Linear(4, 4)

    assert dropout_sources(ReadsItsConfig({"attention_dropout": 0.1})) == ["config.attention_dropout=0.1 (read in forward)"]
    nested = {"text_config": {"hidden_dropout": 0.2, "attention_dropout": 0}, "attention_dropout": True}
    assert dropout_sources(ReadsItsConfig(nested)) == ["config.text_config.hidden_dropout=0.2 (read in forward)"]
    # keys no forward reads from the config: only modules draw from them, and these modules hold none
    assert dropout_sources(ReadsItsConfig({"summary_first_dropout": 0.1, "hidden_dropout_prob": 0.1, "classifier_dropout": 0.1})) == []
    assert config_dropouts({"attention_dropout": 0.1}, held={"attention_dropout"}) == []  # a module holds its own copy


def test_functional_probabilities_of_other_modules_count() -> None:
    import torch

    assert dropout_sources(torch.nn.MultiheadAttention(8, 2, dropout=0.2)) == ["model.dropout (functional, p=0.2)"]
    assert dropout_sources(torch.nn.MultiheadAttention(8, 2)) == []
    blocks = torch.nn.Sequential(*[torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Dropout(0.3)) for _ in range(3)])
    assert dropout_sources(blocks) == ["*.* (Dropout p=0.3, 3 modules)"]


# -- one process: nothing ---------------------------------------------------------------------------------------


def test_one_process_with_dropout_is_silent_and_shares_nothing(make_trainer: Any, tokenizer: Any) -> None:
    from harness.lib.tiny import build_tiny_llama

    trainer = make_trainer(model=build_tiny_llama(tokenizer, attention_dropout=0.1), max_steps=2)
    ctx = harness.attach(trainer, config={"plugins": ["rank_rng"]})
    trainer.train()
    plugin = ctx.manager.plugin("rank_rng")
    assert plugin.record is None and ctx.exchange.keys() == []  # no slot reserved, nothing judged
    assert findings_of(trainer.args.output_dir) == [] and not (ctx.run_dir / "rank_rng.json").exists()


def test_a_per_rank_seed_before_train_moves_the_sampler_seed_unless_data_seed_is_set(make_trainer: Any) -> None:
    """What the playbook's fix rests on: accelerate seeds the sampler from torch.initial_seed() when train() builds the loader."""
    import transformers

    seeds = []
    for data_seed in (None, 0):
        trainer = make_trainer(max_steps=1, seed=0, data_seed=data_seed)
        transformers.set_seed(0 + 1)  # what rank 1 of a `set_seed(seed + rank)` script does between Trainer() and train()
        trainer.train()
        seeds.append(sampler_seed(train_loader(trainer)))
    assert [(s.kind, s.seed) for s in seeds] == [("seedable", 1), ("seedable", 0)]


# -- the verdict on two ranks' rows, on a real run context ------------------------------------------------------------


LLAMA_ATTENTION_DROPOUT = "model.layers.*.self_attn.attention_dropout (functional, p=0.1, 2 modules)"


def _row(torch_digest: int, seed: int) -> list[int]:
    return pack({"torch": torch_digest, "cuda": ABSENT, "python": 3, "numpy": 4}, SamplerSeed("seedable", seed, 0, True))


def test_the_verdict_names_the_ranks_the_streams_the_seeds_and_the_fix(make_trainer: Any, tokenizer: Any) -> None:
    from harness.lib.tiny import build_tiny_llama

    trainer = make_trainer(model=build_tiny_llama(tokenizer, attention_dropout=0.1), max_steps=1)
    ctx = harness.attach(trainer, config={"plugins": ["rank_rng"]})
    trainer.train()
    plugin = ctx.manager.plugin("rank_rng")
    plugin._dropout = dropout_sources(trainer.model)  # rank 0 reads it at run start with several ranks
    plugin._judge(ctx, 1, rows_of([_row(7, 42), _row(7, 1234)]))  # what the exchange carries from two ranks

    (identical,) = findings_of(trainer.args.output_dir, "RNG_IDENTICAL_ACROSS_RANKS")
    assert identical["severity"] == "warning" and identical["step"] == 1 and identical["playbook"] == "rng#rng_identical_across_ranks"
    ev = identical["evidence"]
    assert ev["ranks"] == [0, 1] and ev["identical_streams"] == ["torch", "python", "numpy"] and ev["dropout"] == [LLAMA_ATTENTION_DROPOUT]
    assert "set_seed(args.seed)" in identical["message"] and "args.process_index" in identical["message"]
    assert "data_seed" in identical["message"] and "device_specific=True" in identical["message"]

    (mismatch,) = findings_of(trainer.args.output_dir, "SAMPLER_SEED_MISMATCH")
    assert mismatch["severity"] == "error" and mismatch["evidence"]["seeds"] == {"0": 42, "1": 1234}
    assert mismatch["evidence"]["differing_ranks"] == [1] and "rank 1: 1234" in mismatch["message"]
    record = json.loads((ctx.run_dir / "rank_rng.json").read_text())
    assert record["identical"] == [{"ranks": [0, 1], "streams": ["torch", "python", "numpy"]}] and record["sampler_mismatch"] == [0, 1]


def test_without_dropout_identical_streams_are_recorded_not_reported(make_trainer: Any, tmp_path: Path) -> None:
    trainer = make_trainer(max_steps=1)
    ctx = harness.attach(trainer, config={"plugins": ["rank_rng"]})
    trainer.train()
    plugin = ctx.manager.plugin("rank_rng")
    plugin._judge(ctx, 1, rows_of([_row(7, 42), _row(7, 42)]))  # HF's default seeding, a model without dropout
    assert findings_of(trainer.args.output_dir) == []
    assert json.loads((ctx.run_dir / "rank_rng.json").read_text())["identical"][0]["ranks"] == [0, 1]
    plugin.options = plugin.Options(dropout_only=False)
    plugin._judge(ctx, 1, rows_of([_row(7, 42), _row(7, 42)]))
    assert [f["code"] for f in findings_of(trainer.args.output_dir)] == ["RNG_IDENTICAL_ACROSS_RANKS"]
