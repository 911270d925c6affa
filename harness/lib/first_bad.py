"""The first bad tensor: which parameter gradients, and which module output, went non-finite first.

Used on a flagged step only (a non-finite loss or gradient norm was already
found), where one extra device-to-host read is allowed: every function here
reads at most once, and nothing here runs on an ordinary step.

- :func:`nonfinite_names`: which of some named tensors hold NaN/Inf; the
  gradients' side (module order, backward order) is
  :mod:`harness.lib.first_bad_grads`.
- :func:`locate_forward`: one forward pass of a micro-batch under
  ``torch.no_grad`` (RNG saved and restored) with a forward hook on every
  module; the first module, in completion order (a child finishes before its
  parent), whose output is non-finite, with min/max/abs-max of its input and
  output (what ``transformers.debug_utils.DebugUnderflowOverflow`` prints),
  and the last finite module before it. When that module's input is finite
  (or not floating, as an embedding's token ids), its own parameters (that
  module's only, not its children's) are checked for NaN/Inf with one more
  read: a weight already non-finite is the model state (an earlier update
  wrote it), neither the batch nor the device. When its input is already
  non-finite, no module call made the NaN: the code of an enclosing module
  did, between its children's calls (a Qwen3-MoE experts module applies its
  own 3D expert weights before it calls its activation). That module, the
  innermost enclosing one whose inputs were finite, is named
  (``nonfinite_made_in``) and its own parameters are checked instead.

Finiteness is read from ``torch.aminmax`` (NaN propagates into both, Inf
shows as an extreme), so no tensor the size of an activation is allocated.
"""
from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

import torch

from harness.core.strictjson import strict_json
from harness.lib.rng_state import rng_state as _rng_state, set_rng_state

MAX_NAMES = 50
_WRAPPER_PARTS = ("_fsdp_wrapped_module.", "_checkpoint_wrapped_module.", "_orig_mod.")
_NAN = float("nan")


def clean_name(name: str) -> str:
    """A parameter or module name without the wrappers' prefixes (DDP ``module.``, FSDP1, activation checkpointing, compile)."""
    for part in _WRAPPER_PARTS:
        name = name.replace(part, "")
    return name[len("module."):] if name.startswith("module.") else name


def extremes(tensor: torch.Tensor) -> torch.Tensor:
    """[min, max] as float32 on the tensor's device, no host sync; NaN when the tensor holds a NaN."""
    low, high = torch.aminmax(tensor.detach().reshape(-1))
    return torch.stack((low, high)).float()


def _usable(tensor: Any) -> bool:
    return torch.is_tensor(tensor) and tensor.is_floating_point() and tensor.numel() > 0


def nonfinite_names(named: Iterable[tuple[str, torch.Tensor | None]]) -> tuple[list[str], int]:
    """Names (in the given order) of the floating-point tensors that hold NaN/Inf, and how many were checked; one device read."""
    kept = [(n, t) for n, t in named if _usable(t)]
    if not kept:
        return [], 0
    device = kept[0][1].device
    bounds = torch.stack([extremes(t).to(device) for _, t in kept])
    finite = torch.isfinite(bounds).all(dim=1).tolist()  # the one read
    return [n for (n, _), ok in zip(kept, finite) if not ok], len(kept)


def _float_tensors(value: Any, first_only: bool = False, depth: int = 0) -> list[torch.Tensor]:
    """Floating-point tensors in a module's input or output (tensors, tuples, lists, dicts, ModelOutputs)."""
    if _usable(value):
        return [value]
    if depth > 3:
        return []
    items = value.values() if isinstance(value, Mapping) else value if isinstance(value, (tuple, list)) else ()
    found: list[torch.Tensor] = []
    for item in items:
        found += _float_tensors(item, first_only, depth + 1)
        if first_only and found:
            break
    return found


@dataclass
class ModuleCall:
    """One module's forward call, as read back: min/max of its first floating input and output, and finiteness of all outputs."""

    name: str
    kind: str
    input: dict[str, Any] | None
    output: dict[str, Any] | None
    finite: bool
    inputs_finite: bool = True  # every floating input (not only the first) was finite

    def describe(self) -> str:
        def stats(s: dict[str, Any] | None) -> str:
            return "none" if s is None else f"min {s['min']:.2e} max {s['max']:.2e} abs max {s['abs_max']:.2e}"
        return f"{self.name} ({self.kind}; input {stats(self.input)}; output {stats(self.output)})"

    def evidence(self) -> dict[str, Any]:
        # strict JSON: non-finite floats as strings ("nan", "inf")
        return {"name": self.name, "class": self.kind, "input": strict_json(self.input), "output": strict_json(self.output)}


