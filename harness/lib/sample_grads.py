"""Per-sample gradient norms of captured rows: which sample drove the update, not only which one had a high loss.

A row's gradient norm is ``||d loss_row / d theta||`` over the trainable
parameters, with ``loss_row`` the mean causal-LM loss over its labelled tokens
(the number :func:`harness.lib.capture.per_sample_loss` writes). Two ways:

- ``vmap``: ``torch.func.vmap(grad(...))`` over the rows through
  ``functional_call``: one batched forward and backward, holding rows x
  trainable-parameter bytes of gradients at once, so only when that estimate
  is under a cap (:data:`VMAP_MAX_BYTES`). Any error from vmap (data-dependent
  control flow, e.g. HF's mask building on padded rows; an op without a
  batching rule; dropout, which vmap refuses here) falls back to the loop.
- ``loop``: one forward and one ``torch.autograd.grad`` per row.

Cost: one forward and one backward per captured row, only when a capture is
taken (never on an ordinary step). No side effects: gradients come from
``torch.autograd.grad`` / ``torch.func.grad``, never ``.backward()``, so the
step's ``p.grad`` (still waiting for the update) is not touched; the RNG and
every module's train/eval flag are restored. Run it on the unwrapped model
(``trainer.model``): DDP then runs no allreduce.
"""
from __future__ import annotations

import logging
import time
import warnings
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import torch

from harness.lib.rng_state import preserved_rng, rng_state, set_rng_state

log = logging.getLogger("harness.lib.sample_grads")

IGNORE_INDEX = -100
VMAP_MAX_BYTES = 1 << 30  # per-sample gradients vmap may hold at once (rows x trainable parameter bytes)
COST = "one forward and one backward per captured row, only when a capture is taken"

LmBatch = tuple[dict[str, "torch.Tensor"], "torch.Tensor"]  # (model inputs, labels); strings: no torch at import time


@dataclass
class Blame:
    """Per-sample gradient norms of each micro-batch (None where it is not a causal-LM batch), and how they were got."""

    method: str  # "vmap", "loop" or "unavailable"
    norms: list[torch.Tensor | None] = field(default_factory=list)
    why: str | None = None
    seconds: float = 0.0
    vmap_error: str | None = None

    def record(self) -> dict[str, Any]:
        """The ``blame`` block of a capture's JSON."""
        return {"method": self.method, "why": self.why, "seconds": round(self.seconds, 4), "vmap_error": self.vmap_error, "cost": COST}


def row_loss(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Mean next-token cross-entropy over the labelled tokens of one row (logits: [seq, vocab], labels: [seq])."""
    logits = logits[:-1].float()
    shift = labels[1:].to(logits.device)
    mask = shift != IGNORE_INDEX
    token_loss = torch.nn.functional.cross_entropy(logits, shift.clamp_min(0), reduction="none")
    return (token_loss * mask).sum() / mask.sum()


def row_inputs(inputs: dict[str, torch.Tensor], rows: int, r: int) -> dict[str, torch.Tensor]:
    """Row ``r`` of every input with one entry per row, kept as a batch of one; other inputs as they are."""
    return {k: v[r : r + 1] if v.dim() > 0 and v.shape[0] == rows else v for k, v in inputs.items()}


def trainable(model: torch.nn.Module) -> dict[str, torch.nn.Parameter]:
    return {n: p for n, p in model.named_parameters() if p.requires_grad}


def vmap_bytes(model: torch.nn.Module, rows: int) -> int:
    """What vmap's per-sample gradients hold at once: rows x the trainable parameters' bytes."""
    return rows * sum(p.numel() * p.element_size() for p in trainable(model).values())


def _norm(grads: list[torch.Tensor]) -> torch.Tensor:
    """The global L2 norm of one sample's gradients (float32; NaN/Inf propagate)."""
    home = grads[0].device  # a model spread over devices (device_map): the per-tensor norms meet on one device
    return torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g.float()).to(home) for g in grads]))


def grad_norms_loop(model: torch.nn.Module, inputs: dict[str, torch.Tensor], labels: torch.Tensor) -> torch.Tensor:
    """One forward and one ``autograd.grad`` per row: the memory of a single row's backward, p.grad left alone."""
    params = list(trainable(model).values())
    rows = labels.shape[0]
    norms = []
    with torch.enable_grad():
        for r in range(rows):
            loss = row_loss(model(**row_inputs(inputs, rows, r)).logits[0], labels[r])
            grads = torch.autograd.grad(loss, params, allow_unused=True)
            norms.append(_norm([g for g in grads if g is not None]).detach())
            del loss, grads
    return torch.stack(norms)


