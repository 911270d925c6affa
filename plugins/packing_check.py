"""packing_check: measures whether packed documents can see each other, on the run's own model and batches.

Packing several documents into one row is only sound if attention (and the
loss) stop at document boundaries. Whether they do depends on the attention
implementation, the mask form the collator produces, the KV-cache setting
and the library version, and a mistake raises no error: the loss simply
looks good because the model may read the previous document. So instead of
trusting a table of known combinations this plugin runs an experiment: at
the first step and every ``every`` steps it takes a packed row from the real
batch, changes the tokens of its first document, runs the model twice
without gradients (the same inputs otherwise, dropout off) and checks that
the outputs (last hidden states, which the logits are a per-token function
of) of the row's other documents did not move.

Document boundaries come from the collator's metadata (``doc_ids``,
``seq_idx``), else from restarting ``position_ids``, else from the blocks
of a 4D attention mask (or, with ``boundaries: eos``, from EOS/BOS tokens).
A batch with no packing information at all claims no separation (GPT-style
concatenation is a choice) and is not checked. The same look at the batch also finds labels on padding and labels
that make the first token of a document a prediction target of the previous
one (``PACKING_LOSS_ON_PADDING``).

What is compared is the per-token output of the part of the model that reads
the packed row: the decoder's last hidden states of a decoder-only model (GPT-2,
Llama, Qwen, Gemma), the encoder's of an encoder (BERT) or of an
encoder-decoder (T5: the packed row is the encoder's input; the decoder reads
the labels). Where the experiment cannot run (sharded parameters, a forward
pass that fails on one row, outputs that are not per token) a packed batch
gets ``PACKING_CHECK_SKIPPED`` (information) once, with the reason, instead of
a silent skip.
"""
from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Literal

import torch
from pydantic import BaseModel, ConfigDict, Field

from harness.core.appendfile import shared_appender
from harness.lib.capture import autocast_dtype, can_recompute
from harness.core.findings import FindingCode, Severity
from harness.core.hookspecs import hookimpl
from harness.core.plugin import Plugin
from harness.core.strictjson import dumps

PACKING_CROSS_DOC_ATTENTION = FindingCode(
    "PACKING_CROSS_DOC_ATTENTION",
    Severity.ERROR,
    "In packed rows, changing one document changes the model's output on another: attention crosses document boundaries.",
    "packing#packing_cross_doc_attention",
)
PACKING_LOSS_ON_PADDING = FindingCode(
    "PACKING_LOSS_ON_PADDING",
    Severity.WARNING,
    "Labels train the model on padding, or on predicting a document's first token from the previous document.",
    "packing#packing_loss_on_padding",
)
PACKING_CHECK_SKIPPED = FindingCode(
    "PACKING_CHECK_SKIPPED",
    Severity.INFO,
    "Packed rows were seen but the cross-document experiment could not run on this model or setup; the finding says why.",
    "packing#packing_check_skipped",
)
IGNORE_INDEX = -100
METADATA_KEYS = ("doc_ids", "seq_idx", "document_ids")
SEARCH_BATCHES = 8
LOSS_KEYS = ("labels", "num_items_in_batch")


class PackingCheckOptions(BaseModel):
    """Options of the ``packing_check`` plugin."""

    model_config = ConfigDict(extra="forbid")

    every: int = Field(
        500, ge=1, description="Check at step 1 and every this many steps: two extra forward passes of one row, without gradients."
    )
    boundaries: Literal["auto", "metadata", "position_ids", "mask", "eos"] = Field(
        "auto", description="Where document boundaries come from. auto: collator metadata (doc_ids/seq_idx), else "
        "restarting position_ids, else the blocks of a 4D attention mask; a batch with none of these claims no separation "
        "(GPT-style concatenation) and is not checked. eos: split at EOS/BOS tokens (for models that build their own "
        "document mask from them; in chat data an end-of-turn EOS splits turns of one conversation).",
    )
    tolerance: float | None = Field(
        None, gt=0, description="Largest change of another document's outputs (relative to their largest magnitude) that is "
        "not a leak; default 1e-3, or 2e-2 when the model runs under bf16/fp16 autocast.",
    )
    check_labels: bool = Field(True, description="Also report PACKING_LOSS_ON_PADDING from the batch's labels.")
    max_reports: int = Field(3, ge=1, description="Findings per code per run at most.")


