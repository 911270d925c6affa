"""Where each block's attention logits can be read: its queries and keys as the model's attention uses them.

An attention module is recognised by the names of its children, in three forms:

- separate projections (``q_proj``/``k_proj``, ``query``/``key``, ``q``/``k``,
  ``query_proj``/``key_proj``, ``q_lin``/``k_lin``): Llama, Mistral, Qwen,
  Gemma, Phi, OPT, BERT, RoBERTa, DeBERTa, DistilBERT, T5, BART. Where the
  attention normalises q and k before the dot product (``q_norm``/``k_norm``:
  Qwen3, Qwen3-MoE, Gemma3, OLMo2; ``q_layernorm``/``k_layernorm``: Phi with
  ``qk_layernorm``) the norms' outputs are read instead: they are what the
  dot product sees;
- one fused projection, split per the model's layout (:class:`Layout`):
  ``[q | k | v]`` one after the other (GPT-2 and multi-query GPTBigCode
  ``c_attn``, Phi-3 ``qkv_proj``, MPT and the original Phi ``Wqkv``,
  Baichuan ``W_pack``, multi-query Falcon ``query_key_value``) or
  interleaved per key head, ``[q x n, k, v]`` per group (GPT-NeoX, BLOOM and
  Falcon ``query_key_value``, multi-head GPTBigCode ``c_attn``; Falcon's new
  decoder architecture has one group per key-value head);
- anything else is not measured, with the reason (a fused projection of an
  unknown layout, GPT-2's cross-attention ``c_attn`` that holds keys and
  values only, an attention module without a projection known here, a block
  without attention), so that ``layer_stats`` says so once instead of
  writing silent nulls.

Each site also carries the model's own scale (``scaling``: 1 for T5,
``query_pre_attn_scalar ** -0.5`` for Gemma3) and whether it is causal
(``is_causal``: False for BERT's and T5's encoders and for cross-attention).
Discovery walks ``named_modules`` once, at run start.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from harness.lib.layer_groups import clean_name, group_of, is_block

SEPARATE = (("q_proj", "k_proj"), ("query", "key"), ("q", "k"), ("query_proj", "key_proj"), ("q_lin", "k_lin"))
NORMS = (("q_norm", "k_norm"), ("q_layernorm", "k_layernorm"))
CONTIGUOUS = ("c_attn", "qkv_proj", "Wqkv", "W_pack")
GROUPED = ("query_key_value",)
HEADS = ("num_heads", "num_attention_heads", "n_heads", "n_head")
KV_HEADS = ("num_key_value_heads", "num_kv_heads", "kv_heads", "n_kv_heads")
HEAD_DIMS = ("head_dim", "head_size", "attention_head_size", "key_value_proj_dim")
SCALES = ("scaling", "softmax_scale")


def _int(value: Any) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) and value > 0 else None


def _attr(module: Any, names: tuple[str, ...], config_names: tuple[str, ...] = ()) -> int | None:
    """The first positive int among ``module``'s attributes ``names``, else its config's ``config_names``."""
    for name in names:
        value = _int(getattr(module, name, None))
        if value is not None:
            return value
    config = getattr(module, "config", None)
    for name in config_names:
        value = _int(getattr(config, name, None))
        if value is not None:
            return value
    return None


def heads_of(attention: Any) -> int | None:
    return _attr(attention, HEADS, ("num_attention_heads",))


def kv_heads_of(attention: Any) -> int | None:
    return _attr(attention, KV_HEADS, ("num_key_value_heads",))


def head_dim_of(attention: Any) -> int | None:
    """The head size: an attribute of the attention, its config's ``head_dim``/``d_kv``, else hidden size over heads."""
    value = _attr(attention, HEAD_DIMS, ("head_dim", "d_kv"))
    if value is not None:
        return value
    heads, hidden = heads_of(attention), _int(getattr(getattr(attention, "config", None), "hidden_size", None))
    return hidden // heads if heads and hidden and hidden % heads == 0 else None


def scale_of(attention: Any) -> float | None:
    """The factor the model multiplies ``q . k`` by (None: the usual ``1 / sqrt(head_dim)``)."""
    for name in SCALES:
        value = getattr(attention, name, None)
        if isinstance(value, (int, float)) and not isinstance(value, bool) and value > 0:
            return float(value)
    return None


def is_causal(attention: Any) -> bool:
    """The attention's own ``is_causal`` (HF sets it per module); causal when it does not say (decoder LMs)."""
    value = getattr(attention, "is_causal", None)
    return value if isinstance(value, bool) else True


