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


def test_dropout_in_a_llama_config_and_none_without(tokenizer: Any) -> None:
    from harness.lib.tiny import build_tiny_llama

    assert dropout_sources(build_tiny_llama(tokenizer, attention_dropout=0.1)) == ["config.attention_dropout=0.1"]  # functional: no module
    assert dropout_sources(build_tiny_llama(tokenizer)) == []
    assert dropout_sources(None) == []


def test_dropout_modules_and_pdrop_settings_of_a_gpt2() -> None:
    from transformers import GPT2Config, GPT2LMHeadModel

    model = GPT2LMHeadModel(GPT2Config(vocab_size=64, n_positions=16, n_embd=8, n_layer=1, n_head=2, resid_pdrop=0.1, embd_pdrop=0.0))
    sources = dropout_sources(model)
    assert "config.resid_pdrop=0.1" in sources and "config.attn_pdrop=0.1" in sources and "config.embd_pdrop=0" not in sources
    assert "transformer.h.0.mlp.dropout (Dropout p=0.1)" in sources and not any(s.startswith("transformer.drop ") for s in sources)
    assert describe([f"m{i}" for i in range(10)]).endswith("and 2 more")


def test_nested_configs_are_read() -> None:
    assert config_dropouts({"text_config": {"hidden_dropout_prob": 0.2, "dropout": 0}, "dropout": True}) == [
        "config.text_config.hidden_dropout_prob=0.2"]


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
    assert ev["ranks"] == [0, 1] and ev["identical_streams"] == ["torch", "python", "numpy"] and ev["dropout"] == ["config.attention_dropout=0.1"]
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