def _runs(valid: list[bool], starts: list[bool]) -> list[tuple[int, int]]:
    """Documents as [start, end) runs of valid positions; ``starts[t]`` says a new document begins at t."""
    out: list[tuple[int, int]] = []
    start = None
    for t, ok in enumerate(valid):
        if start is not None and (not ok or starts[t]):
            out.append((start, t))
            start = None
        if start is None and ok:
            start = t
    if start is not None:
        out.append((start, len(valid)))
    return out


def _segments_from_ids(values: list[int], valid: list[bool]) -> list[tuple[int, int]]:
    """Runs of equal ids (metadata); negative ids are padding."""
    return _runs([ok and v >= 0 for v, ok in zip(values, valid)], [t > 0 and v != values[t - 1] for t, v in enumerate(values)])


def _segments_from_positions(positions: list[int], valid: list[bool]) -> list[tuple[int, int]]:
    """A document starts wherever position ids do not continue by one."""
    return _runs(valid, [t > 0 and p != positions[t - 1] + 1 for t, p in enumerate(positions)])


def _segments_from_tokens(ids: list[int], valid: list[bool], eos: int | None, bos: int | None) -> list[tuple[int, int]]:
    """A document ends after each EOS and starts at each BOS."""
    return _runs(valid, [t > 0 and ((bos is not None and tok == bos) or (eos is not None and ids[t - 1] == eos)) for t, tok in enumerate(ids)])


def _segments_from_mask(diagonal: list[bool], below: list[bool]) -> list[tuple[int, int]]:
    """Blocks of a [L, L] attention mask, from its diagonal and the one below: a block starts where a token may not see the token before it."""
    return _runs(diagonal, [True, *(not seen for seen in below)])


def _mask_form(batch: Mapping[str, Any]) -> str:
    mask, positions = batch.get("attention_mask"), batch.get("position_ids")
    pos = " + position_ids" if torch.is_tensor(positions) else ""
    if not torch.is_tensor(mask):
        return "position_ids only (no attention_mask)" if pos else "no attention_mask, no position_ids"
    if mask.dim() == 4:
        return f"4D {'boolean' if mask.dtype == torch.bool else str(mask.dtype).replace('torch.', '')} mask{pos}"
    return f"2D attention_mask{pos}"


def _reader(model: Any) -> tuple[Any, str]:
    """The module whose per-token last hidden states the experiment compares, and its name: the encoder of an
    encoder-decoder (it reads the packed row; the decoder reads the labels), else the decoder (the base model of an
    encoder such as BERT); the model itself (its logits) when neither answers."""
    if getattr(getattr(model, "config", None), "is_encoder_decoder", False) and hasattr(model, "get_encoder"):
        encoder = model.get_encoder()
        return encoder, f"{type(encoder).__name__} (the encoder)"
    decoder = model.get_decoder() if hasattr(model, "get_decoder") else None
    if decoder is not None and decoder is not model:
        return decoder, type(decoder).__name__
    return model, f"{type(model).__name__} (logits)"


def _outputs(model: Any, inputs: dict[str, Any]) -> tuple[torch.Tensor, str]:
    """The last hidden states of one row (hidden size, not vocabulary size, per token), and what gave them; logits when no
    decoder answers."""
    reader, name = _reader(model)
    if name.endswith("(the encoder)"):
        return reader(**{k: v for k, v in inputs.items() if not k.startswith("decoder_")}).last_hidden_state[0], name
    if reader is not model:
        try:
            return reader(**inputs).last_hidden_state[0], name
        except TypeError:  # an input the decoder does not take (the head consumes it): run the whole model
            pass
    output = model(**inputs)  # a ModelOutput, or a user model's dict
    return (output["logits"] if isinstance(output, Mapping) else output.logits)[0], f"{type(model).__name__} (logits)"


def _twice(model: Any, inputs: dict[str, Any], changed: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, str]:
    """Outputs on the row as it is and with document 1 changed, and what gave them: no gradients, dropout off, every
    module's mode restored."""
    modes = {module: module.training for module in model.modules()}
    model.eval()
    try:
        with torch.no_grad():
            (before, measured), (after, _) = _outputs(model, inputs), _outputs(model, {**inputs, "input_ids": changed})
            return before, after, measured
    finally:
        for module, training in modes.items():
            module.training = training


@dataclass
class _Looked:
    """A micro-batch queued for analysis at its step's guard: the device batch (kept by reference) and what was deferred."""

    step: int
    scheduled: bool  # the check step's first micro-batch: its labels are checked too
    batch: Mapping[str, Any]
    source: str
    reads: dict[str, torch.Tensor]  # name -> device tensor deferred under "batch/<n>/<name>"
    index: int


