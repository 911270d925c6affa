"""layer_stats' device-side pieces: grouping by block, the attention-logit maximum, and the update derived from Adam state."""
from __future__ import annotations

import math

import pytest
import torch

from harness.lib.attention_sites import attention_sites
from harness.lib.layer_attention import max_logit
from harness.lib.layer_groups import LayerGroups, group_of
from harness.lib.layer_measure import Snapshot, adam_update_norms, grad_param_norms, is_adam


@pytest.mark.parametrize(
    ("name", "group"),
    [
        ("model.layers.1.self_attn.q_proj.weight", "model.layers.1"),
        ("module.model.layers.12.mlp.up_proj.weight", "model.layers.12"),
        ("transformer.h.0.attn.c_attn.bias", "transformer.h.0"),
        ("_orig_mod.blocks.3.norm.weight", "blocks.3"),
        ("model.embed_tokens.weight", "model.embed_tokens"),
        ("lm_head.weight", "lm_head"),
        ("model.norm.weight", "model.norm"),
        ("model.layers_extra.weight", "model.layers_extra"),  # not a numbered block
        ("bert.encoder.layer.1.attention.self.query.weight", "bert.encoder.layer.1"),  # BERT, RoBERTa
        ("encoder.block.0.layer.1.DenseReluDense.wi.weight", "encoder.block.0"),  # T5: the first numbered part is the block
        ("decoder.block.1.layer.2.layer_norm.weight", "decoder.block.1"),
        ("transformer.blocks.3.attn.Wqkv.weight", "transformer.blocks.3"),  # MPT
    ],
)
def test_a_parameter_belongs_to_its_block_or_else_its_module(name: str, group: str) -> None:
    assert group_of(name) == group


def test_a_tiny_llama_groups_into_embeddings_blocks_norm_and_head_with_attention_probes(tokenizer: object) -> None:
    from harness.lib.tiny import build_tiny_llama

    model = build_tiny_llama(tokenizer, seed=0)
    groups = LayerGroups.of(model)
    assert groups.names == ["model.embed_tokens", "model.layers.0", "model.layers.1", "model.norm", "lm_head"][: len(groups.names)]
    assert groups.names[1:3] == ["model.layers.0", "model.layers.1"]
    assert len(groups.index) == len(groups.params) and set(groups.index) == set(range(len(groups)))
    found = attention_sites(model, groups.names)
    assert sorted(s.block for s in found.sites) == [1, 2] and all(s.query is not s.key for s in found.sites)
    assert found.unmeasured == {}


@pytest.mark.parametrize("chunk", [1 << 24, 20, 3])  # whole matrices of several heads; blocks of rows (a long context); one row
def test_the_causal_logit_maximum_matches_a_brute_force_one_with_grouped_query_heads(chunk: int, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr("harness.lib.layer_attention.CHUNK", chunk)
    torch.manual_seed(0)
    batch, length, heads, kv_heads, dim = 2, 7, 4, 2, 8
    q, k = torch.randn(batch, length, heads * dim), torch.randn(batch, length, kv_heads * dim)
    best = -math.inf
    for b in range(batch):
        for h in range(heads):
            qh, kh = q[b, :, h * dim:(h + 1) * dim], k[b, :, (h // 2) * dim:(h // 2 + 1) * dim]
            for i in range(length):
                for j in range(i + 1):
                    best = max(best, float(qh[i] @ kh[j]) / math.sqrt(dim))
    assert float(max_logit(q, k, dim)) == pytest.approx(best, rel=1e-5)


def _model_and_step(optimizer_class: type, **kwargs: float) -> tuple[torch.nn.Module, torch.optim.Optimizer, list[torch.Tensor]]:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(6, 5), torch.nn.Linear(5, 3))
    optimizer = optimizer_class(model.parameters(), **kwargs)
    for _ in range(3):  # a few steps so that the moments are not trivial
        optimizer.zero_grad()
        model(torch.randn(4, 6)).square().sum().backward()
        before = [p.detach().clone() for p in model.parameters()]
        optimizer.step()
    return model, optimizer, before


@pytest.mark.parametrize(("optimizer_class", "kwargs"), [(torch.optim.AdamW, {"lr": 0.05, "weight_decay": 0.1}),
                                                         (torch.optim.Adam, {"lr": 0.05, "weight_decay": 0.1, "amsgrad": True}),
                                                         (torch.optim.Adam, {"lr": 0.05})])
def test_the_update_derived_from_adam_state_is_the_applied_one(optimizer_class: type, kwargs: dict[str, float]) -> None:
    model, optimizer, before = _model_and_step(optimizer_class, **kwargs)
    params = list(model.parameters())
    index = torch.tensor([0, 0, 1, 1])
    hyper = [(g["lr"], g["weight_decay"]) for g in optimizer.param_groups]
    assert is_adam(optimizer)
    update, old, moment = adam_update_norms(optimizer, hyper, {id(p): i for p, i in zip(params, index.tolist())}, index.device, 2)
    for g, members in enumerate(([0, 1], [2, 3])):
        true_delta = math.sqrt(sum(float((params[i].detach() - before[i]).square().sum()) for i in members))
        true_old = math.sqrt(sum(float(before[i].square().sum()) for i in members))
        assert float(update[g]) == pytest.approx(true_delta, rel=1e-4)
        assert float(old[g]) == pytest.approx(true_old, rel=1e-5)
        assert float(moment[g]) > 0


def test_a_snapshot_gives_the_update_of_any_optimizer_and_norms_group_by_index() -> None:
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 3)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    model(torch.randn(2, 4)).sum().backward()
    params, index = list(model.parameters()), torch.tensor([0, 1])
    grads, norms = grad_param_norms(params, index, 2)
    assert grads is not None and float(grads[1]) == pytest.approx(float(params[1].grad.norm()), rel=1e-6)
    assert float(norms[0]) == pytest.approx(float(params[0].detach().norm()), rel=1e-6)
    snapshot = Snapshot(params)
    before = [p.detach().clone() for p in params]
    optimizer.step()
    update, old = snapshot.update_norms(params, index, 2)
    assert float(update[0]) == pytest.approx(float((params[0].detach() - before[0]).norm()), rel=1e-6)
    assert float(old[1]) == pytest.approx(float(before[1].norm()), rel=1e-6) and not is_adam(optimizer)
