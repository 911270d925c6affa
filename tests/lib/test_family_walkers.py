"""What walks modules and parameter names, on every family's tiny model: layer groups, attention probes, the first bad tensor.

The attention probe is checked against the model's own attention: a
reference attention function registered with transformers' AttentionInterface
receives the very q and k (after any split, norm and scale) each attention
computes its logits from. Positions are all 0, so the rotary embedding is the
identity and the probe's pre-RoPE logits must equal them exactly.
"""
from __future__ import annotations

import math
import sys
from typing import Any, Iterator

import pytest
import torch

from families import BLOCKS, FAMILY_TASKS, FAULT_SITES, IDS
from harness.lib.attention_sites import Layout, attention_sites
from harness.lib.first_bad import locate_forward
from harness.lib.first_bad_grads import scan_gradients
from harness.lib.layer_attention import AttentionProbe, as_tokens, max_logit
from harness.lib.layer_groups import LayerGroups, group_of, is_block

REFERENCE = "harness_reference_attention"


def _model(family: str, task: str, tokenizer: Any) -> Any:
    from harness.lib.tiny_zoo import build_tiny_model

    return build_tiny_model(family, tokenizer, task, seed=0).eval()


def _inputs(family: str, task: str) -> dict[str, torch.Tensor]:
    torch.manual_seed(1)
    ids = torch.randint(5, 200, (2, 12))
    batch: dict[str, torch.Tensor] = {"input_ids": ids}
    if family == "t5":
        batch["decoder_input_ids"] = torch.randint(5, 200, (2, 7))
    else:
        batch["position_ids"] = torch.zeros_like(ids)  # RoPE at position 0 is the identity
    return batch


# -- layer groups --------------------------------------------------------------------------------------


@pytest.mark.parametrize(("family", "task"), FAMILY_TASKS, ids=IDS)
def test_each_familys_blocks_are_its_layer_groups(family: str, task: str, tokenizer: Any) -> None:
    model = _model(family, task, tokenizer)
    groups = LayerGroups.of(model)
    assert [g for g in groups.names if is_block(g)] == BLOCKS[family]
    others = [g for g in groups.names if not is_block(g)]
    assert len(others) <= 8, others  # embeddings, final norms, the head: not one group per linear layer
    module, param = FAULT_SITES[family]
    for name in (module + ".weight", param):
        assert group_of(name) in BLOCKS[family], name


# -- the attention probe against the model's own attention ------------------------------------------------


@pytest.fixture
def reference_attention() -> Iterator[list[tuple[Any, torch.Tensor, torch.Tensor, float]]]:
    """An attention implementation that records (module, q, k, scaling) and then runs the module's own eager attention."""
    from transformers import AttentionInterface

    seen: list[tuple[Any, torch.Tensor, torch.Tensor, float]] = []

    def reference(module: Any, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, attention_mask: Any,
                  scaling: float | None = None, **kwargs: Any) -> Any:
        seen.append((module, query.detach(), key.detach(), scaling if scaling is not None else query.shape[-1] ** -0.5))
        eager = sys.modules[type(module).__module__].eager_attention_forward
        return eager(module, query, key, value, attention_mask, scaling=scaling, **kwargs)

    AttentionInterface.register(REFERENCE, reference)
    try:
        yield seen
    finally:
        AttentionInterface._global_mapping.pop(REFERENCE, None)


