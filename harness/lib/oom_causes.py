"""Out-of-memory errors: recognising one, where in the step it struck, and its likely causes, ranked.

The ranking starts from the field notes' OOM row (shared/seeds: "batch too
large, too many activations, sharding too low"; fix: "activation
checkpointing, shorter sequences, a higher sharding level"), in that order,
then moves a cause up for each piece of evidence that points at it: the
step (the first step of a run is a static budget that never fit; a failure
after many steps on a longer batch than any before is the sequence length),
where the allocation failed (forward, loss, backward, optimizer, an
evaluation, a checkpoint save) and the allocator's state (a large reserved
but unallocated share is fragmentation). Pure logic: unit-tested without a
run.
"""
from __future__ import annotations

import re
import traceback
from dataclasses import dataclass, field
from typing import Any

OOM_WORDS = ("out of memory", "not enough memory", "cuda error: out of memory", "outofmemory")

EVAL_NAMES = {"evaluate", "evaluation_loop", "prediction_step", "prediction_loop", "predict"}
SAVE_NAMES = {"_save_checkpoint", "save_model", "_save", "save_pretrained", "_save_optimizer_and_scheduler", "save_checkpoint"}
LOSS_NAMES = {"cross_entropy", "loss_function", "ForCausalLMLoss", "fixed_cross_entropy", "log_softmax", "nll_loss"}


def oom_error(error: BaseException | None) -> BaseException | None:
    """The out-of-memory error in ``error`` or its causes (``torch.OutOfMemoryError``, MemoryError, an OOM RuntimeError)."""
    seen: set[int] = set()
    while error is not None and id(error) not in seen:
        seen.add(id(error))
        if isinstance(error, MemoryError) or type(error).__name__ == "OutOfMemoryError":
            return error
        if isinstance(error, RuntimeError) and any(word in str(error).lower() for word in OOM_WORDS):
            return error
        error = error.__cause__ or error.__context__
    return None


def phase_of(error: BaseException) -> tuple[str, str | None]:
    """Where the allocation failed, from the traceback: (phase, innermost frame outside torch).

    Phases: ``evaluation`` and ``checkpoint`` (anywhere on the stack), else
    the innermost of ``loss``, ``optimizer``, ``backward``, ``forward``;
    ``unknown`` without a matching frame.
    """
    frames = traceback.extract_tb(error.__traceback__) if error.__traceback__ is not None else []
    names = {f.name for f in frames}
    where = next((f"{f.filename}:{f.lineno} {f.name}" for f in reversed(frames) if "/torch/" not in f.filename.replace("\\", "/")), None)
    if names & EVAL_NAMES:
        return "evaluation", where
    if names & SAVE_NAMES:
        return "checkpoint", where
    for frame in reversed(frames):
        path = frame.filename.replace("\\", "/")
        if frame.name in LOSS_NAMES:
            return "loss", where
        if "/torch/optim/" in path or ("/deepspeed/runtime/zero/" in path and frame.name == "step"):
            return "optimizer", where
        if "/torch/autograd/" in path or frame.name == "backward":
            return "backward", where
        if frame.name == "forward":
            return "forward", where
    return "unknown", where


def message_numbers(message: str) -> dict[str, float | None]:
    """GiB asked for, allocated and reserved-but-unallocated, as PyTorch's CUDA OOM message states them (None if absent)."""
    units = {"b": 2**-30, "kib": 2**-20, "mib": 2**-10, "gib": 1.0, "tib": 2**10}

    def grab(pattern: str) -> float | None:
        match = re.search(pattern, message, re.I)
        return float(match.group(1)) * units[match.group(2).lower()] if match else None

    size = r"([\d.]+) (B|KiB|MiB|GiB|TiB)"
    return {"tried_to_allocate": grab(rf"tried to allocate {size}"), "allocated": grab(rf"{size} is allocated by PyTorch"),
            "reserved_unallocated": grab(rf"{size} is reserved by PyTorch but unallocated")}


@dataclass
class OomFacts:
    """What is known when an OOM ends a run (host values only)."""

    step: int | None
    phase: str  # forward, loss, backward, optimizer, evaluation, checkpoint, unknown
    steps_done: int = 0  # optimizer steps completed in this train() call before the failing one
    rows: int | None = None  # of the failing micro-batch
    seq_len: int | None = None  # its padded length
    longest_before: int | None = None  # the longest padded length of the earlier steps of the run
    median_before: float | None = None
    reserved_unallocated: float | None = None  # GiB
    reserved: float | None = None  # GiB: allocated + reserved-unallocated
    gradient_checkpointing: bool | None = None
    attn_implementation: str | None = None
    sharding: str | None = None  # "ZeRO-2 over 8 ranks", "FSDP", None: every rank holds everything
    eval_batch: int | None = None
    train_batch: int | None = None
    notes: list[str] = field(default_factory=list)


