"""Batch captures: the micro-batches behind a spike or a non-finite step, written for a person and for ``harness replay``.

A capture lives in ``<run_dir>/captures/step-<N>/`` and holds, per rank:

- ``capture.rank-<r>.json``: why it was taken, the model and weights it was
  taken with, the loss and grad-norm history, and one record per sample
  (ranked most suspect first): sample id (the batch's own id column, else
  the row's dataset index), dataset index (from the batch sampler, when the
  loader has one), content hash, token ids, decoded
  text, per-sample loss recomputed by a forward pass on the same weights,
  per-sample gradient norm (``grad_norm``, the ranking's first key) and text
  heuristics (repetition, non-printable and replacement characters, length);
  a ``blame`` block says how the gradient norms were computed and in how many
  seconds;
- ``batch.rank-<r>.pt``: the micro-batch tensors and the RNG state of that
  forward pass, so that ``harness replay`` can recompute the same numbers;
- ``summary.rank-<r>.md``: the ranked samples as a table.

The forward pass runs under ``torch.no_grad`` with the RNG saved and restored
around it, so taking a capture never changes what training does next. The
per-sample gradient norms (:mod:`harness.lib.sample_grads`) cost one forward
and one backward per captured row, only when a capture is taken, through
``torch.autograd.grad`` / ``torch.func`` on the unwrapped model: the step's
``p.grad``, the RNG and the train/eval flags are left as they were.
"""
from __future__ import annotations

import logging
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch

from harness.core.distributed import model_parallel_sizes
from harness.core.strictjson import dumps, json_float, strict_json  # noqa: F401 - strict_json re-exported: plugins import it from here
from harness.lib.capture_summary import CaptureResult, markdown as _markdown, rank_suspects  # CaptureResult re-exported
from harness.lib.hashing import content_hashes
from harness.lib.rng_state import preserved_rng, rng_state as _rng_state, set_rng_state  # re-exported (replay, tests)
from harness.lib.sample_grads import IGNORE_INDEX, Blame, LmBatch, blame_rows, row_inputs, row_loss
from harness.lib.sample_rows import (  # re-exported: plugins import them from here
    DATASET_INDEX_KEY,
    DATASET_INDEX_NOTE_KEY,
    NUM_ITEMS_KEY,
    SAMPLE_ID_KEYS,
    dataset_index_note,
    dataset_indices,
    sample_ids,
    text_heuristics,
)

log = logging.getLogger("harness.lib.capture")

NOT_MODEL_INPUTS = ("labels", *SAMPLE_ID_KEYS, DATASET_INDEX_KEY, DATASET_INDEX_NOTE_KEY, NUM_ITEMS_KEY)
MAX_TEXT_CHARS = 20_000


def per_sample_loss(model: Any, batch: Mapping[str, Any]) -> torch.Tensor | None:
    """Causal-LM loss of each row (mean over its labelled tokens), by forward passes without gradients.

    One row at a time, so that the logits of only one row are ever held (a
    large vocabulary times a long batch would not fit next to training).
    Returns None for batches without ``input_ids`` and ``labels`` of the same
    shape (DPO's paired batches have no labels). A row without any label
    gets NaN.
    """
    split = lm_inputs(batch)
    if split is None:
        return None
    inputs, labels = split
    rows = labels.shape[0]
    with torch.no_grad():
        return torch.stack([row_loss(model(**row_inputs(inputs, rows, r)).logits[0], labels[r]) for r in range(rows)])


def lm_inputs(batch: Mapping[str, Any]) -> LmBatch | None:
    """(model inputs, labels) of a causal-LM batch, the harness's own keys left out; None for any other batch."""
    ids = batch.get("input_ids") if isinstance(batch, Mapping) else None
    labels = batch.get("labels") if isinstance(batch, Mapping) else None
    if not torch.is_tensor(ids) or ids.dim() != 2 or not torch.is_tensor(labels) or labels.shape != ids.shape:
        return None
    return {k: v for k, v in batch.items() if k not in NOT_MODEL_INPUTS and torch.is_tensor(v)}, labels


