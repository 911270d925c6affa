"""A CPU copy of a model rebuilt from its config with a checkpoint's tensors, renamed and converted the way transformers loads them.

transformers 5 saves a model in its *saved format* (a MoE's fused experts
written per expert, a base model's prefix, legacy names) and converts it back
at load. The copy is built on the meta device (:mod:`harness.lib.meta_model`:
no memory, no draw from the RNG), the tensors (read with ``safetensors`` or
``torch.load(weights_only=True)`` already) are renamed and converted by
transformers' own conversion mapping (``get_model_conversion_mapping``, the
steps ``convert_and_load_state_dict_in_model`` applies: renamings, then at
most one converter per tensor, the base model's prefix added or dropped) and
assigned with ``load_state_dict(assign=True)``; what is tied is tied as
``from_pretrained`` ties it, and the non-persistent buffers come from the
model in memory (no file holds them). The class comes from the model in
memory, never from a name in a received file.

It runs on the proof's own thread while training goes on, so it changes
nothing another thread can see: not ``from_pretrained``, whose load sets
torch's default dtype, swaps ``PreTrainedModel.tie_weights`` and
``torch.nn.init.*`` for no-ops, patches ``torch.linspace`` and classes, and
would race a load on another thread (a reward model, the training script's
own) on restoring them; no loading bar, no load report, no thread pool.
"""
from __future__ import annotations

import copy
from typing import Any

from harness.lib.meta_model import build_on_meta


def converted(model: Any, tensors: dict[str, Any]) -> dict[str, Any]:
    """``tensors`` (a file's, by its names) under ``model``'s names in memory, converted as transformers' loading converts
    them; names the model does not have are left out (``from_pretrained`` drops them too). As they are on a transformers
    without conversions (4.x)."""
    try:
        from transformers.conversion_mapping import get_model_conversion_mapping
        from transformers.core_model_loading import WeightConverter, WeightRenaming, dot_natural_key, rename_source_key
    except ImportError:
        return dict(tensors)
    mapping = get_model_conversion_mapping(model)  # fresh copies: nothing shared is changed by renaming through them
    renamings = [t for t in mapping if isinstance(t, WeightRenaming)]
    converters = [t for t in mapping if isinstance(t, WeightConverter)]
    by_pattern = {pattern: converter for converter in converters for pattern in converter.source_patterns}
    names = model.state_dict()  # meta tensors: the names (and shapes) only
    prefix = model.base_model_prefix
    out: dict[str, Any] = {}
    pending: dict[str, Any] = {}
    for key in sorted(tensors, key=dot_natural_key):
        renamed, pattern = rename_source_key(key, renamings, converters, prefix, names)
        if renamed not in names and key in names:  # not to be renamed after all (at most the prefix)
            renamed, pattern = rename_source_key(key, [], [], prefix, names)
        if renamed not in names:
            continue
        if pattern is None:
            out[renamed] = tensors[key]
        else:  # one converter per target, fed every tensor of its sources (a MoE's experts, one by one)
            pending.setdefault(renamed, copy.deepcopy(by_pattern[pattern])).add_tensor(renamed, key, pattern, tensors[key])
    for first, converter in pending.items():
        try:
            done = converter.convert(first, model=model, config=model.config)
        except Exception:  # noqa: BLE001 - tensors that do not convert (an expert's lost): its targets stay unset, as in from_pretrained
            continue
        for name, value in done.items():
            out[name] = value[0] if isinstance(value, list) else value
    return out


def _on_meta(model: Any) -> list[str]:
    return [name for name, t in [*model.named_parameters(remove_duplicate=False), *model.named_buffers(remove_duplicate=False)]
            if t.device.type == "meta"]


def _tie(model: Any) -> None:
    """Tie what the model ties, as ``from_pretrained`` does after its load: to whichever of a tied pair the file held."""
    tie = getattr(model, "tie_weights", None)
    if not callable(tie):
        return
    try:
        tie(missing_keys=set(_on_meta(model)), recompute_mapping=False)
    except TypeError:  # a transformers whose tie_weights takes no arguments (4.x)
        tie()


def rebuild(model_class: Any, config: Any, tensors: dict[str, Any], buffers: dict[str, Any]) -> tuple[Any, list[str]]:
    """``(model, [])``: ``model_class`` from ``config`` on the CPU in fp32 with ``tensors`` loaded as transformers loads them,
    the non-persistent ``buffers`` of the model in memory put back (no file holds them); ``(None, missing)`` when the
    tensors leave some of the model's unset (no forward pass is worth running then)."""
    import torch

    model = build_on_meta(model_class, config)
    model.float()  # meta: nothing allocated; every tensor assigned below is fp32 as well
    floats = {k: v.to(torch.float32) if v.is_floating_point() else v for k, v in tensors.items()}
    model.load_state_dict(converted(model, floats), strict=False, assign=True)
    _tie(model)
    for name, buffer in buffers.items():
        owner, _, leaf = name.rpartition(".")
        try:
            module = model.get_submodule(owner) if owner else model
        except AttributeError:
            continue
        if leaf in module._buffers:
            module._buffers[leaf] = buffer.to(torch.float32) if buffer.is_floating_point() else buffer
    missing = sorted(set(_on_meta(model)))
    if missing:
        return None, missing
    model.eval()
    return model, []
