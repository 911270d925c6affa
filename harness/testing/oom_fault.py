"""An out-of-memory error raised from inside a real forward pass, for tests of the ``oom`` plugin.

A forward hook on the model's first decoder layer raises
``torch.OutOfMemoryError`` (the type and message CUDA's allocator raises),
so the traceback runs through the Trainer, the model's forward and the
layer, as a real OOM's does, on any device.
"""
from __future__ import annotations

from typing import Any

import torch

OOM_MESSAGE = ("CUDA out of memory. Tried to allocate 2.00 GiB. GPU 0 has a total capacity of 79.15 GiB of which 1.06 GiB is free. "
               "Of the allocated memory 75.10 GiB is allocated by PyTorch, and 1.20 GiB is reserved by PyTorch but unallocated. "
               "(injected by harness.testing)")


def first_decoder_layer(model: Any) -> Any:
    """The first module whose class name ends with DecoderLayer/Block/Layer inside a ModuleList; else the input embeddings."""
    module = getattr(model, "module", model)
    for child in module.modules():
        if isinstance(child, torch.nn.ModuleList) and len(child) and type(child[0]).__name__.endswith(("DecoderLayer", "Block", "Layer")):
            return child[0]
    return module.get_input_embeddings()


class OomRaiser:
    """``arm()``: the next forward of the first decoder layer raises ``torch.OutOfMemoryError``."""

    def __init__(self, model: Any) -> None:
        self.armed = False
        first_decoder_layer(model).register_forward_pre_hook(self._pre_forward)

    def arm(self) -> None:
        self.armed = True

    def _pre_forward(self, module: Any, inputs: Any) -> None:
        if self.armed:
            self.armed = False
            raise torch.OutOfMemoryError(OOM_MESSAGE)
