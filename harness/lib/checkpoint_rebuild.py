"""A CPU copy of a model rebuilt from its config with a checkpoint's tensors, loaded the way transformers loads them.

``from_pretrained(None, config=..., state_dict=...)`` is transformers' own
loading path without a file read of its own (the tensors were read with
``safetensors`` or ``torch.load(weights_only=True)`` already): it renames and
converts the saved format (a MoE's per-expert tensors fused again, a base
model's prefix), ties what is tied and recomputes non-persistent buffers. The
class comes from the model in memory, never from a name in a received file.

It runs on the proof's own thread while training goes on, so it must leave
the training alone: it draws nothing from the global RNG when every tensor
is there (the caller checks the layout first, so nothing is initialised),
keeps the default dtype (the model is cast to fp32 after), and its loading
bar and load report are dropped for this thread only (the training thread's
bars and logs are untouched).
"""
from __future__ import annotations

import contextlib
import copy
import logging
import threading
from collections.abc import Iterator
from typing import Any

LOADING_LOGGERS = ("transformers.modeling_utils", "transformers.core_model_loading", "transformers.utils.loading_report",
                   "transformers.conversion_mapping")


class _OtherThreads(logging.Filter):
    """Drops the records of one thread."""

    def __init__(self, thread: int) -> None:
        super().__init__()
        self.thread = thread

    def filter(self, record: logging.LogRecord) -> bool:
        return record.thread != self.thread


@contextlib.contextmanager
def quiet_loading() -> Iterator[None]:
    """No loading bar and no load report from this thread while a rebuild runs (other threads print as before)."""
    me = threading.get_ident()
    loggers = [logging.getLogger(name) for name in LOADING_LOGGERS]
    drop = _OtherThreads(me)
    for logger in loggers:
        logger.addFilter(drop)
    hf_logging: Any = None
    previous: Any = None
    try:
        from transformers.utils import logging as hf_logging

        previous = getattr(hf_logging, "_tqdm_hook", None)

        def hook(factory: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
            if threading.get_ident() == me:
                return hf_logging.EmptyTqdm(*args, **kwargs)
            return previous(factory, args, kwargs) if previous is not None else factory(*args, **kwargs)

        hf_logging.set_tqdm_hook(hook)
    except (ImportError, AttributeError):  # a transformers without the hook: its bar shows
        hf_logging = None
    try:
        yield
    finally:
        if hf_logging is not None:
            hf_logging.set_tqdm_hook(previous)
        for logger in loggers:
            logger.removeFilter(drop)


def rebuild(model_class: Any, config: Any, tensors: dict[str, Any], buffers: dict[str, Any]) -> tuple[Any, list[str]]:
    """``(model, [])``: ``model_class`` from ``config`` on the CPU in fp32 with ``tensors`` loaded by transformers, the
    non-persistent ``buffers`` of the model in memory put back (no file holds them); ``(None, missing)`` when the
    tensors leave some of the model's unset (no forward pass is worth running then)."""
    import torch

    floats = {k: v.to(torch.float32) if v.is_floating_point() else v for k, v in tensors.items()}
    with quiet_loading():
        model, info = model_class.from_pretrained(
            None, config=copy.deepcopy(config), state_dict=floats, dtype=torch.get_default_dtype(), output_loading_info=True,
            use_kernels=False,
        )
    missing = sorted(info.get("missing_keys") or [])
    if missing:
        return None, missing
    model.float()
    for name, buffer in buffers.items():
        owner, _, leaf = name.rpartition(".")
        try:
            module = model.get_submodule(owner) if owner else model
        except AttributeError:
            continue
        if leaf in module._buffers:
            module._buffers[leaf] = buffer.to(torch.float32) if buffer.is_floating_point() else buffer
    return model, []
