"""The torch RNG state (CPU and, once initialised, CUDA), saved and restored around work off the training step.

A capture recomputes forward passes; with dropout on they draw random numbers,
and training must go on with the stream it would have had without them.
"""
from __future__ import annotations

from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from typing import Any

import torch


def rng_state(all_devices: bool = False) -> dict[str, Any]:
    """The CPU generator's state, and the current CUDA device's (every device's with ``all_devices``) once CUDA is in use.

    Host copies only: no device sync. Captures keep the current device's
    state (``cuda``: what ``harness replay`` restores); recomputing a step
    in place keeps every device's (``cuda_all``).
    """
    state: dict[str, Any] = {"cpu": torch.get_rng_state()}
    if torch.cuda.is_initialized():  # implies available; is_available() itself costs as much as the state copy (every step)
        if all_devices:
            state["cuda_all"] = torch.cuda.get_rng_state_all()
        else:
            state["cuda"] = torch.cuda.get_rng_state()
    return state


def set_rng_state(state: Mapping[str, Any]) -> None:
    """Restore a state from :func:`rng_state` (a CUDA part is ignored where there is no CUDA)."""
    torch.set_rng_state(state["cpu"])
    if not torch.cuda.is_available():
        return
    if state.get("cuda_all"):
        torch.cuda.set_rng_state_all(list(state["cuda_all"]))
    elif "cuda" in state:
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
