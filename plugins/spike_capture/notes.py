"""What a spike finding says beside its own numbers: the loss of the same step, the grad norm before it, the batches around it.

Pure functions over host values (no hooks, no device reads), so that the
words of ``spike_capture``'s findings can be tested on their own and never
claim what the numbers do not show (a "loss unmoved" when it moved).
"""
from __future__ import annotations

import math
import statistics
from collections.abc import Iterable, Sequence
from typing import Any

import torch

from harness.lib.sample_rows import dataset_indices, sample_ids
from harness.lib.textsafe import counted
from harness.lib.hashing import content_hashes
from harness.lib.robust import Judgement


def loss_context(j: Judgement | None, spiked: bool, elevated: bool, min_rise: float, fall_z: float) -> tuple[str, bool, dict[str, Any]]:
    """How the step's loss stood against its own baseline: (words for the message, whether it moved, evidence)."""
    if j is None:
        return "the loss of that step has no baseline to compare with yet", False, {}
    evidence = {"loss": j.value, "loss_median": j.median, "loss_z": j.z, "loss_rise": j.rise, "loss_moved": True, "loss_elevated": spiked or elevated}
    change = f"{j.rise * 100:+.0f}% against its running median {j.median:.4f}, {j.z:.1f} robust SDs"
    if spiked:
        return f"together with a loss spike ({change})", True, evidence
    if elevated:
        return f"and the loss rose with it ({change}: elevated, short of a spike)", True, evidence
    if j.rise > min_rise and j.z <= fall_z:
        return f"and the loss rose with it ({change}: within its usual step-to-step noise)", True, evidence
    if j.rise > min_rise:  # not judged an outlier: a loss not judged for spikes, or one of few terms per step (a wider spread)
        return f"and the loss rose with it ({change}; not an outlier by the rules for this run's loss)", True, evidence
    if j.z < -fall_z:
        return f"while the loss fell ({change})", True, evidence
    return f"with the loss within its usual range ({change})", False, {**evidence, "loss_moved": False}


def loss_spike_notes(rise: dict[str, Any], grad: Judgement | None, resume: dict[str, Any], causes: Sequence[str] = ()) -> list[str]:
    """What came with a loss spike, most telling first: the run's own earlier findings that can cause it (``causes``,
    worded), then a grad norm rising before it or jumping with it, then a resume shortly before (the first suspect only
    when the run found nothing else)."""
    notes = []
    if causes:
        notes.append(f"the run found {', '.join(causes)} just before it: suspect that first")
    if rise["grad_norm_rose_before"]:
        notes.append("the grad norm was already rising before it (suspect the optimizer or LR, not only the batch)")
    if grad is not None:
        notes.append(f"the grad norm jumped with it ({grad.value / grad.median if grad.median > 0 else math.inf:.1f}x its median)")
    if resume["after_resume"]:
        since = counted(resume["steps_since_resume"], "steps")
        notes.append(f"it also came {since} after a resume" if causes or rise["grad_norm_rose_before"] else
                     f"it came {since} after a resume (suspect the checkpoint restore first)")
    return notes


def grad_rise(norms: Iterable[float | None], grad_median: float | None) -> dict[str, Any]:
    """Did the grad norm climb in the steps before? (An optimizer instability shows there first; a bad batch does not.)"""
    finite = [n for n in norms if n is not None and math.isfinite(n)]
    last = finite[-3:]
    rose = bool(last and grad_median and statistics.fmean(last) > 1.5 * grad_median)
    return {"grad_norm_history": finite, "grad_norm_rose_before": rose, "grad_norm_median": grad_median}


def earlier_micro_batches(ring: Iterable[tuple[int, int, dict[str, Any]]], step: int, masked_lm: bool = False) -> list[dict[str, Any]]:
    """Ids, dataset indices and content hashes of the micro-batches kept from before ``step``."""
    return [
        {
            "step": s,
            "micro_batch": m,
            "sample_ids": sample_ids(b),
            "dataset_indices": dataset_indices(b),
            "hashes": content_hashes(b, masked_lm) if torch.is_tensor(b.get("input_ids")) else None,
        }
        for s, m, b in ring
        if s != step
    ]


def step_dataset_indices(batches: Sequence[dict[str, Any]]) -> list[list[int] | None] | None:
    """Per micro-batch of the step, its rows' dataset indices (None when no micro-batch has them)."""
    found = [dataset_indices(b) for b in batches]
    return found if any(f is not None for f in found) else None
