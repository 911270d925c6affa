"""Names and shapes of a weights file judged in the layout they fit (the model's names, transformers' saved format), the
reference batch cut from any batch a model accepts, and what a checkpoint's weights file holds (checkpoint_target)."""
from __future__ import annotations

from typing import Any

import pytest
import torch

from harness.lib.checkpoint_layout import NameLayout, layout_problems, memory_layout, saved_layout
from harness.lib.checkpoint_loss import accepted_inputs, reference_batch
from harness.lib.checkpoint_target import find_target

MEMORY = memory_layout({"embed.weight": ((8, 4), 1), "head.weight": ((8, 4), 1), "experts.gate_up": ((2, 4, 4), 2)})
SAVED = NameLayout("transformers' saved format", {"embed.weight": ((8, 4), 0), "experts.0.gate.weight": ((2, 4), 1),
                                                   "experts.0.up.weight": ((2, 4), 2), "experts.1.gate.weight": ((2, 4), 3),
                                                   "experts.1.up.weight": ((2, 4), 4)})
ON_DISK = {name: shape for name, (shape, _) in SAVED.tensors.items()}


def test_a_file_in_the_saved_format_fits_it_and_a_tied_name_saved_once_fits_the_names_in_memory() -> None:
    assert layout_problems(ON_DISK, [MEMORY, SAVED], "model.safetensors") == ([], None)
    assert layout_problems({"embed.weight": (8, 4), "experts.gate_up": (2, 4, 4)}, [MEMORY, SAVED], "w") == ([], None)


def test_a_tensor_missing_or_misshapen_in_the_layout_the_file_fits_is_a_problem_naming_it() -> None:
    lost = {k: v for k, v in ON_DISK.items() if k != "experts.1.up.weight"}
    (problem,) = layout_problems(lost, [MEMORY, SAVED], "model.safetensors")[0]
    assert str(problem) == "model.safetensors: lacks 1 tensor(s) of the model (transformers' saved format), e.g. experts.1.up.weight"
    (problem,) = layout_problems({**ON_DISK, "experts.0.gate.weight": (3, 4)}, [MEMORY, SAVED], "model.safetensors")[0]
    assert str(problem) == "model.safetensors: tensor experts.0.gate.weight has shape [3, 4], the model's is [2, 4]"


def test_names_of_another_model_fit_no_layout_and_are_not_comparable() -> None:
    """Not comparable, without a problem: the caller judges (proof_worker: corrupt when both layouts were known)."""
    problems, why = layout_problems({"encoder.w": (8, 4), "embed.weight": (8, 4)}, [MEMORY, SAVED], "model.safetensors")
    assert problems == [] and why is not None
    assert why.startswith("the saved names fit none of the model's layouts (the model's own names, transformers' saved format)")
    assert "e.g. encoder.w" in why


def test_saved_layout_is_what_transformers_writes_for_a_moe(tokenizer: Any) -> None:
    from harness.lib.tiny_zoo import build_tiny_model

    model = build_tiny_model("qwen3_moe", tokenizer, "causal_lm", hidden_size=32)
    rng = torch.get_rng_state()
    layout = saved_layout(type(model), model.config)
    assert torch.equal(rng, torch.get_rng_state())  # built on the meta device: nothing drawn from the training's RNG
    assert layout is not None and "model.layers.0.mlp.experts.3.down_proj.weight" in layout.tensors
    assert "model.layers.0.mlp.experts.down_proj" not in layout.tensors and "model.layers.0.mlp.experts.down_proj" in model.state_dict()


# -- the reference batch --------------------------------------------------------------------------------------------

IDS = torch.arange(4 * 80).reshape(4, 80)