@dataclass
class ParamCount:
    """One parameter of the first non-finite module: how many of its elements are NaN/Inf, on which rank."""

    name: str  # the model's name for it (``model.layers.0.mlp.down_proj.weight``)
    local: str  # the module's own name for it (``weight``)
    nonfinite: int
    elements: int
    rank: int | None = None

    def evidence(self) -> dict[str, Any]:
        return {"param": self.name, "rank": self.rank, "nonfinite_elements": self.nonfinite, "elements": self.elements}

    def describe(self) -> str:
        where = f" on rank {self.rank}" if self.rank is not None else ""
        return f"its {self.local} holds NaN/Inf{where} ({self.nonfinite} of {self.elements} elements)"


@dataclass
class ForwardLocation:
    """What a traced forward pass found."""

    first: ModuleCall | None
    last_finite: ModuleCall | None
    calls: int
    own_params: list[ParamCount] | None = None  # the parameters of the module that made the NaN, checked (None: not checked)
    made_in: ModuleCall | None = None  # first's input was already non-finite: the enclosing module whose own code made it
    fed_nonfinite: bool = False  # first's input was already non-finite and no enclosing module had finite inputs

    @property
    def nonfinite_params(self) -> list[ParamCount]:
        return [p for p in self.own_params or [] if p.nonfinite]

    @property
    def reproduced(self) -> bool:
        return self.first is not None

    def evidence(self) -> dict[str, Any]:
        return {
            "reproduced_in_forward": self.reproduced,
            "first_nonfinite_module": self.first.name if self.first else None,
            "first_nonfinite": self.first.evidence() if self.first else None,
            "last_finite_module": self.last_finite.name if self.last_finite else None,
            "last_finite": self.last_finite.evidence() if self.last_finite else None,
            # first's input was already non-finite: the enclosing module whose own code (not a child's call) made the NaN
            "nonfinite_made_in": self.made_in.name if self.made_in else None,
            "modules_traced": self.calls,
            # the first module's own parameters that hold NaN/Inf ([]: checked, all finite; None: not checked)
            "nonfinite_params_of_module": None if self.own_params is None else [p.evidence() for p in self.nonfinite_params],
            "params_of_module_checked": None if self.own_params is None else len(self.own_params),
        }

    def describe(self) -> str:
        if self.first is None:
            return (f"a rerun of that micro-batch on the same weights was finite in all {self.calls} module calls "
                    "(not reproduced in the forward: a transient fault, or a loss computed outside the model)")
        after = f", after {self.last_finite.name} (finite)" if self.last_finite else " (the first module to run)"
        made = ""
        if self.made_in is not None:
            made = (f"; its input was already non-finite: {self.made_in.name} ({self.made_in.kind}) made it with its own code "
                    f"before calling {self.first.name} (its inputs were finite)")
        elif self.fed_nonfinite:
            made = "; its input was already non-finite when the model received it"
        bad = self.nonfinite_params
        where = f"{self.made_in.name}: " if self.made_in is not None and bad else ""
        own = ("; " + where + "; ".join(p.describe() for p in bad) + ": the weights were already non-finite before this step (an "
               "earlier update wrote them), so the model state made this NaN, not the batch and not the device") if bad else ""
        return f"first module with a non-finite output, rerun on the same weights: {self.first.describe()}{after}{made}{own}"


