"""Parameters grouped by transformer block, the unit that per-layer statistics are kept for.

A parameter inside a block (a ``layers.<i>``, ``layer.<i>``, ``h.<i>``,
``blocks.<i>`` or ``block.<i>`` part of its name, as Llama/Mistral/Qwen/Gemma,
BERT/RoBERTa, GPT-2/Falcon/BLOOM, MPT and T5 name them; the first such part
when there are several, so T5's ``encoder.block.0.layer.1`` is the block
``encoder.block.0``) belongs to that block (``model.layers.1``); any other parameter belongs to
its own module (``model.embed_tokens``, ``model.norm``, ``lm_head``), so the
embeddings and the head are groups of their own. Wrapper prefixes (DDP's
``module.``, ``torch.compile``'s ``_orig_mod.``, FSDP's
``_fsdp_wrapped_module.``) are left out of the names people read.
"""
from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any

BLOCK = re.compile(r"^(.*?(?:^|\.)(?:layers|layer|h|blocks|block)\.\d+)(?:\.|$)")
WRAPPERS = ("module.", "_orig_mod.", "_fsdp_wrapped_module.", "_checkpoint_wrapped_module.")


def clean_name(name: str) -> str:
    """``name`` without the wrapper parts that DDP, FSDP and ``torch.compile`` put into it."""
    for wrapper in WRAPPERS:
        name = name.replace(wrapper, "")
    return name


def group_of(name: str) -> str:
    """The group of parameter ``name``: its block (``model.layers.3``), else its module (``lm_head``)."""
    name = clean_name(name)
    match = BLOCK.match(name)
    if match:
        return match.group(1)
    return name.rsplit(".", 1)[0] if "." in name else name


def is_block(group: str) -> bool:
    return BLOCK.match(group + ".") is not None


@dataclass
class LayerGroups:
    """The trainable parameters of a model, each with the index of its group (groups in parameter order)."""

    names: list[str] = field(default_factory=list)  # group names, in the order their first parameter appears
    params: list[Any] = field(default_factory=list)  # the trainable parameters
    param_names: list[str] = field(default_factory=list)
    index: list[int] = field(default_factory=list)  # group index of each parameter

    @classmethod
    def of(cls, model: Any) -> "LayerGroups":
        groups = cls()
        position: dict[str, int] = {}
        for name, param in model.named_parameters():
            if not getattr(param, "requires_grad", False):
                continue
            group = group_of(name)
            if group not in position:
                position[group] = len(groups.names)
                groups.names.append(group)
            groups.params.append(param)
            groups.param_names.append(name)
            groups.index.append(position[group])
        return groups

    def __len__(self) -> int:
        return len(self.names)