def can_recompute(trainer: Any) -> str | None:
    """None when one rank may run a forward pass on its own; else why not (sharded parameters)."""
    if trainer is None:
        return "no trainer"
    if getattr(trainer, "is_fsdp_enabled", False):
        return "FSDP shards the parameters: a forward pass on one rank alone would hang"
    sharded = model_parallel_sizes(trainer)
    if sharded:
        return f"model parallelism ({', '.join(f'{k}={v}' for k, v in sharded.items())}) runs collectives inside the forward pass"
    first = next(iter(getattr(getattr(trainer, "model", None), "parameters", lambda: iter(()))()), None)
    if first is not None and type(first).__name__ == "DTensor":
        return "the parameters are distributed tensors (tensor/context parallel): a forward pass on one rank alone would hang"
    if getattr(trainer, "is_deepspeed_enabled", False):
        engine = getattr(trainer, "model_wrapped", None)
        stage = engine.zero_optimization_stage() if hasattr(engine, "zero_optimization_stage") else 0
        if stage >= 3:
            return "DeepSpeed ZeRO-3 shards the parameters: a forward pass on one rank alone would hang"
    return None


def recompute_losses(model: Any, batches: list[dict[str, Any]], rng: dict[str, Any]) -> list[torch.Tensor | None]:
    """Per-sample losses of each micro-batch, in order, starting from ``rng``; the caller's RNG is left as it was."""
    with preserved_rng(rng):
        return [per_sample_loss(model, b) for b in batches]


def autocast_dtype(trainer: Any) -> str | None:
    """The dtype the Trainer's forward runs under autocast (accelerate wraps ``model.forward`` for bf16/fp16)."""
    precision = str(getattr(getattr(trainer, "accelerator", None), "mixed_precision", "no") or "no")
    return precision if precision in ("bf16", "fp16") and not getattr(trainer, "is_deepspeed_enabled", False) else None


def _decode(tokenizer: Any, ids: list[int]) -> str | None:
    if tokenizer is None or not hasattr(tokenizer, "decode"):
        return None
    try:
        return str(tokenizer.decode(ids, skip_special_tokens=False))[:MAX_TEXT_CHARS]
    except Exception:  # noqa: BLE001 - an odd tokenizer must not lose the capture
        return None


def _samples(
    batch: dict[str, Any], micro: int, losses: torch.Tensor | None, tokenizer: Any, norms: torch.Tensor | None = None,
    masked_lm: bool = False,
) -> list[dict[str, Any]]:
    ids = batch.get("input_ids")
    if not torch.is_tensor(ids) or ids.dim() != 2:
        return []
    mask = batch.get("attention_mask")
    labels = batch.get("labels")
    hashes = content_hashes(batch, masked_lm)  # as in the ledger
    given = sample_ids(batch)
    indices = dataset_indices(batch)
    if indices is not None and len(indices) != ids.shape[0]:
        indices = None
    loss_list = losses.tolist() if losses is not None else None
    norm_list = norms.tolist() if norms is not None and len(norms) == ids.shape[0] else None
    rows = ids.tolist()
    keep = mask.bool().tolist() if torch.is_tensor(mask) and mask.shape == ids.shape else None
    out = []
    for r, row in enumerate(rows):
        tokens = row if keep is None else [t for t, k in zip(row, keep[r]) if k]
        text = _decode(tokenizer, tokens)
        labelled = int((labels[r] != IGNORE_INDEX).sum()) if torch.is_tensor(labels) and labels.shape == ids.shape else None
        record: dict[str, Any] = {
            "micro_batch": micro,
            "row": r,
            "sample_id": given[r] if given is not None and r < len(given) else (indices[r] if indices is not None else None),
            "sample_id_source": "column" if given is not None and r < len(given) else ("dataset index" if indices is not None else None),
            "dataset_index": indices[r] if indices is not None else None,
            "hash": hashes[r],
            "loss": json_float(loss_list[r]) if loss_list is not None and labelled != 0 else None,
            "grad_norm": json_float(norm_list[r]) if norm_list is not None and labelled != 0 else None,
            **text_heuristics(tokens, text),
            "labelled_tokens": labelled,
            "text": text,
            "input_ids": row,
        }
        out.append(record)
    return out


def _write_atomic(path: Path, text: str) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(text, encoding="utf-8")
    os.replace(tmp, path)


