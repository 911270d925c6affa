"""A transformers model built from its config on the meta device, changing nothing another thread can see.

The checkpoint proof builds models on its own thread while training runs.
``from_pretrained`` would set torch's default dtype and swap
``PreTrainedModel.tie_weights`` and ``torch.linspace`` for every thread for
the length of its load. Here the meta device comes from a torch-function mode
of this thread only (torch keeps that mode stack per thread, as it does for
``with torch.device("meta")``): tensor constructors called without a device
make meta tensors, and ``torch.linspace`` CPU ones, so that a model reading a
drop-path schedule with ``.item()`` in its ``__init__`` still builds (what
``from_pretrained`` patches ``torch.linspace`` for, process-wide). Nothing is
allocated and nothing is drawn from the RNG.
"""
from __future__ import annotations

import copy
from typing import Any

from torch.overrides import TorchFunctionMode

# the constructors torch's own DeviceContext gives a default device (torch.utils._device._device_constructors)
_CONSTRUCTORS = ("empty", "empty_permuted", "empty_strided", "empty_quantized", "ones", "arange", "bartlett_window",
                 "blackman_window", "eye", "full", "hamming_window", "hann_window", "kaiser_window", "logspace", "rand",
                 "randn", "randint", "randperm", "range", "sparse_coo_tensor", "sparse_compressed_tensor", "sparse_csr_tensor",
                 "sparse_csc_tensor", "sparse_bsr_tensor", "sparse_bsc_tensor", "tril_indices", "triu_indices", "zeros",
                 "asarray", "tensor", "as_tensor", "scalar_tensor")


def _constructors() -> frozenset[Any]:
    import torch

    try:
        from torch.utils._device import _device_constructors

        return frozenset(_device_constructors()) - {torch.linspace}
    except (ImportError, AttributeError):  # a torch without it: the list it had in 2.x
        return frozenset(getattr(torch, name) for name in _CONSTRUCTORS if hasattr(torch, name))


class _OnMeta(TorchFunctionMode):
    """Tensor constructors without a device make meta tensors; ``torch.linspace`` makes CPU ones. This thread only."""

    def __init__(self) -> None:
        super().__init__()
        import torch

        self._meta = _constructors()
        self._linspace = torch.linspace

    def __torch_function__(self, func: Any, types: Any, args: tuple[Any, ...] = (), kwargs: dict[str, Any] | None = None) -> Any:
        kwargs = dict(kwargs or {})
        if kwargs.get("device") is None:
            if func in self._meta:
                kwargs["device"] = "meta"
            elif func is self._linspace:
                kwargs["device"] = "cpu"
        return func(*args, **kwargs)


def build_on_meta(model_class: Any, config: Any) -> Any:
    """``model_class`` built from a copy of ``config`` with every parameter and buffer on the meta device."""
    with _OnMeta():
        return model_class(copy.deepcopy(config))