@dataclass(frozen=True)
class Layout:
    """How one fused projection's output holds q, k and v: ``contiguous`` [q | k | v], or ``grouped`` per key head."""

    kind: str
    heads: int  # query heads
    head_dim: int
    groups: int | None = None  # grouped: key-value heads (each group: heads // groups queries, one key, one value)

    def split(self, fused: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor] | str:
        """(q ``[B, T, heads*d]``, k ``[B, T, kv_heads*d]``) from ``[B, T, width]``, or why not."""
        width, d, query = fused.shape[-1], self.head_dim, self.heads * self.head_dim
        if fused.dim() != 3:
            return f"the fused projection's output has {fused.dim()} dimensions, not [batch, tokens, features]"
        if self.kind == "contiguous":
            rest = width - query
            if rest <= 0 or rest % (2 * d):
                return f"{width} fused features do not hold {self.heads} query heads of {d} and equal key and value parts"
            return fused[..., :query], fused[..., query : query + rest // 2]
        groups = self.groups or self.heads
        if width % (groups * d) or width // (groups * d) != self.heads // groups + 2:
            return f"{width} fused features are not {groups} groups of {self.heads // groups} query heads, a key and a value of {d}"
        grouped = fused.unflatten(-1, (groups, width // (groups * d), d))
        return grouped[..., :-2, :].flatten(-3), grouped[..., -2, :].flatten(-2)


def fused_layout(attention: Any, leaf: str) -> Layout | str:
    """The layout of ``attention``'s fused projection ``leaf``, or why it cannot be told."""
    heads, head_dim = heads_of(attention), head_dim_of(attention)
    if heads is None or head_dim is None:
        return f"{type(attention).__name__}.{leaf} is fused, and its number of heads or head size is not known"
    if leaf == "c_attn" and (getattr(attention, "is_cross_attention", False) or hasattr(attention, "q_attn")):
        return f"{type(attention).__name__}.c_attn of a cross-attention holds keys and values only"
    if getattr(attention, "new_decoder_architecture", False):  # Falcon 40B/180B: one group per key-value head
        return Layout("grouped", heads, head_dim, _int(getattr(attention, "num_kv_heads", None)) or heads)
    multi_query = getattr(attention, "multi_query", None)  # Falcon and GPTBigCode say which of their two layouts they use
    if isinstance(multi_query, bool):  # multi-query: all queries, then one key and one value head; else interleaved per head
        return Layout("contiguous" if multi_query else "grouped", heads, head_dim)
    return Layout("contiguous" if leaf in CONTIGUOUS else "grouped", heads, head_dim)  # GPT-NeoX, BLOOM: grouped per head


@dataclass
class Site:
    """One attention of a block: the module(s) whose outputs are its queries and keys, and how to read them."""

    block: int  # index into the layer groups
    name: str  # the attention module's name
    query: Any  # q (separate) or the fused projection
    key: Any | None  # None: ``query`` is a fused projection, split by ``layout``
    head_dim: int | None  # None: from a 4D output's last dimension
    heads: int | None
    kv_heads: int | None
    scale: float | None  # None: 1 / sqrt(head_dim)
    causal: bool
    layout: Layout | None = None
    reads: str = "projections"  # projections | norms | fused

    def describe(self) -> str:
        what = {"norms": "q/k norms", "fused": f"fused projection ({self.layout.kind if self.layout else '?'})"}
        return f"{self.name} ({what.get(self.reads, 'q/k projections')}, {'causal' if self.causal else 'all pairs'})"


@dataclass
class AttentionSites:
    """Every attention found per block, and what was not measured (name -> why)."""

    sites: list[Site] = field(default_factory=list)
    unmeasured: dict[str, str] = field(default_factory=dict)

    @property
    def blocks(self) -> set[int]:
        return {s.block for s in self.sites}


def _looks_like_attention(name: str, module: Any) -> bool:
    leaf = name.rpartition(".")[2].lower()
    return "attention" in type(module).__name__.lower() or leaf in ("attn", "self_attn", "attention", "crossattention")


def _site(block: int, name: str, module: Any, children: dict[str, Any]) -> Site | str | None:
    """The site of ``module`` when it is an attention whose q and k are known here; a reason when it is fused
    but unreadable; None when it holds no projection known here."""
    common: dict[str, Any] = dict(block=block, name=name, head_dim=head_dim_of(module), heads=heads_of(module),
                                  kv_heads=kv_heads_of(module), scale=scale_of(module), causal=is_causal(module))
    for q, k in SEPARATE:
        if q in children and k in children:
            for qn, kn in NORMS:
                if qn in children and kn in children:
                    return Site(query=children[qn], key=children[kn], reads="norms", **common)
            return Site(query=children[q], key=children[k], **common)
    for leaf in (*CONTIGUOUS, *GROUPED):
        if leaf in children:
            layout = fused_layout(module, leaf)
            if isinstance(layout, str):
                return layout
            return Site(query=children[leaf], key=None, layout=layout, reads="fused", **common)
    return None


def attention_sites(model: Any, groups: list[str]) -> AttentionSites:
    """Every attention inside a block of ``groups`` (names from :class:`harness.lib.layer_groups.LayerGroups`)."""
    position = {name: i for i, name in enumerate(groups) if is_block(name)}
    found = AttentionSites()
    attention_like: dict[str, tuple[int, str]] = {}  # name -> (block, class) of modules that look like attention
    blocks_with_attention: set[int] = set()
    for raw, module in model.named_modules():
        name = clean_name(raw)
        block = position.get(group_of(name)) if name else None
        if block is None:
            continue
        site = _site(block, name, module, dict(module.named_children()))
        if isinstance(site, Site):
            found.sites.append(site)
            blocks_with_attention.add(block)
        elif isinstance(site, str):
            found.unmeasured[name] = site
            blocks_with_attention.add(block)
        elif _looks_like_attention(name, module):
            attention_like[name] = (block, type(module).__name__)
    covered = [s.name for s in found.sites] + list(found.unmeasured)
    for name, (block, kind) in attention_like.items():
        blocks_with_attention.add(block)
        if any(name == c or c.startswith(name + ".") or name.startswith(c + ".") for c in covered):
            continue  # a wrapper of a site (BertAttention, T5LayerSelfAttention) or a part of one
        if any(other.startswith(name + ".") for other in attention_like):
            continue  # an outer wrapper: its innermost attention speaks for it
        found.unmeasured[name] = f"{kind} has no query/key projection known here"
    for name, index in position.items():
        if index not in blocks_with_attention:
            found.unmeasured[name] = "no attention module in this block"
    return found