@pytest.mark.parametrize("batch, keys, shapes", [
    ({"input_ids": IDS, "attention_mask": torch.ones_like(IDS), "labels": torch.tensor([0, 2, 1, 0])},
     None, {"input_ids": (2, 64), "attention_mask": (2, 64), "labels": (2,)}),  # a classifier: one label per row
    ({"input_ids": IDS, "labels": IDS[:, :12]}, None, {"input_ids": (2, 64), "labels": (2, 12)}),  # seq2seq: its own length
    ({"anchor_input_ids": IDS, "anchor_attention_mask": torch.ones_like(IDS), "anchor_modality": "message",
      "positive_input_ids": IDS[:, :5]}, frozenset({"input_ids", "attention_mask"}), {"input_ids": (2, 64), "attention_mask": (2, 64)}),
    ({"input_ids_chosen": IDS, "attention_mask_chosen": torch.ones_like(IDS), "input_ids_rejected": IDS[:, :7], "margin": torch.ones(4)},
     frozenset({"input_ids", "attention_mask", "labels"}), {"input_ids": (2, 64), "attention_mask": (2, 64)}),  # TRL's reward pairs
    ({"input_ids": IDS, "attention_mask": torch.ones(4, 1, 80, 80), "labels": IDS}, None,
     {"input_ids": (2, 80), "attention_mask": (2, 1, 80, 80), "labels": (2, 80)}),  # a 4-D mask: rows only
    ({"input_ids": IDS, "labels": IDS, "sample_id": torch.arange(4), "token_type_ids": IDS * 0}, frozenset({"input_ids", "labels"}),
     {"input_ids": (2, 64), "labels": (2, 64)}),  # only what the forward takes
], ids=["classification", "seq2seq", "sentence-transformer-column", "reward-pair", "4d-mask", "forward-arguments"])
def test_a_reference_batch_is_cut_from_any_batch_the_model_accepts(batch: dict[str, Any], keys: Any,
                                                                    shapes: dict[str, tuple[int, ...]]) -> None:
    cut = reference_batch(batch, rows=2, tokens=64, accepted=keys)
    assert cut is not None and {k: tuple(v.shape) for k, v in cut.items()} == shapes
    assert all(v.is_contiguous() and v.device.type == "cpu" for v in cut.values())


@pytest.mark.parametrize("batch", [
    {"input_ids": IDS, "labels": torch.full_like(IDS, -100)},  # nothing labelled
    {"input_ids": IDS, "labels": torch.tensor([0, 1])},  # rows disagree
    {"chosen": ["text"]},  # no tensor
], ids=["all-masked", "rows-disagree", "no-tensor"])
def test_a_batch_without_a_usable_cut_gives_none(batch: dict[str, Any]) -> None:
    assert reference_batch(batch, rows=2, tokens=64) is None


def test_the_forward_arguments_of_a_transformers_model(tokenizer: Any) -> None:
    from harness.lib.tiny_zoo import build_tiny_model

    taken = accepted_inputs(build_tiny_model("bert", tokenizer, "sequence_classification", hidden_size=32))
    assert taken is not None and {"input_ids", "attention_mask", "token_type_ids", "labels"} <= taken


# -- what the weights file holds --------------------------------------------------------------------------------------

def test_the_target_is_the_model_a_wrapper_holds_only_when_it_holds_all_the_weights(tokenizer: Any) -> None:
    from harness.lib.tiny_zoo import build_tiny_model

    bert = build_tiny_model("bert", tokenizer, "masked_lm", hidden_size=32).bert
    wrapper = torch.nn.Sequential(bert, torch.nn.Identity())  # a SentenceTransformer's shape: Transformer -> Pooling
    target, module, why = find_target(wrapper)
    assert why is None and module is bert and target is not None
    assert (target.kind, target.prefix, target.model_class) == ("model", "0", type(bert))
    assert target.config is not bert.config and target.config.hidden_size == 32  # a copy: the checking thread never shares it

    headed = torch.nn.Sequential(bert, torch.nn.Linear(32, 2))  # a head of its own, outside any transformers config
    target, module, why = find_target(headed)
    assert target is None and module is None and why is not None and "has weights outside its BertModel" in why
