"""The largest attention logit of each block on one micro-batch (the QK-clip signal), measured on the device.

Forward hooks on a block's query and key projections take their outputs and
compute ``q . k^T / sqrt(head_dim)`` per head over the causal pairs, keeping
only the maximum: a 0-dim tensor per block that stays on the device until the
step's one read. The logits are taken before the rotary embedding (RoPE
rotates q and k without changing their norms, so the bound
``|q| |k| / sqrt(d)`` is the same; the exact maximum can differ) and without
the padding mask (padded positions count). The work is one extra
``q k^T`` per block, in chunks of at most ``CHUNK`` logits, on the one
micro-batch the hooks are installed for; the hooks are removed before its
backward (so a gradient-checkpointing recompute does not fire them again).
"""
from __future__ import annotations

import math
from typing import Any

import torch

CHUNK = 1 << 24  # logits per matmul chunk (64 MiB in float32)


def head_dim_of(attention: Any, width: int) -> int | None:
    """The head size of ``attention`` (its ``head_dim``, or its config's), None when it cannot be told."""
    value = getattr(attention, "head_dim", None)
    config = getattr(attention, "config", None)
    if value is None and config is not None:
        value = getattr(config, "head_dim", None)
        if value is None and getattr(config, "num_attention_heads", None):
            value = config.hidden_size // config.num_attention_heads
    if not isinstance(value, int) or value <= 0 or width % value:
        return None
    return value


def max_causal_logit(q: torch.Tensor, k: torch.Tensor, head_dim: int) -> torch.Tensor:
    """max over batch, heads and causal pairs (j <= i) of ``q_i . k_j / sqrt(head_dim)``; q, k are ``[B, T, heads*d]``."""
    batch, length, _ = q.shape
    heads, kv_heads = q.shape[-1] // head_dim, k.shape[-1] // head_dim
    qh = q.detach().float().view(batch, length, heads, head_dim).transpose(1, 2)  # [B, H, T, d]
    kh = k.detach().float().view(batch, length, kv_heads, head_dim).transpose(1, 2)
    if kv_heads != heads:  # grouped-query attention: each key head serves heads // kv_heads query heads
        kh = kh.repeat_interleave(heads // kv_heads, dim=1)
    scale = 1.0 / math.sqrt(head_dim)
    qh, kh = qh.reshape(batch * heads, length, head_dim), kh.reshape(batch * heads, length, head_dim)
    # at most CHUNK logits at once: whole [T, T] matrices of several heads when they fit, else blocks of query rows of one
    if length * length <= CHUNK:
        heads_at_once, rows = max(1, CHUNK // (length * length)), length
    else:
        heads_at_once, rows = 1, max(1, CHUNK // length)
    positions = torch.arange(length, device=q.device)
    best: torch.Tensor | None = None
    for start in range(0, batch * heads, heads_at_once):
        qs, ks = qh[start : start + heads_at_once], kh[start : start + heads_at_once]
        for first in range(0, length, rows):
            last = min(length, first + rows)  # causal: rows first..last-1 see keys 0..last-1 only
            logits = torch.bmm(qs[:, first:last], ks[:, :last].transpose(1, 2)) * scale
            logits.masked_fill_(positions[None, :last] > positions[first:last, None], float("-inf"))
            top = logits.amax()
            best = top if best is None else torch.maximum(best, top)
    assert best is not None
    return best


class AttentionProbe:
    """Forward hooks on the q/k projections of every block, for one micro-batch; ``results`` maps block index -> tensor."""

    def __init__(self, projections: dict[int, tuple[Any, Any, Any]]) -> None:
        self.projections = projections
        self.results: dict[int, torch.Tensor] = {}
        self._seen: dict[int, dict[str, torch.Tensor]] = {}
        self._handles: list[Any] = []

    @property
    def installed(self) -> bool:
        return bool(self._handles)

    def install(self) -> None:
        self.remove()
        self.results, self._seen = {}, {}
        for index, (attention, query, key) in self.projections.items():
            self._handles.append(query.register_forward_hook(self._hook(index, "q", attention)))
            self._handles.append(key.register_forward_hook(self._hook(index, "k", attention)))

    def remove(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles, self._seen = [], {}

    def _hook(self, index: int, kind: str, attention: Any) -> Any:
        def hook(module: Any, inputs: Any, output: Any) -> None:
            if not torch.is_tensor(output) or output.dim() != 3:
                return
            seen = self._seen.setdefault(index, {})
            seen[kind] = output.detach()
            if "q" in seen and "k" in seen:
                q, k = seen.pop("q"), seen.pop("k")
                size = head_dim_of(attention, q.shape[-1])
                if size is not None and k.shape[-1] % size == 0 and q.shape[:2] == k.shape[:2]:
                    with torch.no_grad():
                        self.results[index] = max_causal_logit(q, k, size)

        return hook