def write_capture(
    ctx: Any,
    *,
    step: int,
    code: str,
    reason: str,
    micro_batches: list[tuple[int, dict[str, Any], float | None]],
    context: dict[str, Any] | None = None,
    no_recompute: str | None = None,
) -> CaptureResult:
    """Write ``captures/step-<step>/`` for this rank and return the ranked suspects.

    ``micro_batches`` holds (micro-batch index, batch, loss the Trainer saw).
    ``context`` is merged into the JSON (loss and grad-norm history, resume
    information). The per-sample losses are recomputed on the model as it is
    now, so call this before the optimizer updates it; ``no_recompute`` says
    why not to (written into the capture instead).
    """
    trainer = getattr(ctx, "trainer", None)
    model = getattr(trainer, "model", None)
    tokenizer = getattr(trainer, "processing_class", None) or getattr(trainer, "tokenizer", None)
    tokenizer = getattr(tokenizer, "tokenizer", tokenizer)  # a processor wraps its tokenizer
    directory = ctx.path("captures", f"step-{step}", "x").parent
    why_not = no_recompute or can_recompute(trainer)
    rng = _rng_state()
    batches = [b for _, b, _ in micro_batches]
    losses: list[torch.Tensor | None] = [None] * len(batches)
    if why_not is None and model is not None:
        try:
            losses = recompute_losses(model, batches, rng)
        except Exception as exc:  # noqa: BLE001 - the capture is still worth writing without losses
            why_not = f"forward pass failed: {type(exc).__name__}: {exc}"
            log.warning("harness capture: %s", why_not)
    recomputed = why_not is None and any(loss is not None for loss in losses)
    if recomputed:  # per-sample gradient norms: one backward per row, p.grad untouched (harness.lib.sample_grads)
        blame = blame_rows(model, [lm_inputs(b) for b in batches], rng)
    else:
        blame = Blame("unavailable", [None] * len(batches), why_not or "not a causal-LM batch")
    samples = [s for (micro, batch, _), loss, norms in zip(micro_batches, losses, blame.norms)
               for s in _samples(batch, micro, loss, tokenizer, norms, bool(getattr(ctx, "masked_lm", False)))]
    samples = rank_suspects(samples)
    output_dir = getattr(getattr(trainer, "args", None), "output_dir", None)
    param = next(iter(model.parameters()), None) if model is not None else None
    config = getattr(model, "config", None)
    meta: dict[str, Any] = {
        "code": code,
        "step": step,
        "rank": ctx.rank,
        "reason": reason,
        "directory": str(Path(directory).absolute()),  # absolute: a relative path means nothing from another directory
        "output_dir": str(Path(output_dir).absolute()) if output_dir else None,
        "weights_from_step": step - 1,
        "per_sample_loss": "recomputed on the weights of the step, before its update" if recomputed else f"not recomputed ({why_not or 'not a causal-LM batch'})",
        "model": {
            "class": type(model).__name__ if model is not None else None,
            "dtype": str(param.dtype).replace("torch.", "") if param is not None else None,
            "attn_implementation": getattr(config, "_attn_implementation", None),
            "training_mode": bool(getattr(model, "training", True)),
            "device_type": param.device.type if param is not None else None,
            "autocast": autocast_dtype(trainer),
        },
        "tokenizer": getattr(tokenizer, "name_or_path", None),
        "micro_batches": [
            {"micro_batch": micro, "trainer_loss": json_float(seen), "keys": sorted(k for k, v in b.items() if torch.is_tensor(v))}
            for micro, b, seen in micro_batches
        ],
        "dataset_index": dataset_index_note(batches),
        "blame": blame.record(),
        **(context or {}),
        "samples": samples,
    }
    tensors = [{k: v.detach().cpu() for k, v in b.items() if torch.is_tensor(v)} for b in batches]
    torch.save(
        {"micro_batches": tensors, "micro_batch_index": [m for m, _, _ in micro_batches], "rng": rng,
         "losses": [loss.cpu() if loss is not None else None for loss in losses]},
        directory / f"batch.rank-{ctx.rank}.pt",
    )
    json_path = directory / f"capture.rank-{ctx.rank}.json"
    _write_atomic(json_path, dumps(meta, indent=1, default=str))  # strict JSON: non-finite numbers as "nan", "inf"
    _write_atomic(directory / f"summary.rank-{ctx.rank}.md", _markdown(meta, samples))
    keys = ("micro_batch", "row", "sample_id", "sample_id_source", "dataset_index", "hash", "grad_norm", "loss", "repetition", "length_tokens")
    suspects = [{k: s[k] for k in keys} for s in samples[:5]]
    return CaptureResult(directory, json_path, suspects, recomputed)
