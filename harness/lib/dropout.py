"""Where a model draws dropout masks: config values and ``nn.Dropout`` modules with a probability above zero.

Llama-style models apply attention dropout functionally (``config.attention_dropout``,
no module); GPT-2-style models name it ``*_pdrop`` and hold ``nn.Dropout``
modules; BERT-style ``hidden_dropout_prob``. Both places are read: the
config (nested configs included, e.g. ``text_config``) and the modules.
"""
from __future__ import annotations

from collections.abc import Mapping
from typing import Any

MAX_NAMED = 8  # sources named in a finding; the rest are counted


def _config_dict(config: Any) -> Mapping[str, Any]:
    to_dict = getattr(config, "to_dict", None)
    if callable(to_dict):
        try:
            return to_dict()
        except Exception:  # noqa: BLE001 - an odd config: no config sources
            return {}
    return config if isinstance(config, Mapping) else {}


def _is_dropout_key(key: str) -> bool:
    key = key.lower()
    return "dropout" in key or key.endswith("pdrop")


def config_dropouts(config: Any, prefix: str = "config") -> list[str]:
    """``config.attention_dropout=0.1`` for every numeric dropout setting above zero, nested configs included."""
    found: list[str] = []
    for key, value in _config_dict(config).items():
        if isinstance(value, Mapping):
            found += config_dropouts(value, f"{prefix}.{key}")
        elif _is_dropout_key(str(key)) and isinstance(value, (int, float)) and not isinstance(value, bool) and value > 0:
            found.append(f"{prefix}.{key}={value:g}")
    return found


def module_dropouts(model: Any) -> list[str]:
    """``model.layers.0.drop (Dropout p=0.1)`` for every torch dropout module with p > 0."""
    from torch.nn.modules.dropout import _DropoutNd

    named = getattr(model, "named_modules", None)
    if not callable(named):
        return []
    return [f"{name or 'model'} ({type(m).__name__} p={m.p:g})" for name, m in named() if isinstance(m, _DropoutNd) and m.p > 0]


def dropout_sources(model: Any) -> list[str]:
    """Every place ``model`` draws dropout from (config first, then modules); [] for a model without dropout."""
    if model is None:
        return []
    inner = getattr(model, "module", model)  # DDP / DeepSpeed engine wrappers
    return config_dropouts(getattr(inner, "config", None)) + module_dropouts(inner)


def describe(sources: list[str]) -> str:
    """The first few sources, and how many more."""
    shown = ", ".join(sources[:MAX_NAMED])
    rest = len(sources) - MAX_NAMED
    return shown + (f" and {rest} more" if rest > 0 else "")
