"""ZeRO-1/2's gradient slices: who owns which slice of each parameter's reduced gradient, and linear checks on them.

Under ZeRO-1/2 no rank holds the whole reduced gradient, so nothing can be
compared bit for bit. A linear fingerprint survives the reduction instead:
every rank sums its own (local, pre-reduction) gradient over every slice,
and each owner's reduced slice must equal the mean of those sums.
"""
from __future__ import annotations

from typing import Any

import torch

from harness.core.distributed import all_gather_guarded, failures

_UNIT_ROUNDOFF: dict[str, float] = {"torch.float64": 1.2e-16, "torch.float32": 6.0e-8, "torch.bfloat16": 3.9e-3, "torch.float16": 4.9e-4}


def unit_roundoff(dtype: Any, default: float) -> float:
    """Half the spacing of ``dtype``'s numbers at 1 (keyed by name, so importing this module reads nothing of torch)."""
    return _UNIT_ROUNDOFF.get(str(dtype), default)


class ZeroSlices:
    """Who owns which slice of each parameter's gradient under ZeRO-1/2, and the linear checks on those slices.

    Two linear fingerprints per slice (plain sum, alternating-sign sum) are
    computed on every rank's local gradient by tensor hooks during the check
    step's backward passes; the mean over ranks must equal the same
    fingerprints of the owner's reduced slice.
    """

    def __init__(self, params: list[tuple[str, torch.nn.Parameter]], rank: int) -> None:
        def mine() -> list[tuple[int, int, int]]:
            pieces = []
            for index, (_, param) in enumerate(params):
                mapping = getattr(param, "_hp_mapping", None)
                if mapping is not None:
                    address = mapping.lp_fragment_address
                    pieces.append((index, int(address.start), int(address.numel)))
            return pieces

        layout = all_gather_guarded(mine)  # every rank joins; the one whose layout raised re-raises after
        failed = failures(layout)
        if failed:  # every rank sees it and fails alike (retried at the next check step, on every rank)
            raise RuntimeError(f"ZeRO slice layout failed on rank {failed[0].rank}: {failed[0].error}")
        self._set_pieces(sorted((index, start, numel, owner) for owner, rank_pieces in enumerate(layout) for index, start, numel in rank_pieces), params, rank)

    def _set_pieces(self, pieces: list[tuple[int, int, int, int]], params: list[tuple[str, torch.nn.Parameter]], rank: int) -> None:
        """The slices (parameter index, start, numel, owning rank), indexed per parameter; no hooks armed yet."""
        self.pieces = pieces
        self.by_param: dict[int, list[tuple[int, int, int]]] = {}
        for k, (index, start, numel, _) in enumerate(self.pieces):
            self.by_param.setdefault(index, []).append((k, start, numel))
        self.params = params
        self.rank = rank
        self.local: torch.Tensor | None = None
        self._handles: list[Any] = []

    @staticmethod
    def linear(values: torch.Tensor) -> torch.Tensor:
        return torch.stack([torch.sum(values, dtype=torch.float64), torch.sum(values[0::2], dtype=torch.float64) - torch.sum(values[1::2], dtype=torch.float64)])

    def arm(self) -> None:
        """Start summing local gradients (for the micro-batches of one check step)."""
        self.disarm()
        for index, (_, param) in enumerate(self.params):
            if index in self.by_param and param.requires_grad:
                self._handles.append(param.register_hook(self._hook(index)))

    def _hook(self, index: int) -> Any:
        def accumulate(grad: torch.Tensor) -> None:
            if self.local is None:
                self.local = torch.zeros(len(self.pieces), 2, dtype=torch.float64, device=grad.device)
            flat = grad.detach().reshape(-1)
            for k, start, numel in self.by_param[index]:
                self.local[k] += self.linear(flat.narrow(0, start, numel))
        return accumulate

    def disarm(self) -> list[list[float]] | None:
        for handle in self._handles:
            handle.remove()
        self._handles = []
        local, self.local = self.local, None
        return local.cpu().tolist() if local is not None else None

    def owned(self, reduce_dtype: torch.dtype | None) -> dict[int, list[float]]:
        """This rank's reduced slices: k -> [sum, alternating sum, L2 norm, unit roundoff of the reduction]."""
        rows, keys, units = [], [], []
        for k, (index, start, numel, owner) in enumerate(self.pieces):
            if owner != self.rank:
                continue
            fragment = self.reduced_fragment(index, start, numel)
            if fragment is None:
                continue
            rows.append(torch.cat([self.linear(fragment), fragment.double().square().sum().sqrt().reshape(1)]))
            keys.append(k)
            units.append(max(unit_roundoff(fragment.dtype, 6.0e-8), unit_roundoff(reduce_dtype, 0.0)))
        if not rows:
            return {}
        values = torch.stack(rows).cpu().tolist()
        return {k: [*v, u] for k, v, u in zip(keys, values, units)}

    def reduced_fragment(self, index: int, start: int, numel: int) -> torch.Tensor | None:
        """The reduced gradient of this rank's slice of parameter ``index`` (ZeRO-1/2: DeepSpeed's fp32 partition)."""
        param = self.params[index][1]
        fragment = param._hp_mapping.get_lp_grad_fragment(param._index_in_param_group).reshape(-1)
        if fragment.numel() == param.numel() and fragment.numel() != numel:
            fragment = fragment.narrow(0, start, numel)  # bf16 keeps a whole accumulation buffer per rank
        return fragment
