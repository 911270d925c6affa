"""The largest attention logit of each block on one micro-batch (the QK-clip signal), measured on the device.

Forward hooks on each attention's query and key (see
:mod:`harness.lib.attention_sites`: separate projections, their q/k norms,
or a fused projection split per the model's layout) take their outputs and
compute ``q . k^T`` times the model's own scale per head, over the causal
pairs of a causal attention and over all pairs of a bidirectional one or a
cross-attention, keeping only the maximum: a 0-dim tensor per block (the
largest over its attentions) that stays on the device until the step's one
read. The logits are taken before the rotary embedding (RoPE rotates q and k
without changing their norms, so the bound ``|q| |k| * scale`` is the same;
the exact maximum can differ), without position biases (T5, ALiBi) and
without the padding mask (padded positions count). The work is one extra
``q k^T`` per attention, in chunks of at most ``CHUNK`` logits, on the one
micro-batch the hooks are installed for; the hooks are removed before its
backward (so a gradient-checkpointing recompute does not fire them again).
An attention that gives no value says why in ``failures`` (host strings).
"""
from __future__ import annotations

import math
from typing import Any

import torch

from harness.lib.attention_sites import Site

CHUNK = 1 << 24  # logits per matmul chunk (64 MiB in float32)


def max_logit(q: torch.Tensor, k: torch.Tensor, head_dim: int, scale: float | None = None, causal: bool = True) -> torch.Tensor:
    """max over batch, heads and pairs of ``q_i . k_j * scale`` (default ``1 / sqrt(head_dim)``); q ``[B, Tq, heads*d]``,
    k ``[B, Tk, kv_heads*d]``; causal: pairs j <= i only (Tq == Tk)."""
    batch, length, _ = q.shape
    keys = k.shape[1]
    heads, kv_heads = q.shape[-1] // head_dim, k.shape[-1] // head_dim
    qh = q.detach().float().reshape(batch, length, heads, head_dim).transpose(1, 2)  # [B, H, Tq, d]
    kh = k.detach().float().reshape(batch, keys, kv_heads, head_dim).transpose(1, 2)
    if kv_heads != heads:  # grouped-query attention: each key head serves heads // kv_heads query heads
        kh = kh.repeat_interleave(heads // kv_heads, dim=1)
    scale = 1.0 / math.sqrt(head_dim) if scale is None else scale
    qh, kh = qh.reshape(batch * heads, length, head_dim), kh.reshape(batch * heads, keys, head_dim)
    # at most CHUNK logits at once: whole [Tq, Tk] matrices of several heads when they fit, else blocks of query rows of one
    if length * keys <= CHUNK:
        heads_at_once, rows = max(1, CHUNK // (length * keys)), length
    else:
        heads_at_once, rows = 1, max(1, CHUNK // keys)
    positions = torch.arange(max(length, keys), device=q.device)
    best: torch.Tensor | None = None
    for start in range(0, batch * heads, heads_at_once):
        qs, ks = qh[start : start + heads_at_once], kh[start : start + heads_at_once]
        for first in range(0, length, rows):
            last = min(length, first + rows)
            seen = last if causal else keys  # causal: rows first..last-1 see keys 0..last-1 only
            logits = torch.bmm(qs[:, first:last], ks[:, :seen].transpose(1, 2)) * scale
            if causal:
                logits.masked_fill_(positions[None, :seen] > positions[first:last, None], float("-inf"))
            top = logits.amax()
            best = top if best is None else torch.maximum(best, top)
    assert best is not None
    return best


def as_tokens(tensor: torch.Tensor, heads: int | None) -> tuple[torch.Tensor, int | None] | str:
    """``[B, T, heads*d]`` (and d when the tensor tells it) from a q or k output: 3D as is; 4D ``[B, T, H, d]`` (Qwen3's
    q_norm) or ``[B, H, T, d]`` (Phi's q_layernorm), told apart by the number of heads; else why not."""
    if tensor.dim() == 3:
        return tensor, None
    if tensor.dim() != 4:
        return f"an output of {tensor.dim()} dimensions"
    batch, first, second, dim = tensor.shape
    if heads is None:
        return "a 4D output, and the number of heads is not known"
    if second == heads and first != heads:
        return tensor.reshape(batch, first, second * dim), dim
    if first == heads and second != heads:
        return tensor.transpose(1, 2).reshape(batch, second, first * dim), dim
    return f"a 4D output {list(tensor.shape)} whose token and head axes cannot be told apart ({heads} heads)"


class AttentionProbe:
    """Forward hooks on every site's q and k, for one micro-batch; ``results`` maps block index -> its largest logit."""

    def __init__(self, sites: list[Site]) -> None:
        self.sites = sites
        self.results: dict[int, torch.Tensor] = {}
        self.failures: dict[int, str] = {}  # site index -> why it gave no value this micro-batch
        self.done: set[int] = set()  # site indices that gave a value this micro-batch
        self._seen: dict[int, dict[str, torch.Tensor]] = {}
        self._handles: list[Any] = []

    @property
    def installed(self) -> bool:
        return bool(self._handles)

    def install(self) -> None:
        self.remove()
        self.results, self.failures, self.done, self._seen = {}, {}, set(), {}
        for index, site in enumerate(self.sites):
            if site.key is None:
                self._handles.append(site.query.register_forward_hook(self._hook(index, "qkv")))
            else:
                self._handles.append(site.query.register_forward_hook(self._hook(index, "q")))
                self._handles.append(site.key.register_forward_hook(self._hook(index, "k")))

    def remove(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles, self._seen = [], {}

    def _hook(self, index: int, kind: str) -> Any:
        def hook(module: Any, inputs: Any, output: Any) -> None:
            if not torch.is_tensor(output):
                self.failures[index] = f"its {kind} module returned a {type(output).__name__}, not a tensor"
                return
            if kind == "qkv":
                layout = self.sites[index].layout
                pair = layout.split(output.detach()) if layout is not None else "no layout"
                if isinstance(pair, str):
                    self.failures[index] = pair
                    return
                self._measure(index, *pair)
                return
            seen = self._seen.setdefault(index, {})
            seen[kind] = output.detach()
            if "q" in seen and "k" in seen:
                self._measure(index, seen.pop("q"), seen.pop("k"))

        return hook

    def _measure(self, index: int, q: torch.Tensor, k: torch.Tensor) -> None:
        site = self.sites[index]
        query, key = as_tokens(q, site.heads), as_tokens(k, site.kv_heads or site.heads)
        why = query if isinstance(query, str) else key if isinstance(key, str) else None
        if why is not None:
            self.failures[index] = why
            return
        (q3, q_dim), (k3, _) = query, key  # type: ignore[misc]
        dim = q_dim or site.head_dim
        if dim is None or q3.shape[-1] % dim or k3.shape[-1] % dim or (q3.shape[-1] // dim) % max(1, k3.shape[-1] // dim):
            self.failures[index] = f"q of {q3.shape[-1]} and k of {k3.shape[-1]} features do not split into heads of {dim}"
            return
        if q3.shape[0] != k3.shape[0] or (site.causal and q3.shape[1] != k3.shape[1]):
            self.failures[index] = f"q {list(q3.shape)} and k {list(k3.shape)} do not pair up"
            return
        with torch.no_grad():
            value = max_logit(q3, k3, dim, site.scale, site.causal)
        held = self.results.get(site.block)
        self.results[site.block] = value if held is None else torch.maximum(held, value)
        self.failures.pop(index, None)
        self.done.add(index)
