"""The torch RNG state (CPU and, once initialised, CUDA), saved and restored around work off the training step.

A capture recomputes forward passes; with dropout on they draw random numbers,
and training must go on with the stream it would have had without them.
"""
from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch


def rng_state() -> dict[str, Any]:
    """The CPU generator's state, and the current CUDA device's when CUDA is in use."""
    state: dict[str, Any] = {"cpu": torch.get_rng_state()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    """Restore a state from :func:`rng_state` (a CUDA part is ignored where there is no CUDA)."""
    torch.set_rng_state(state["cpu"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])


@contextmanager
def preserved_rng(start: dict[str, Any] | None = None) -> Iterator[None]:
    """Run the block from ``start`` (else the current state); the caller's state is back afterwards, even on error."""
    saved = rng_state()
    try:
        if start is not None:
            set_rng_state(start)
        yield
    finally:
        set_rng_state(saved)
