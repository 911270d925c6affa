"""Do the names and shapes in a weights file fit the model? Judged in every layout the model is saved in, not by raw names.

transformers 5 saves a model in its *saved format*: ``save_pretrained`` drops
tied copies and reverts the weight conversions it applies at load (a
Qwen3-MoE's fused ``experts.gate_up_proj`` is written as
``experts.<i>.gate_proj.weight`` / ``up_proj`` per expert). The names in
memory are then not the names on disk. :func:`saved_layout` asks transformers
itself: it builds the model from its config on the meta device (no memory,
no draw from the training's RNG) and runs the same two steps
``save_pretrained`` runs (``remove_tied_weights_from_state_dict``,
``revert_weight_conversion``). :func:`layout_problems` then compares the file
with each layout it may be in (the names in memory, the saved format) and
judges it by the one it fits best: a tensor the model needs that the file
lacks, or one of the wrong shape, is a problem naming it; a file that fits
no layout is not comparable, and the caller says what that means: with every
layout the model is saved in known (its names and its saved format), the
names of another model (``proof_worker``: corrupt); without its saved
format (a model that does not build on the meta device), possibly a format
not known here (not proven, not corrupt).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from harness.lib.checkpoint_verify import Problem


@dataclass
class NameLayout:
    """One way a model's weights may be named in a file: name -> (shape, group); names of one group are one tensor (tied)."""

    label: str
    tensors: dict[str, tuple[tuple[int, ...], int]] = field(default_factory=dict)


def memory_layout(expected: dict[str, tuple[tuple[int, ...], int]]) -> NameLayout:
    """The names of the model in memory (``checkpoint_verify.expected_shapes``: shape and storage, tied names share it)."""
    return NameLayout("the model's own names", dict(expected))


def saved_layout(model_class: Any, config: Any) -> NameLayout | None:
    """The names and shapes transformers' ``save_pretrained`` writes for this model; None where this transformers has no
    saved format (4.x) or the model does not build from its config on the meta device."""
    from harness.lib.meta_model import build_on_meta

    try:
        from transformers.core_model_loading import revert_weight_conversion
        from transformers.modeling_utils import remove_tied_weights_from_state_dict
    except ImportError:
        return None
    try:
        model = build_on_meta(model_class, config)  # a mode of this thread only: the training thread is not affected
        saved = revert_weight_conversion(model, remove_tied_weights_from_state_dict(model.state_dict(), model))
    except Exception:  # noqa: BLE001 - a model this cannot build: judged by its names in memory alone
        return None
    return NameLayout("transformers' saved format", {name: (tuple(t.shape), index) for index, (name, t) in enumerate(saved.items())})


def missing_names(saved: dict[str, tuple[int, ...]], layout: NameLayout) -> list[str]:
    """The layout's names the file lacks (a name counts as present when another of its tied group is)."""
    present = {group for name, (_, group) in layout.tensors.items() if name in saved}
    return [name for name, (_, group) in layout.tensors.items() if name not in saved and group not in present]


def layout_problems(saved: dict[str, tuple[int, ...]], layouts: list[NameLayout], file: str) -> tuple[list[Problem], str | None]:
    """Problems of the file's tensors (``saved``: name -> shape) in the layout they fit best, or why none is comparable.

    A layout fits when every name the file holds is one of its names, or when it lacks none of them: a tensor missing
    from a file otherwise in the layout is a problem; names of another model are not (the file is not comparable).
    """
    best: tuple[NameLayout, list[str], list[str]] | None = None
    for layout in layouts:
        unknown = [name for name in saved if name not in layout.tensors]
        missing = missing_names(saved, layout)
        if unknown and missing:
            continue
        if best is None or (len(missing), len(unknown)) < (len(best[1]), len(best[2])):
            best = (layout, missing, unknown)
    if best is None:
        closest = min(layouts, key=lambda lay: sum(name not in lay.tensors for name in saved))
        unknown = [name for name in saved if name not in closest.tensors]
        return [], (f"the saved names fit none of the model's layouts ({', '.join(lay.label for lay in layouts)}); closest: "
                    f"{len(unknown)} unknown, e.g. {unknown[0]}, and {len(missing_names(saved, closest))} of the model's missing")
    layout, missing, _ = best
    problems = [Problem(file, f"tensor {name} has shape {list(saved[name])}, the model's is {list(shape)}")
                for name, (shape, _) in layout.tensors.items() if name in saved and tuple(saved[name]) != shape]
    if missing:
        problems.append(Problem(file, f"lacks {len(missing)} tensor(s) of the model ({layout.label}), e.g. {', '.join(missing[:3])}"))
    return problems, None