class ForwardTrace:
    """Forward hooks on every module of ``model`` that queue, per call, [input min, max, output min, max, all outputs finite]."""

    def __init__(self, model: torch.nn.Module) -> None:
        self.model = model
        self._handles: list[Any] = []
        self._calls: list[tuple[str, str, bool, bool, torch.Tensor]] = []
        self.modules: dict[str, tuple[str, torch.nn.Module]] = {}  # label -> (parameter name prefix, module)

    def __enter__(self) -> ForwardTrace:
        for name, module in self.model.named_modules():
            label = clean_name(name) or f"({type(module).__name__}: the model itself)"
            self.modules.setdefault(label, (clean_name(name), module))
            self._handles.append(module.register_forward_hook(self._hook(label), with_kwargs=True))
        return self

    def __exit__(self, *exc: Any) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles = []

    def _hook(self, name: str) -> Any:
        def hook(module: torch.nn.Module, args: Any, kwargs: Any, output: Any) -> None:
            sources = _float_tensors(args) + _float_tensors(kwargs)
            source = sources[0] if sources else None
            outputs = _float_tensors(output)
            first = outputs[0] if outputs else None
            ref = first if first is not None else source
            if ref is None:
                return  # nothing floating in or out (e.g. a container module called on nothing)
            device = ref.device
            blank = torch.full((2,), _NAN, device=device)
            inp = extremes(source).to(device) if source is not None else blank
            out = extremes(first) if first is not None else blank
            flags = [torch.isfinite(extremes(o).to(device)).all() for o in outputs]
            finite = torch.stack(flags).all() if flags else torch.ones((), dtype=torch.bool, device=device)
            in_flags = [torch.isfinite(extremes(i).to(device)).all() for i in sources]
            inputs_finite = torch.stack(in_flags).all() if in_flags else torch.ones((), dtype=torch.bool, device=device)
            row = torch.cat((inp, out, finite.float().reshape(1), inputs_finite.float().reshape(1)))
            self._calls.append((name, type(module).__name__, source is not None, first is not None, row))
        return hook

    def result(self) -> ForwardLocation:
        """One device read of every queued call."""
        if not self._calls:
            return ForwardLocation(None, None, 0)
        device = self._calls[0][4].device
        rows = torch.stack([row.to(device) for *_, row in self._calls]).tolist()
        calls = [ModuleCall(name, kind, _stats(i_lo, i_hi) if has_in else None, _stats(o_lo, o_hi) if has_out else None, bool(ok),
                            bool(ins))
                 for (name, kind, has_in, has_out, _), (i_lo, i_hi, o_lo, o_hi, ok, ins) in zip(self._calls, rows)]
        index = next((i for i, call in enumerate(calls) if not call.finite), None)
        if index is None:
            return ForwardLocation(None, calls[-1] if calls else None, len(rows))
        first, last_finite = calls[index], calls[index - 1] if index else None
        if first.inputs_finite:
            return ForwardLocation(first, last_finite, len(rows))
        made_in = self._enclosing_with_finite_inputs(first.name, calls[index + 1 :])
        return ForwardLocation(first, last_finite, len(rows), made_in=made_in, fed_nonfinite=made_in is None)

    def _enclosing_with_finite_inputs(self, name: str, later: list[ModuleCall]) -> ModuleCall | None:
        """The innermost module enclosing ``name`` (it finishes later) whose inputs were all finite: its own code made the NaN."""
        root = next((label for label, (prefix, _) in self.modules.items() if prefix == ""), None)
        parts = name.split(".") if name != root else []
        enclosing = [".".join(parts[:n]) for n in range(len(parts) - 1, 0, -1)] + ([root] if root and name != root else [])
        for parent in enclosing:
            call = next((c for c in later if c.name == parent), None)
            if call is not None and call.inputs_finite:  # else it received the NaN too: look further out
                return call
        return None


def _stats(low: float, high: float) -> dict[str, float]:
    return {"min": low, "max": high, "abs_max": max(abs(low), abs(high)) if low == low and high == high else _NAN}


def rng_state() -> dict[str, Any]:
    """Every generator's state (the CPU's and each CUDA device's), restored after the extra forward."""
    return _rng_state(all_devices=True)


restore_rng = set_rng_state


def own_param_counts(module: torch.nn.Module, prefix: str = "", rank: int | None = None) -> list[ParamCount]:
    """Non-finite element counts of ``module``'s own floating-point parameters (not its children's); one device read."""
    named = [(n, p) for n, p in module.named_parameters(recurse=False) if _usable(p)]
    if not named:
        return []
    device = named[0][1].device
    counts = torch.stack([(~torch.isfinite(p.detach())).sum().to(device) for _, p in named]).tolist()  # the one read
    return [ParamCount(f"{prefix}.{n}" if prefix else n, n, int(c), p.numel(), rank) for (n, p), c in zip(named, counts)]


def locate_forward(model: torch.nn.Module, inputs: Mapping[str, Any], rank: int | None = None) -> ForwardLocation:
    """Run ``model(**inputs)`` once without gradients, RNG untouched afterwards, and name the first non-finite module output.

    The parameters of the module that made the NaN (the first non-finite module when its inputs were finite, else the
    enclosing module whose code did) are checked too (one more read, that module's own parameters only).
    """
    saved = rng_state()
    try:
        with torch.no_grad(), ForwardTrace(model) as trace:
            model(**inputs)
        found = trace.result()
        maker = found.made_in  # the enclosing module whose own code made the NaN, else the first module if its inputs were finite
        if maker is None and found.first is not None and found.first.inputs_finite:
            maker = found.first
        if maker is not None and maker.name in trace.modules:
            prefix, module = trace.modules[maker.name]
            found.own_params = own_param_counts(module, prefix, rank)
        return found
    finally:
        restore_rng(saved)