def _reference_max(module: Any, q: torch.Tensor, k: torch.Tensor, scaling: float) -> float:
    """Brute force: q [B, H, Tq, d], k [B, KV, Tk, d]; causal pairs where the module is causal."""
    k = k.repeat_interleave(q.shape[1] // k.shape[1], dim=1)
    logits = q.double() @ k.double().transpose(-1, -2) * scaling
    if module.is_causal:
        logits = logits.masked_fill(torch.ones(logits.shape[-2:], dtype=torch.bool).triu(1), -math.inf)
    return float(logits.max())


def _probe_and_reference(model: Any, inputs: dict[str, torch.Tensor], seen: list[Any]) -> tuple[dict[int, float], dict[int, float], Any]:
    model.set_attn_implementation(REFERENCE)
    groups = LayerGroups.of(model)
    found = attention_sites(model, groups.names)
    probe = AttentionProbe(found.sites)
    probe.install()
    with torch.no_grad():
        model(**inputs)
    probe.remove()
    names = {module: name for name, module in model.named_modules()}
    expected: dict[int, float] = {}
    for module, q, k, scaling in seen:
        block = groups.names.index(group_of(names[module]))
        expected[block] = max(expected.get(block, -math.inf), _reference_max(module, q, k, scaling))
    return {b: float(v) for b, v in probe.results.items()}, expected, (found, probe, groups)


@pytest.mark.parametrize("family", list(BLOCKS))
def test_the_probe_measures_the_logits_each_familys_attention_computes(family: str, tokenizer: Any, reference_attention: Any) -> None:
    """GPT-2 through its fused c_attn, Qwen3/Gemma3 after their q/k norms with Gemma3's own scale, BERT and T5's encoder over all
    pairs, T5's decoder self-attention causal and its cross-attention over every encoder position, T5 unscaled."""
    task = next(t for f, t in FAMILY_TASKS if f == family)
    measured, expected, (found, probe, groups) = _probe_and_reference(_model(family, task, tokenizer), _inputs(family, task),
                                                                      reference_attention)
    blocks = [groups.names.index(b) for b in BLOCKS[family]]
    assert found.unmeasured == {} and probe.failures == {}
    assert sorted(measured) == sorted(expected) == blocks
    for block in blocks:
        assert measured[block] == pytest.approx(expected[block], rel=1e-5, abs=1e-6), groups.names[block]
    reads = {s.reads for s in found.sites}
    assert reads == {"gpt2": {"fused"}, "qwen3": {"norms"}, "qwen3_moe": {"norms"}, "gemma3": {"norms"}}.get(family, {"projections"})


def _fused_configs() -> dict[str, Any]:
    import transformers as tf

    small: dict[str, Any] = dict(vocab_size=96, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, bos_token_id=1,
                                 eos_token_id=2, pad_token_id=0)
    return {
        "gpt_neox": tf.GPTNeoXConfig(intermediate_size=64, **small),  # query_key_value, interleaved per head
        "falcon": tf.FalconConfig(new_decoder_architecture=False, multi_query=False, **small),
        "falcon_multi_query": tf.FalconConfig(new_decoder_architecture=False, multi_query=True, **small),  # [q | k | v]
        "falcon_new_architecture": tf.FalconConfig(new_decoder_architecture=True, num_kv_heads=2, **small),  # per kv group
        "phi_qk_layernorm": tf.PhiConfig(qk_layernorm=True, intermediate_size=64, **small),  # norms on [B, H, T, d]
        "phi3": tf.Phi3Config(intermediate_size=64, num_key_value_heads=2, **small),  # qkv_proj with grouped-query heads
        "gpt_bigcode_multi_query": tf.GPTBigCodeConfig(n_embd=32, n_layer=2, n_head=4, vocab_size=96, multi_query=True),
        "gpt_bigcode": tf.GPTBigCodeConfig(n_embd=32, n_layer=2, n_head=4, vocab_size=96, multi_query=False),
    }


@pytest.mark.parametrize("name", list(_fused_configs()))
def test_fused_and_normalised_projections_of_other_families_are_split_per_their_layout(name: str, reference_attention: Any) -> None:
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(_fused_configs()[name]).eval()
    ids = torch.randint(5, 90, (2, 12))
    measured, expected, (found, probe, groups) = _probe_and_reference(model, {"input_ids": ids, "position_ids": torch.zeros_like(ids)},
                                                                      reference_attention)
    assert found.unmeasured == {} and probe.failures == {} and len(found.sites) == 2
    assert sorted(measured) == sorted(expected) and len(measured) == 2
    for block, value in expected.items():
        assert measured[block] == pytest.approx(value, rel=1e-5, abs=1e-6), groups.names[block]


def test_a_fused_layout_splits_q_and_k_and_says_why_when_the_width_does_not_fit() -> None:
    heads, kv, d = 4, 2, 3
    q, k, v = torch.randn(1, 5, heads * d), torch.randn(1, 5, kv * d), torch.randn(1, 5, kv * d)
    got_q, got_k = Layout("contiguous", heads, d).split(torch.cat([q, k, v], dim=-1))
    assert torch.equal(got_q, q) and torch.equal(got_k, k)
    groups = [torch.cat([q[..., g * 2 * d:(g + 1) * 2 * d], k[..., g * d:(g + 1) * d], v[..., g * d:(g + 1) * d]], -1) for g in range(kv)]
    got_q, got_k = Layout("grouped", heads, d, groups=kv).split(torch.cat(groups, dim=-1))
    assert torch.equal(got_q, q) and torch.equal(got_k, k)
    assert "do not hold" in Layout("contiguous", heads, d).split(torch.randn(1, 5, heads * d + 1))
    assert "are not 2 groups" in Layout("grouped", heads, d, groups=kv).split(torch.randn(1, 5, heads * d + 2 * d))


def test_a_4d_q_or_k_is_read_by_its_head_axis_and_an_ambiguous_one_says_so() -> None:
    tokens_first = torch.randn(2, 7, 4, 8)  # [B, T, H, d]: Qwen3's q_norm
    flat, dim = as_tokens(tokens_first, heads=4)
    assert dim == 8 and torch.equal(flat, tokens_first.reshape(2, 7, 32))
    flat, dim = as_tokens(tokens_first.transpose(1, 2), heads=4)  # [B, H, T, d]: Phi's q_layernorm
    assert dim == 8 and torch.equal(flat, tokens_first.reshape(2, 7, 32))
    assert "cannot be told apart" in as_tokens(torch.randn(2, 4, 4, 8), heads=4)
    assert "not known" in as_tokens(tokens_first, heads=None)


def test_what_cannot_be_measured_is_named_with_the_reason(tokenizer: Any) -> None:
    import transformers as tf

    from harness.lib.tiny_zoo import build_tiny_model

    gpt2 = build_tiny_model("gpt2", tokenizer, add_cross_attention=True)  # an encoder-decoder GPT-2: c_attn holds k and v only
    found = attention_sites(gpt2, LayerGroups.of(gpt2).names)
    assert sorted(s.name for s in found.sites) == ["transformer.h.0.attn", "transformer.h.1.attn"]
    assert sorted(found.unmeasured) == ["transformer.h.0.crossattention", "transformer.h.1.crossattention"]
    assert "holds keys and values only" in found.unmeasured["transformer.h.0.crossattention"]

    mamba = tf.MambaForCausalLM(tf.MambaConfig(vocab_size=96, hidden_size=32, num_hidden_layers=2, state_size=4))
    found = attention_sites(mamba, LayerGroups.of(mamba).names)
    assert found.sites == [] and found.unmeasured == {f"backbone.layers.{i}": "no attention module in this block" for i in (0, 1)}


def test_the_logit_maximum_over_all_pairs_of_a_cross_attention_with_its_own_scale() -> None:
    torch.manual_seed(0)
    q, k = torch.randn(2, 3, 4 * 5), torch.randn(2, 6, 2 * 5)  # 3 queries over 6 keys, grouped-query heads
    qh, kh = q.view(2, 3, 4, 5), k.view(2, 6, 2, 5).repeat_interleave(2, dim=2)
    best = max(float(qh[b, i, h] @ kh[b, j, h]) * 0.7 for b in range(2) for h in range(4) for i in range(3) for j in range(6))
    assert float(max_logit(q, k, 5, scale=0.7, causal=False)) == pytest.approx(best, rel=1e-5)


# -- the first bad tensor ------------------------------------------------------------------------------------


def _batch(family: str, task: str) -> dict[str, torch.Tensor]:
    torch.manual_seed(2)
    ids = torch.randint(5, 200, (2, 12))
    labels = {"sequence_classification": torch.tensor([0, 1]), "seq2seq": torch.randint(5, 200, (2, 7))}.get(task, ids.clone())
    return {"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": labels}


@pytest.mark.parametrize(("family", "task"), FAMILY_TASKS, ids=IDS)
def test_the_first_non_finite_module_and_its_weight_are_named_on_each_family(family: str, task: str, tokenizer: Any) -> None:
    model = _model(family, task, tokenizer)
    module, _ = FAULT_SITES[family]
    name, weight = next((f"{module}.{n}", p) for n, p in model.get_submodule(module).named_parameters(recurse=False))
    with torch.no_grad():
        weight.fill_(float("nan"))  # the whole tensor: an MoE expert or a norm weight is used whatever the routing
    found = locate_forward(model, _batch(family, task), rank=0)
    made = found.made_in or found.first  # Qwen3-MoE: its experts apply their 3D weights inline, then call their activation
    assert made is not None and made.name == module, found.describe()
    assert found.evidence()["nonfinite_made_in"] == (module if family == "qwen3_moe" else None)
    assert [p.name for p in found.nonfinite_params] == [name] and found.nonfinite_params[0].rank == 0
    assert f"its {name.rpartition('.')[2]} holds NaN/Inf on rank 0" in found.describe()


@pytest.mark.parametrize(("family", "task"), FAMILY_TASKS, ids=IDS)
def test_a_non_finite_gradient_is_named_by_the_familys_own_parameter_name(family: str, task: str, tokenizer: Any) -> None:
    model = _model(family, task, tokenizer)
    _, target = FAULT_SITES[family]
    dict(model.named_parameters())[target].register_hook(lambda grad: grad * float("inf"))
    model(**_batch(family, task)).loss.backward()
    scan = scan_gradients(model)
    assert scan.names == [target] and scan.first_backward == target, scan.describe()