def grad_norms_vmap(model: torch.nn.Module, inputs: dict[str, torch.Tensor], labels: torch.Tensor) -> torch.Tensor:
    """``vmap(grad)`` over the rows through ``functional_call``; raises where vmap cannot trace the model."""
    from torch.func import functional_call, grad, vmap

    rows = labels.shape[0]
    params = {n: p.detach() for n, p in trainable(model).items()}
    batched = {k: v for k, v in inputs.items() if v.dim() > 0 and v.shape[0] == rows}
    shared = {k: v for k, v in inputs.items() if k not in batched}
    mask = batched.get("attention_mask")
    if mask is not None and bool(mask.all()):
        del batched["attention_mask"]  # all ones means no mask; HF's mask checks are data-dependent control flow

    def loss_of(p: dict[str, torch.Tensor], row: dict[str, torch.Tensor], lab: torch.Tensor) -> torch.Tensor:
        out = functional_call(model, p, args=(), kwargs={**shared, **{k: v.unsqueeze(0) for k, v in row.items()}})
        return row_loss(out.logits[0], lab)

    with torch.enable_grad(), warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*batching rule.*")  # the fallback works, only slower
        grads = vmap(grad(loss_of), in_dims=(None, 0, 0), randomness="error")(params, batched, labels)
    squares = sum(g.detach().float().flatten(1).pow(2).sum(dim=1) for g in grads.values())
    return torch.as_tensor(squares).sqrt()


@contextmanager
def preserved_modes(model: torch.nn.Module) -> Iterator[None]:
    """Every module's train/eval flag as it was before the block (a model may keep parts in eval on purpose)."""
    modes = [(m, m.training) for m in model.modules()]
    try:
        yield
    finally:
        for m, training in modes:
            m.training = training


def blame_rows(
    model: torch.nn.Module,
    batches: list[LmBatch | None],
    rng: dict[str, Any] | None = None,
    method: str = "auto",
    max_bytes: int = VMAP_MAX_BYTES,
) -> Blame:
    """Per-sample gradient norms of each micro-batch, starting from ``rng``; never raises (a failure is ``unavailable``).

    ``method`` is "auto" (vmap under ``max_bytes``, else or on error the loop),
    "vmap" or "loop" (for tests and comparisons).
    """
    start = time.perf_counter()
    if not trainable(model):
        return Blame("unavailable", [None] * len(batches), why="the model has no trainable parameters")
    rows = max((b[1].shape[0] for b in batches if b is not None), default=0)
    use_vmap = method == "vmap" or (method == "auto" and vmap_bytes(model, rows) <= max_bytes)
    why = None if use_vmap else f"vmap would hold {vmap_bytes(model, rows) / 2**20:.0f} MiB of per-sample gradients (cap {max_bytes / 2**20:.0f} MiB)"
    blame = Blame("vmap" if use_vmap else "loop", why=why if method == "auto" else None)
    begin = rng if rng is not None else rng_state()
    try:
        with preserved_modes(model), preserved_rng(begin):
            if use_vmap:
                try:
                    blame.norms = [grad_norms_vmap(model, *b) if b is not None else None for b in batches]
                except Exception as exc:  # noqa: BLE001 - any op vmap cannot batch: the loop computes the same numbers
                    if method == "vmap":
                        raise
                    blame.method, blame.vmap_error = "loop", f"{type(exc).__name__}: {str(exc)[:300]}"
                    log.info("harness capture: vmap per-sample gradients failed (%s); one backward per row instead", blame.vmap_error)
            if blame.method == "loop":
                set_rng_state(begin)  # the loop draws dropout like the per-sample loss pass did
                blame.norms = [grad_norms_loop(model, *b) if b is not None else None for b in batches]
    except Exception as exc:  # noqa: BLE001 - OOM, reentrant checkpointing (no autograd.grad): the capture goes on without
        if isinstance(exc, torch.OutOfMemoryError) and torch.cuda.is_available():
            torch.cuda.empty_cache()
        blame = Blame("unavailable", [None] * len(batches), why=f"{type(exc).__name__}: {str(exc)[:300]}", vmap_error=blame.vmap_error)
        log.warning("harness capture: per-sample gradient norms unavailable: %s", blame.why)
    blame.seconds = time.perf_counter() - start
    if blame.method != "unavailable":
        log.info("harness capture: per-sample gradient norms by %s in %.2f s", blame.method, blame.seconds)
    return blame