@dataclass
class _Host:
    """The host values of one looked-at micro-batch (from the step's one read)."""

    ids: list[list[int]]
    valid: list[list[bool]] | None  # a 2D attention mask, as booleans
    labelled: list[list[bool]] | None  # labels != -100, when labels have the batch's shape
    boundary: list[list[int]] | None  # metadata ids or position ids
    diag: list[list[bool]] | None = None  # a 4D mask's diagonal and sub-diagonal (the blocks it draws)
    sub: list[list[bool]] | None = None


class PackingCheck(Plugin):
    """Perturbs one document of a packed row and measures how much the others move; checks labels at boundaries.

    On check steps (step 1 and every ``every`` steps) it defers the batch's
    ids, masks and labels to the step guard's one read, finds documents and
    checks labels on the host in ``on_before_optimizer_step``, and runs its
    experiment at step end (outside the backward pass, where DeepSpeed runs
    the guard); other steps cost nothing.
    """

    name = "packing_check"
    Options = PackingCheckOptions
    CODES = (PACKING_CROSS_DOC_ATTENTION, PACKING_LOSS_ON_PADDING, PACKING_CHECK_SKIPPED)

    def __init__(self) -> None:
        self.options = PackingCheckOptions()
        self._unable: str | None = None
        self._due = 0  # micro-batches left to find a packed row in
        self._reported: set[tuple[str, str]] = set()
        self._looked: list[_Looked] = []  # micro-batches deferred this step, analysed at its guard
        self._looks = 0
        self._experiment: tuple[_Looked, int, list[tuple[int, int]], list[int]] | None = None  # (batch, row, documents, row ids)
        self.results: list[dict[str, Any]] = []

    @hookimpl
    def on_run_start(self, ctx: Any, trainer: Any) -> None:
        self._unable = can_recompute(trainer)
        self._looked, self._experiment = [], None
        self.idle_hooks("on_before_optimizer_step", "on_step_end", idle=False)

    @hookimpl
    def inspect_batch(self, ctx: Any, batch: Any, step: int, micro_step: int) -> None:
        self._run_experiment(ctx)  # one found at a guard whose step end did not come (it normally ran there)
        scheduled = micro_step == 0 and (step == 1 or step % self.options.every == 0)
        if scheduled:
            self._due = SEARCH_BATCHES  # a due experiment takes the first of the next micro-batches that has a packed row
        if not self._due or not isinstance(batch, Mapping):
            return
        self._due -= 1
        ids = batch.get("input_ids")
        if not torch.is_tensor(ids) or ids.dim() != 2:
            return
        source = self._source(batch)
        labels_due = scheduled and self.options.check_labels
        if self._unable is not None or source == "none":  # nothing to measure on, or no packing in this run's batches
            self._due = 0
            if self._unable is not None and source != "none":
                self._skipped(step, self._unable, source)
            if not labels_due:
                return
        self._defer_batch(batch, step, scheduled, source)

    @hookimpl
    def on_before_optimizer_step(self, ctx: Any, step: int, model: Any, optimizer: Any, grad_norm: Any, loss: Any) -> None:
        self._analyse(ctx)

    @hookimpl
    def on_step_end(self, ctx: Any, step: int, metrics: dict[str, Any]) -> None:
        self._analyse(ctx)  # a step whose optimizer never ran: the step end read the deferred values
        self._run_experiment(ctx)
        if not self._looked and self._experiment is None:
            self.idle_hooks("on_before_optimizer_step", "on_step_end")  # nothing queued until the next scheduled look

    # -- the step's one read and the host-side analysis ----------------------------------------------------

    def _defer_batch(self, batch: Mapping[str, Any], step: int, scheduled: bool, source: str) -> None:
        ids = batch["input_ids"]
        reads: dict[str, torch.Tensor] = {"ids": ids}
        mask, labels = batch.get("attention_mask"), batch.get("labels")
        if torch.is_tensor(mask) and mask.dim() == 2:
            reads["valid"] = mask.bool()
        if torch.is_tensor(labels) and labels.shape == ids.shape:
            reads["labelled"] = labels.ne(IGNORE_INDEX)
        if source in METADATA_KEYS:
            reads["boundary"] = batch[source]
        elif source == "position_ids":
            reads["boundary"] = batch["position_ids"].expand_as(ids)
        elif source == "4D mask":
            assert torch.is_tensor(mask)
            allowed = (mask if mask.dtype == torch.bool else mask > torch.finfo(mask.dtype).min / 2)[:, 0]
            reads["diag"], reads["sub"] = allowed.diagonal(dim1=-2, dim2=-1), allowed.diagonal(-1, dim1=-2, dim2=-1)
        look = _Looked(step, scheduled, batch, source, reads, self._looks)
        self._looks += 1
        for name, tensor in reads.items():
            self.defer(f"batch/{look.index}/{name}", tensor)
        self._looked.append(look)
        self.idle_hooks("on_before_optimizer_step", "on_step_end", idle=False)  # analysed at the guard, measured at step end

    def _host(self, look: _Looked) -> _Host:
        values: dict[str, Any] = {}
        for name, tensor in look.reads.items():
            got = self.deferred(f"batch/{look.index}/{name}")
            values[name] = got[0] if got else tensor.tolist()  # no guard read it (hooks called by hand): read it here
        return _Host(values["ids"], values.get("valid"), values.get("labelled"), values.get("boundary"), values.get("diag"), values.get("sub"))

    def _analyse(self, ctx: Any) -> None:
        """Documents and labels of the micro-batches deferred this step, on host data; the first packed row is measured at step end."""
        looked, self._looked = self._looked, []
        for look in looked:
            host = self._host(look)
            rows = self._documents(ctx, look.source, host)
            if look.scheduled and self.options.check_labels:
                self._check_labels(ctx, look.step, look.batch, host, rows, look.source)
            if self._unable is not None or look.source == "none" or self._experiment is not None:
                continue
            row = next((r for r, docs in enumerate(rows) if len(self._real(host, r, docs)) >= 2), None)
            if row is not None:
                self._due = 0
                self._experiment = (look, row, self._real(host, row, rows[row]), host.ids[row])

    def _run_experiment(self, ctx: Any) -> None:
        if self._experiment is not None:
            look, row, real, ids = self._experiment
            self._experiment = None
            self._measure(ctx, look.step, look.batch, row, real, ids, look.source)

    # -- where documents are ----------------------------------------------------------------------------------

    def _special_ids(self, ctx: Any) -> tuple[int | None, int | None, int | None]:
        tokenizer = getattr(ctx.trainer, "processing_class", None)
        tokenizer = getattr(tokenizer, "tokenizer", tokenizer)  # processors wrap one
        config = getattr(getattr(ctx.trainer, "model", None), "config", None)

        def pick(name: str) -> int | None:
            for source in (tokenizer, config):
                value = getattr(source, name, None)
                if isinstance(value, int):
                    return value
            return None

        return pick("eos_token_id"), pick("bos_token_id"), pick("pad_token_id")

    def _source(self, batch: Mapping[str, Any]) -> str:
        """Where this batch's document boundaries come from (shapes only: no device read)."""
        ids, mask, positions = batch["input_ids"], batch.get("attention_mask"), batch.get("position_ids")
        wanted = self.options.boundaries
        metadata = next((k for k in METADATA_KEYS if torch.is_tensor(batch.get(k)) and batch[k].shape == ids.shape), None)
        if wanted in ("auto", "metadata") and metadata is not None:
            return metadata
        if wanted in ("auto", "position_ids") and torch.is_tensor(positions) and positions.dim() == 2:
            return "position_ids"
        if wanted in ("auto", "mask") and torch.is_tensor(mask) and mask.dim() == 4:  # the blocks the mask itself draws
            return "4D mask"
        if wanted == "eos":
            return "eos"
        return "none"  # no packing information: documents (if any) are concatenated on purpose (GPT-style), or this is not packing

    def _documents(self, ctx: Any, source: str, host: _Host) -> list[list[tuple[int, int]]]:
        ids = host.ids
        valid = host.valid if host.valid is not None else [[True] * len(r) for r in ids]
        if source in METADATA_KEYS and host.boundary is not None:
            return [_segments_from_ids(v, ok) for v, ok in zip(host.boundary, valid)]
        if source == "position_ids" and host.boundary is not None:
            return [_segments_from_positions(p, ok) for p, ok in zip(host.boundary, valid)]
        if source == "4D mask" and host.diag is not None and host.sub is not None:
            blocks = len(host.diag)
            return [_segments_from_mask(host.diag[r if blocks > 1 else 0], host.sub[r if blocks > 1 else 0]) for r in range(len(ids))]
        if source == "eos":
            eos, bos, _ = self._special_ids(ctx)
            return [_segments_from_tokens(r, ok, eos, bos) for r, ok in zip(ids, valid)]
        return [[] for _ in ids]

    @staticmethod
    def _real(host: _Host, row: int, docs: list[tuple[int, int]]) -> list[tuple[int, int]]:
        """Documents with something to learn: a labelled token (or, without labels, at least two tokens)."""
        if host.labelled is not None:
            labelled = host.labelled[row]
            return [(s, e) for s, e in docs if any(labelled[s:e])]
        return [(s, e) for s, e in docs if e - s >= 2]

    # -- the experiment ----------------------------------------------------------------------------------------

    def _measure(
        self, ctx: Any, step: int, batch: Mapping[str, Any], row: int, real: list[tuple[int, int]], ids: list[int], source: str
    ) -> None:
        """The experiment on the kept device batch's row (its own reads are allowed: check steps of packed runs only)."""
        if len(real) < 2:
            return
        model = ctx.trainer.model
        eos, bos, pad = self._special_ids(ctx)
        specials = {t for t in (eos, bos, pad) if t is not None}
        size = batch["input_ids"].shape[0]
        inputs = {  # what the training forward gets, for this row alone (tensors shared by the batch stay whole)
            k: (v[row : row + 1] if torch.is_tensor(v) and v.dim() >= 1 and v.shape[0] == size and size > 1 else v)
            for k, v in batch.items() if k not in LOSS_KEYS
        }
        first_start, first_end = real[0]
        changed = inputs["input_ids"].clone()
        vocab = int(getattr(getattr(model, "config", None), "vocab_size", 0) or max(ids) + 1)
        for t in range(first_start, first_end):
            token = ids[t]
            if token in specials:
                continue
            for shift in (7, 11, 13, 17):
                candidate = (token + shift) % vocab
                if candidate not in specials:
                    changed[0, t] = candidate
                    break
        if torch.equal(changed, inputs["input_ids"]):
            return
        try:
            before, after, measured = _twice(model, inputs, changed)
        except Exception as exc:  # noqa: BLE001 - a model that cannot rerun one packed row: said once, not a plugin crash
            self._unable = f"the forward pass of one packed row failed ({type(exc).__name__}: {str(exc)[:200]})"
            self._skipped(step, self._unable, source)
            return
        if before.dim() < 2 or before.shape[0] != len(ids):
            self._unable = (f"{type(model).__name__} gives outputs of shape {list(before.shape)} for a row of {len(ids)} tokens, "
                            "not one per token")
            self._skipped(step, self._unable, source)
            return
        others = real[1:]
        own = (after[first_start:first_end] - before[first_start:first_end]).abs().max().item()
        scale = max(max(before[s:e].abs().max().item() for s, e in others), 1e-12)
        changes = [(after[s:e] - before[s:e]).abs().max().item() for s, e in others]
        del before, after
        leak_abs = max(changes)
        leak = leak_abs / scale
        tolerance = self.options.tolerance or (2e-2 if autocast_dtype(ctx.trainer) else 1e-3)
        per_doc = [round(c / scale, 6) for c in changes]
        impl = str(getattr(getattr(model, "config", None), "_attn_implementation", None))
        form = _mask_form(batch)
        verdict = "inconclusive" if own <= tolerance * scale else ("leak" if leak > tolerance else "separate")
        result = {"step": step, "rank": ctx.rank, "row": row, "documents": len(real), "boundaries": source, "mask_form": form,
                  "attn_implementation": impl, "measured": measured, "leak": leak, "leak_abs": leak_abs, "perturbed_document_change": own,
                  "tolerance": tolerance, "verdict": verdict, "per_document_leak": per_doc}
        self.results.append(result)
        if ctx.is_main:
            # strict JSON: a NaN leak (NaN logits) as "nan"; a full disk holds the line (never raises)
            shared_appender(ctx.path("packing_check.jsonl")).write(dumps(result) + "\n")
        if verdict != "leak" or (form, impl) in self._reported:
            return
        self._reported.add((form, impl))
        leaking = sum(1 for d in per_doc if d > tolerance)
        self.report(
            PACKING_CROSS_DOC_ATTENTION.code,
            f"changing document 1 of packed row {row} at step {step} (rank {ctx.rank}) moved the outputs of {leaking} of the "
            f"{len(per_doc)} later documents by up to {leak:.3g} of their magnitude ({leak_abs:.3g} absolute; tolerance {tolerance:g}): "
            f"with attn_implementation='{impl}' and {form}, tokens attend across document boundaries (boundaries from {source}).",
            step=step, evidence=result, limit=self.options.max_reports,
        )

    def _skipped(self, step: int, why: str, source: str) -> None:
        """Once per run, from rank 0 (every rank skips alike): packed rows were seen and not measured, and why."""
        if not getattr(self.ctx, "is_main", True):
            return
        self.report(
            PACKING_CHECK_SKIPPED.code,
            f"packed rows at step {step} (boundaries from {source}) were not checked for cross-document attention: {why}. "
            "The labels are still checked. Fix: see the playbook for measuring it another way (one process holding the whole "
            "model, or the model's own forward on a packed row).",
            step=step, evidence={"why": why, "boundaries": source}, limit=1,
        )

    # -- labels at padding and at boundaries ---------------------------------------------------------------------

    def _check_labels(
        self, ctx: Any, step: int, batch: Mapping[str, Any], host: _Host, rows: list[list[tuple[int, int]]], source: str
    ) -> None:
        labelled = host.labelled
        if labelled is None:
            return
        if host.valid is not None and not all(all(r) for r in host.valid):
            padding = [[not ok for ok in r] for r in host.valid]
        else:  # no mask, or an all-ones one (a padding collator's): the pad-token tail is the padding
            padding = self._pad_tail(ctx, host.ids)
        on_padding = sum(lab and pad for lr, pr in zip(labelled, padding) for lab, pad in zip(lr, pr))
        crossing: list[tuple[int, int]] = []
        if source in (*METADATA_KEYS, "position_ids"):  # declared boundaries: a document's first token has no context to come from
            for r, docs in enumerate(rows):
                crossing += [(r, s) for s, _ in docs if s > 0 and labelled[r][s]]
        if not on_padding and not crossing:
            return
        parts = []
        if on_padding:
            parts.append(f"{on_padding} labelled padding positions (loss on tokens that are not text)")
        if crossing:
            parts.append(f"{len(crossing)} document starts whose first token is a label, predicted from the previous document's last token")
        self.report(
            PACKING_LOSS_ON_PADDING.code,
            f"the labels at step {step} (rank {ctx.rank}) include " + " and ".join(parts) + f" (boundaries from {source}).",
            step=step,
            evidence={"labelled_padding": on_padding, "boundary_labels": len(crossing), "examples": [list(c) for c in crossing[:10]],
                      "boundaries": source, "mask_form": _mask_form(batch)},
            limit=self.options.max_reports,
        )

    def _pad_tail(self, ctx: Any, ids: list[list[int]]) -> list[list[bool]]:
        """Without an attention mask: the run of pad tokens at the end of each row (the first one kept when pad is EOS)."""
        eos, _, pad = self._special_ids(ctx)
        if pad is None:
            return [[False] * len(row) for row in ids]
        out = []
        for row in ids:
            t = len(row)
            while t > 0 and row[t - 1] == pad:
                t -= 1
            if pad == eos and t < len(row):
                t += 1  # the document's own EOS
            out.append([False] * t + [True] * (len(row) - t))
        return out

    @hookimpl
    def report_sections(self, run: Any) -> Any:
        """The packing experiments of ``packing_check.jsonl``, one row each."""
        from harness.report.model import ReportSection, md_table
        from harness.report.record import REPORT_SAMPLE_BYTES, read_jsonl

        experiments = list(read_jsonl(run.run_dir / "packing_check.jsonl", sample_bytes=REPORT_SAMPLE_BYTES))
        if not experiments:
            return None
        leaks = sum(1 for e in experiments if e.get("verdict") == "leak")
        text = (f"{len(experiments)} experiment(s) changed one document of a packed row and measured the others: "
                f"{leaks} leaked across documents. Details in [packing_check.jsonl](packing_check.jsonl).\n\n")
        rows = [[e.get("step"), e.get("rank"), e.get("documents"), e.get("attn_implementation"), e.get("mask_form"),
                 e.get("boundaries"), e.get("leak"), e.get("verdict")] for e in experiments[:30]]
        text += md_table(["step", "rank", "documents", "attention", "mask form", "boundaries from", "leak (relative)", "verdict"], rows)
        return ReportSection("Packing experiments (packing_check)", text + "\n")


__all__ = ["PackingCheck", "PackingCheckOptions"]
