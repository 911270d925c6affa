"""Where a model draws dropout masks during training: what its modules will run, not every config key named "dropout".

Three places, in this order of trust:

* ``nn.Dropout`` and friends (any ``_DropoutNd``) with ``p > 0``: GPT-2's
  ``*_pdrop``, BERT's ``hidden_dropout_prob``, T5's ``dropout_rate``, a LoRA's
  ``lora_dropout``;
* dropout a module applies functionally from a number it holds: Llama-style
  attention passes ``self.attention_dropout`` to sdpa/eager/flash as
  ``dropout_p``; T5's attention ``self.dropout``, BART's ``F.dropout(p=self.dropout)``,
  ``activation_dropout``, ``layerdrop``, a DropPath's ``drop_prob``, and
  ``nn.MultiheadAttention.dropout`` alike (a float attribute whose name holds
  "drop", above zero);
* only where that walk found nothing: the two config keys some models read
  from ``self.config`` inside ``forward`` (``attention_dropout``: Persimmon's
  sdpa path, Falcon's residual add, GPT-Neo's flash path; ``hidden_dropout``),
  and only when no module holds its own copy of that key (Llama's attention
  does: a config edited after building changes nothing it runs).

A config key no module reads is no dropout: GPT-2's ``summary_first_dropout``
(0.1 by default) feeds only ``GPT2DoubleHeadsModel``'s summary head, so a
``GPT2LMHeadModel`` with its ``*_pdrop`` at 0 draws no mask at all.
Modules repeated per layer are named once with ``*`` for the layer index.
"""
from __future__ import annotations

import re
from collections.abc import Collection, Iterator, Mapping
from typing import Any

MAX_NAMED = 8  # sources named in a finding; the rest are counted

# config keys a model may read inside forward instead of copying them onto a module
FORWARD_READ_KEYS = ("attention_dropout", "hidden_dropout")
_INDEX = re.compile(r"(?<=\.)\d+(?=\.|$)|^\d+(?=\.|$)")


def _is_drop_name(name: str) -> bool:
    return "drop" in name.lower()


def _probability(value: Any) -> float | None:
    """``value`` as a dropout probability when it is a plain number (not a bool), else None."""
    return float(value) if isinstance(value, (int, float)) and not isinstance(value, bool) else None


def _modules(model: Any) -> Iterator[tuple[str, Any]]:
    named = getattr(model, "named_modules", None)
    return iter(named()) if callable(named) else iter(())


def _grouped(found: list[tuple[str, str]]) -> list[str]:
    """``(path, detail)`` pairs as one line per path pattern (layer indices as ``*``), with the module count."""
    groups: dict[tuple[str, str], list[str]] = {}
    for path, detail in found:
        groups.setdefault((_INDEX.sub("*", path), detail), []).append(path)
    return [f"{pattern} ({detail}, {len(paths)} modules)" if len(paths) > 1 else f"{paths[0]} ({detail})"
            for (pattern, detail), paths in groups.items()]


def module_dropouts(model: Any) -> list[str]:
    """``transformer.h.*.mlp.dropout (Dropout p=0.1, 2 modules)`` for every torch dropout module with p > 0."""
    from torch.nn.modules.dropout import _DropoutNd

    return _grouped([(name or "model", f"{type(m).__name__} p={m.p:g}")
                     for name, m in _modules(model) if isinstance(m, _DropoutNd) and m.p > 0])


def _drop_attributes(module: Any) -> Iterator[tuple[str, float]]:
    """A module's own numeric attributes named like a drop probability (``attention_dropout``, ``layerdrop``)."""
    for attr, value in vars(module).items():
        p = _probability(value)
        if p is not None and not attr.startswith("_") and _is_drop_name(attr):
            yield attr, p


def functional_dropouts(model: Any) -> list[str]:
    """``model.layers.*.self_attn.attention_dropout=0.1 (functional, 2 modules)``: probabilities a module applies itself."""
    found = [(f"{name or 'model'}.{attr}", f"functional, p={p:g}")
             for name, m in _modules(model) for attr, p in _drop_attributes(m) if p > 0]
    return _grouped(found)


def _held_attributes(model: Any) -> set[str]:
    """Every drop-like attribute name some module holds (at any value): the module's copy is what its forward reads."""
    return {attr for _, m in _modules(model) for attr, _ in _drop_attributes(m)}


def _config_dict(config: Any) -> Mapping[str, Any]:
    to_dict = getattr(config, "to_dict", None)
    if callable(to_dict):
        try:
            return to_dict()
        except Exception:  # noqa: BLE001 - an odd config: no config sources
            return {}
    return config if isinstance(config, Mapping) else {}


def config_dropouts(config: Any, held: Collection[str] = (), prefix: str = "config") -> list[str]:
    """``config.attention_dropout=0.1 (read in forward)`` for the forward-read keys above zero that no module holds (nested configs too)."""
    found: list[str] = []
    for key, value in _config_dict(config).items():
        if isinstance(value, Mapping):
            found += config_dropouts(value, held, f"{prefix}.{key}")
        elif key in FORWARD_READ_KEYS and key not in held and (p := _probability(value)) is not None and p > 0:
            found.append(f"{prefix}.{key}={p:g} (read in forward)")
    return found


def dropout_sources(model: Any) -> list[str]:
    """Every place ``model`` draws dropout from in training (modules, then functional, else forward-read config keys); [] for none."""
    if model is None:
        return []
    inner = getattr(model, "module", model)  # DDP / DeepSpeed engine wrappers
    walked = module_dropouts(inner) + functional_dropouts(inner)
    return walked or config_dropouts(getattr(inner, "config", None), _held_attributes(inner))


def describe(sources: list[str]) -> str:
    """The first few sources, and how many more."""
    shown = ", ".join(sources[:MAX_NAMED])
    rest = len(sources) - MAX_NAMED
    return shown + (f" and {rest} more" if rest > 0 else "")
