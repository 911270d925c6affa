"""What a checkpoint's weights file holds, told from the model in memory: a transformers model, or a PEFT adapter.

The Trainer saves ``trainer.model`` by what it is. A transformers model
writes itself with ``save_pretrained`` (transformers 5 in its saved format: a
MoE's fused experts split per expert, tied weights once). A PEFT model writes
its adapter only (``adapter_model.safetensors``, names from
``peft.get_peft_model_state_dict``). A wrapper that holds one transformers
model and no weights of its own (a SentenceTransformer: ``Transformer`` ->
``Pooling``) writes that model at the checkpoint's top (its own files beside
it hold no weights). The proof checks the file against the part that wrote
it: :func:`find_target` names that part and keeps what the checking thread
needs (the class from memory, never a class a received file names; a copy of
the config), so the thread never touches the model that trains.
"""
from __future__ import annotations

import copy
from dataclasses import dataclass
from typing import Any

ADAPTER_ROOT = "default"  # PEFT writes the adapter named "default" at the checkpoint's top, any other in a folder of its name


@dataclass(frozen=True)
class Target:
    """The part of the trained model that a checkpoint's top-level weights file holds.

    ``kind``: ``model`` (a transformers model: the trained model itself, or the one inside a wrapper) or ``adapter`` (a PEFT
    adapter). ``prefix``: the module path of that part inside the trained model ("" for the model itself), which a file
    written from the wrapper's whole state dict would put before every name. ``model_class`` and ``config`` (a copy): what
    a rebuild needs (None for an adapter).
    """

    kind: str
    name: str  # what it is, for messages: "BertModel inside SentenceTransformer", "the PEFT adapter 'default' of ..."
    prefix: str = ""
    model_class: Any = None
    config: Any = None
    adapter_name: str | None = None


def is_peft(model: Any) -> bool:
    """A PEFT model (``peft.PeftModel``), told without importing peft."""
    return callable(getattr(model, "get_base_model", None)) and isinstance(getattr(model, "peft_config", None), dict) \
        and type(model).__module__.split(".")[0] == "peft"


def _is_transformers_model(module: Any) -> bool:
    return callable(getattr(type(module), "from_pretrained", None)) and hasattr(type(module), "config_class") \
        and getattr(module, "config", None) is not None


def find_target(model: Any) -> tuple[Target | None, Any, str | None]:
    """``(target, the module in memory it describes, None)``, or ``(None, None, why not)``."""
    if is_peft(model):
        if ADAPTER_ROOT not in model.peft_config:
            return None, None, (f"the PEFT model has no adapter named {ADAPTER_ROOT!r} (it has {', '.join(map(repr, model.peft_config))}), "
                                "and PEFT saves only that one at the checkpoint's top")
        base = type(model.get_base_model()).__name__
        return Target("adapter", f"the PEFT adapter {ADAPTER_ROOT!r} of {base}", adapter_name=ADAPTER_ROOT), model, None
    if _is_transformers_model(model):
        return Target("model", type(model).__name__, "", type(model), copy.deepcopy(model.config)), model, None
    inner = _single_inner_model(model)
    if isinstance(inner, str):
        return None, None, inner
    prefix, module = inner
    return (Target("model", f"{type(module).__name__} inside {type(model).__name__} ({prefix})", prefix, type(module),
                   copy.deepcopy(module.config)), module, None)


def _single_inner_model(model: Any) -> tuple[str, Any] | str:
    """The one outermost transformers model inside ``model`` holding all of its weights, or why there is none."""
    found = [(name, m) for name, m in model.named_modules() if name and _is_transformers_model(m)]
    outermost = [(n, m) for n, m in found if not any(n.startswith(other + ".") for other, _ in found)]
    what = type(model).__name__
    if len(outermost) != 1:
        return (f"{what} is not a transformers model and holds {len(outermost) or 'no'} transformers model(s), "
                "so there is no config to rebuild its weights from")
    name, inner = outermost[0]
    inside = {id(p) for p in inner.parameters()}
    outside = [n for n, p in model.named_parameters() if id(p) not in inside]
    if outside:
        return (f"{what} has weights outside its {type(inner).__name__} ({len(outside)}, e.g. {outside[0]}), "
                "which no transformers config rebuilds")
    return name, inner


def adapter_state(model: Any, adapter_name: str) -> dict[str, Any]:
    """The adapter's tensors under the names PEFT saves them with (what ``save_pretrained`` writes and ``load_adapter`` reads)."""
    from peft import get_peft_model_state_dict

    return dict(get_peft_model_state_dict(model, adapter_name=adapter_name))