SEED_ORDER = ("batch_too_large", "activations", "sharding", "sequence_length", "logits", "evaluation", "checkpoint", "fragmentation")
TITLES = {
    "batch_too_large": "micro-batch too large for the memory budget",
    "activations": "activations (no activation checkpointing, or eager attention)",
    "sharding": "weights, gradients and optimizer state not sharded enough",
    "sequence_length": "sequence length (a longer batch than the run had seen)",
    "logits": "the logits of the loss (micro-batch x sequence x vocabulary)",
    "evaluation": "evaluation (eval batch size, logits accumulated on the device)",
    "checkpoint": "checkpoint saving (gathering full weights)",
    "fragmentation": "fragmentation (memory reserved but not in one block)",
}
FIXES = {
    "batch_too_large": "lower per_device_train_batch_size and raise gradient_accumulation_steps to keep the global batch",
    "activations": "turn on gradient_checkpointing; use sdpa or flash attention",
    "sharding": "raise the ZeRO stage (1, 2, then 3) or use FSDP; bf16; an 8-bit optimizer or LoRA",
    "sequence_length": "cap max_length; bucket or pack by length so that the longest samples do not meet in one batch",
    "logits": "a smaller micro-batch, or a chunked / fused cross-entropy",
    "evaluation": "lower per_device_eval_batch_size; set eval_accumulation_steps or prediction_loss_only",
    "checkpoint": "do not gather 16-bit weights on one rank at save (ZeRO-3: stage3_gather_16bit_weights_on_model_save)",
    "fragmentation": "PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True",
}
STRONG, SOME = 3.0, 1.0
SAME_SHAPE_STEPS = 20  # a shape that fit this many steps and fails now: memory grew or fragmented, the shape is not new
ALWAYS = ("batch_too_large", "activations", "sharding", "sequence_length")  # the seeds' row: listed even without evidence


def rank_causes(facts: OomFacts) -> list[dict[str, Any]]:
    """The likely causes, most likely first, each with the evidence that points at it and its first fix."""
    evidence: dict[str, list[tuple[float, str]]] = {cause: [] for cause in SEED_ORDER}

    def point(cause: str, weight: float, why: str) -> None:
        evidence[cause].append((weight, why))

    in_step = facts.phase in ("forward", "loss", "backward", "optimizer", "unknown")
    if facts.step is None and in_step:  # before any micro-batch: setting up the model, the engine or the optimizer
        point("sharding", STRONG, "the run failed before its first micro-batch: the weights and optimizer state alone do not fit")
    first = facts.steps_done == 0 and in_step and facts.step is not None
    shape = f"{facts.rows}x{facts.seq_len}" if facts.rows and facts.seq_len else None
    longer = facts.seq_len is not None and facts.longest_before is not None and facts.seq_len > facts.longest_before
    if first:
        point("batch_too_large", STRONG, f"the first step of the run failed{f' at micro-batch {shape}' if shape else ''}: the configured shape never fit")
        point("sharding", SOME, "the first step of the run failed: the static budget (weights, gradients, optimizer state) may not fit")
    if facts.phase == "optimizer":
        point("sharding", STRONG, "the allocation failed in the optimizer step (its state is allocated at the first update)")
    if facts.phase in ("forward", "backward"):
        point("activations", SOME if first else SOME / 2, f"the allocation failed in the {facts.phase} pass")
        if facts.gradient_checkpointing is False:
            point("activations", SOME, "gradient checkpointing is off")
        if facts.attn_implementation == "eager":
            point("activations", SOME, f"eager attention{f' at {facts.seq_len} tokens' if facts.seq_len else ''} materialises the scores")
    if facts.phase == "loss":
        point("logits", STRONG, f"the allocation failed in the loss{f' over {shape} tokens' if shape else ''}")
    if facts.sharding is None and (first or facts.phase in ("optimizer", "backward")):
        point("sharding", SOME / 2, "every rank holds the whole model and its optimizer state (no ZeRO or FSDP)")
    if longer and not first:
        point("sequence_length", STRONG, f"after {facts.steps_done} steps this batch is {facts.seq_len} tokens long, "
              f"the longest before was {facts.longest_before}" + (f" (median {facts.median_before:.0f})" if facts.median_before else ""))
    elif facts.steps_done >= SAME_SHAPE_STEPS and in_step and not longer and facts.seq_len is not None:
        point("fragmentation", SOME / 2, f"after {facts.steps_done} steps a batch no longer than before ({facts.seq_len} tokens) failed")
    if facts.phase == "evaluation":
        detail = f" (eval batch {facts.eval_batch}, train batch {facts.train_batch})" if facts.eval_batch and facts.train_batch else ""
        point("evaluation", STRONG, f"the allocation failed during evaluation{detail}")
    if facts.phase == "checkpoint":
        point("checkpoint", STRONG, "the allocation failed while saving a checkpoint")
    free, reserved = facts.reserved_unallocated, facts.reserved
    if free is not None and free >= 0.5 and (reserved is None or free >= 0.2 * reserved):
        share = f" of {reserved:.2f} GiB reserved" if reserved else ""
        point("fragmentation", STRONG if reserved else SOME, f"{free:.2f} GiB{share} is held by PyTorch but not allocated (no block large enough)")
    ranked = []
    for order, cause in enumerate(SEED_ORDER):
        found = evidence[cause]
        if not found and cause not in ALWAYS:
            continue
        score = sum(w for w, _ in found) + (len(SEED_ORDER) - order) * 0.01  # ties keep the seeds' order
        ranked.append({"cause": cause, "title": TITLES[cause], "score": round(score, 2),
                       "evidence": [why for _, why in found] or ["no direct evidence (the field notes' usual suspect)"],
                       "fix": FIXES[cause]})
    ranked.sort(key=lambda c: -c["score"])
    return ranked


__all__ = ["OomFacts", "oom_error", "phase_of", "message_numbers", "rank_causes"]
