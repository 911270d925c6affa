"""The contamination plugin's hooks: index at run start, look batches up in the background, agree, report, summarise."""
from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import Any

import torch

from harness.core.findings import read_run_findings
from harness.core.hookspecs import hookimpl
from harness.core.plugin import Plugin
from harness.lib.capture import sample_ids
from harness.lib.documents import ScanError
from harness.lib.hashing import dataset_hashes, sample_tokens
from harness.lib.ngrams import EvalExample, NgramIndex
from harness.lib.overlap import FrontEnd, ScanOptions, Tally, eval_chars_per_unit, judge, scaled_to_text
from harness.lib.overlap_ledger import LANES, ROW_END, ROW_START, Bits, MatchLedger, example_keys, lane_of, tally_from_bits
from harness.lib.span_bounds import RowShape, may_be_dirty

from .checker import Checker, Found, Job, JobBuffer
from .options import CONTAMINATION, CONTAMINATION_SUMMARY, CONTAMINATION_UNCHECKED, EVAL_SPLIT_OVERLAP, ContaminationOptions
from .sightings import Sighting, finding, remember
from .sources import configured_examples, eval_set_names, trainer_eval_examples
from .state import restore, state_of
from .summary import console_line, report_section, span_counts, summary_message, write_summary

log = logging.getLogger("harness.contamination")

RUN_END_WAIT_S = 60.0  # run end waits this long at most for the checker to finish the queue
LAST_STEP_WAIT_S = 60.0  # the last step's guard waits this long at most for the checker, so its matches are agreed
EXCHANGE_INTS = 3 * 64  # the slot in the step exchange: 64 (key, chunk, bits) triples; more wait for the next step
SLOT = "matched"


def _all_set(bits: int, lo: int, hi: int) -> bool:
    """Whether bits ``lo`` .. ``hi - 1`` are all set (an empty range: False)."""
    mask = (1 << (hi - lo)) - 1 if hi > lo else 0
    return bool(mask) and (bits >> lo) & mask == mask


class Contamination(Plugin):
    """Indexes the eval sets, checks training micro-batches in a background thread, agrees and reports dirty examples."""

    name = "contamination"
    Options = ContaminationOptions
    CODES = (CONTAMINATION, CONTAMINATION_SUMMARY, EVAL_SPLIT_OVERLAP, CONTAMINATION_UNCHECKED)

    def __init__(self) -> None:
        self.options = ContaminationOptions()
        self.index: NgramIndex | None = None
        self.checker: Checker | None = None
        self._buffer: JobBuffer | None = None
        self.ledger: MatchLedger | None = None
        self._tallies: dict[int, Tally] = {}  # this rank's training rows per example (documents and locations)
        self._sightings: dict[int, list[Sighting]] = {}
        self._micro_batches = 0
        self._train_hashes: set[int] | None = None
        self._tokenizer: Any = None
        self._worker_error_reported = False
        self._shared = False  # this run agrees over ranks through the step exchange (else: alone, at step end)
        self._exchanged: int | None = None  # the step whose guard carried this plugin's slot
        self._max_steps = 0
        self._shapes: dict[tuple[int, int], RowShape] = {}  # (example, variant) -> what the bounds on its matches need
        self._verdicts: dict[int, tuple[Bits, dict[str, Any]]] = {}  # dirty verdicts of this settle, for their reports
        self._scaled: ScanOptions | None = None  # the options as this run judges by them, once the eval sets are indexed

    @property
    def checked_tokens(self) -> int:
        return self.checker.checked_tokens if self.checker is not None else 0

    # -- the index ------------------------------------------------------------------------------------------

    @hookimpl
    def on_run_start(self, ctx: Any, trainer: Any) -> None:
        self.index, self.checker, self.ledger, self._buffer = None, None, None, None  # a second train() call starts from nothing
        self._tallies, self._sightings, self._exchanged, self._worker_error_reported = {}, {}, None, False
        self._shapes, self._verdicts, self._scaled = {}, {}, None
        self._max_steps = int(getattr(getattr(trainer, "state", None), "max_steps", 0) or 0)
        watching = bool(self.options.eval_sets) or (self.options.trainer_eval and getattr(trainer, "eval_dataset", None) is not None)
        self._shared = ctx.world_size > 1 and watching
        self.idle_hooks("on_before_optimizer_step", idle=not self._shared)  # one process: agreed with itself at step end
        self.idle_hooks("inspect_batch", "on_step_end", idle=not watching)
        self.idle_hooks("on_loss")  # called only while a full group waits for its hand-over
        if self._shared:  # first, before anything that may fail on one rank only: the same slot on every rank
            ctx.reserve(SLOT, EXCHANGE_INTS, owner=self.name)
        tokenizer = getattr(trainer, "processing_class", None)
        self._tokenizer = getattr(tokenizer, "tokenizer", tokenizer)
        front = FrontEnd(self._tokenizer) if self._tokenizer is not None else None
        examples: list[EvalExample] = []
        for index, (spec, name) in enumerate(zip(self.options.eval_sets, eval_set_names(self.options.eval_sets))):
            try:
                examples += configured_examples(spec, front, name, index)
            except ScanError as exc:
                if ctx.is_main:
                    self.report(CONTAMINATION_UNCHECKED.code, f"contamination: {exc}".replace("harness scan: ", ""),
                                evidence={"eval_set": spec.path, "field": spec.field})
        if self.options.trainer_eval and getattr(trainer, "eval_dataset", None) is not None:
            examples += trainer_eval_examples(trainer.eval_dataset, self._tokenizer)
        if not examples:
            return
        self._scaled = self._scaled_options(ctx, examples)
        self.index = NgramIndex.build(examples, self._scaled.n, self.options.template_min_examples, self.options.min_length)
        self.ledger = MatchLedger(example_keys((e.eval_set, e.example_id) for e in examples))
        self.ledger.reported |= self._reported_before(ctx)
        self.checker = Checker(self.index)
        self._buffer = JobBuffer(self.checker)

    def _reported_before(self, ctx: Any) -> set[int]:
        """Examples an earlier attempt in this run directory already reported (its findings are on disk at once)."""
        assert self.index is not None
        names = {(str(f.evidence.get("eval_set")), str(f.evidence.get("example_id")))
                 for f in read_run_findings(ctx.run_dir) if f.code == CONTAMINATION.code}
        return {e for e, x in enumerate(self.index.examples) if (x.eval_set, x.example_id) in names} if names else set()

    @property
    def _judging(self) -> ScanOptions:
        """The thresholds this run judges by: ``n`` and ``dirty_span`` as scaled at run start, else as given."""
        return self._scaled if self._scaled is not None else self._given_options()

    def _given_options(self) -> ScanOptions:
        o = self.options
        return ScanOptions(n=o.n, template_min_examples=o.template_min_examples, dirty_fraction=o.dirty_fraction,
                           partial_fraction=o.partial_fraction, dirty_span=o.dirty_span, min_length=o.min_length,
                           scale_to_text=o.scale_to_text)

    def _scaled_options(self, ctx: Any, examples: list[EvalExample]) -> ScanOptions:
        """The options as given, or with ``n`` and ``dirty_span`` scaled to the eval text's characters per token (the
        same on every rank: measured on the same examples); said once on the console."""
        given = self._given_options()
        decode = getattr(self._tokenizer, "decode", None)
        scaled, scale = scaled_to_text(given, eval_chars_per_unit(examples, decode))
        if scale is not None and ctx.is_main:
            log.info("contamination: " + scale.line(given, scaled, "set contamination.scale_to_text: false in the harness config"))
        return scaled

    def _judge(self, example: int, bits: Bits) -> dict[str, Any]:
        assert self.index is not None
        return judge(self.index, example, tally_from_bits(bits, self._tallies.get(example)), self._judging)

    def _is_dirty(self, example: int, bits: Bits) -> bool:
        """judge's verdict, called only when cheap bounds on the bits say some variant may be dirty (no near duplicates
        online): a joined row's full verdict takes about 140 us, and most matched rows are far from dirty."""
        o = self._judging
        if not any(may_be_dirty(self._shape(example, variant), bits.get(lane_of(variant), 0), o.dirty_fraction, o.dirty_span,
                                bits.get(lane_of(variant, ROW_START), 0), bits.get(lane_of(variant, ROW_END), 0))
                   for variant in {lane // LANES for lane in bits}):
            return False
        verdict = self._judge(example, bits)
        if verdict["status"] != "dirty":
            return False
        self._verdicts[example] = (dict(bits), verdict)  # its report, next, judges the same bits: not twice
        return True

    def _verdict(self, example: int) -> dict[str, Any]:
        """judge's row for what this rank knows of the example; the one ``_is_dirty`` just made when the bits are the same."""
        assert self.ledger is not None
        bits = self.ledger.combined(example)
        judged = self._verdicts.pop(example, None)
        return judged[1] if judged is not None and judged[0] == bits else self._judge(example, bits)

    def _shape(self, example: int, variant: int) -> RowShape:
        """A variant's counted windows, line breaks and coverable units, as the bounds need them; once per variant."""
        assert self.index is not None
        key = (example, variant)
        shape = self._shapes.get(key)
        if shape is None:
            x = self.index.examples[example]
            units, cuts = x.variants[variant], x.cuts_of(variant)
            shape = self._shapes[key] = RowShape.of(len(units), min(self.index.n, len(units)), cuts)
        return shape

    # -- per micro-batch: a host copy, the lookup in the background ------------------------------------------------

    @hookimpl
    def inspect_batch(self, ctx: Any, batch: Any, step: int, micro_step: int) -> None:
        if self.checker is None or not isinstance(batch, Mapping):
            return
        ids = batch.get("input_ids")
        if not torch.is_tensor(ids) or ids.dim() != 2:
            return
        self._micro_batches += 1
        if (self._micro_batches - 1) % self.options.sample_every:
            return
        if self.checker.error is not None or self._worker_error_reported:  # a dead thread is found at the group's hand-over
            self._raise_worker_error()  # once: an INTERNAL_PLUGIN_ERROR with the worker's traceback; then nothing is queued
            return
        text = sample_tokens(batch, masked_lm=ctx.masked_lm)  # a masked-LM row: its text, not this pass's masks
        # token ids never carry autograd: no detach; a masked-LM row's text is a tensor of its own already, not copied again
        host = text.to("cpu", non_blocking=True) if text.is_cuda else text.clone() if text is ids else text
        ready = torch.cuda.Event() if ids.is_cuda else None
        if ready is not None:
            ready.record()
        assert self._buffer is not None
        self._buffer.add(Job(step, micro_step, ctx.rank, sample_ids(batch), host, ready))
        if self._buffer.full:
            self.idle_hooks("on_loss", idle=False)

    @hookimpl(trylast=True)
    def on_loss(self) -> None:
        """A full group goes to the checker here, as backward begins: the training thread then runs without the
        interpreter lock for a while, so the lookup does not hold up the training thread's Python. Last of the
        ``on_loss`` hooks: the woken checker wants the lock at once, and every hook after the hand-over would wait for it."""
        self.idle_hooks("on_loss")
        if self._buffer is not None and self._buffer.full and not self._buffer.flush():
            self._raise_worker_error()

    def _raise_worker_error(self) -> None:
        """Turn a dead worker into one exception on the training thread (the manager makes it an INTERNAL_PLUGIN_ERROR)."""
        if self._worker_error_reported:
            return
        self._worker_error_reported = True
        error = self.checker.error if self.checker is not None else None
        detail = f"{type(error).__name__}: {error}" if error is not None else "it stopped"
        raise RuntimeError(
            f"contamination: the background checker died ({detail}); training batches are no longer checked against the "
            f"eval sets after {self.checked_tokens} tokens. The run-end summary covers only those."
        ) from error

    def _drain(self) -> bool:
        """Take in what the checker found (on the training thread): this rank's matched windows and sightings.

        Returns whether there was anything (some micro-batch matched).
        """
        if self.checker is None:
            return False
        found = self.checker.found()
        for one in found:
            self._absorb(one)
        return bool(found)

    def _absorb(self, found: Found) -> None:
        assert self.ledger is not None
        job = found.job
        # one sighting per training row: an example's variants (its tokenisations with and without a leading space ...)
        # can match the same row; each variant's windows are counted apart, the row is one row
        groups: dict[tuple[int, int], dict[int, list[Any]]] = {}
        for hit in found.hits:
            groups.setdefault((hit.example, hit.row), {}).setdefault(hit.variant, []).append(hit)
            self._tallies.setdefault(hit.example, Tally()).add(hit, f"rank {job.rank} step {job.step} micro-batch {job.micro} row {hit.row}", "", 3)
        for (example, row), by_variant in groups.items():
            new = 0
            for variant, hits in by_variant.items():
                new = max(new, self.ledger.add(example, lane_of(variant), [h.offset for h in hits]))
                self._note_row_edges(example, variant, hits)
            if not new:
                continue  # nothing this rank had not seen of the example: not a sighting
            hits = [h for variant_hits in by_variant.values() for h in variant_hits]
            start, end = min(h.position for h in hits), max(h.position + h.length for h in hits)
            sample = job.ids[row] if job.ids is not None and row < len(job.ids) else None
            remember(self._sightings.setdefault(example, []),
                     Sighting(job.step, job.micro, job.rank, row, sample, start, new, found.rows[row, start:end].copy()))

    def _note_row_edges(self, example: int, variant: int, hits: list[Any]) -> None:
        """Record the matched windows that start or end their training row (where training may have cut a copied line),
        but not those whose ``n - 1`` windows before (a start) or after (an end) are all matched already: they change
        no span (``copied_spans`` fills those windows between a row's end and the next row's start, or the span goes on
        through them), and re-judging the row for them would cost the step end a verdict."""
        assert self.ledger is not None
        edges = [h for h in hits if h.row_start or h.row_end]
        if not edges:
            return  # the common case: a row's windows inside it (at most two of a row's windows touch its edges)
        matched = self.ledger.combined(example).get(lane_of(variant), 0)
        starts = [h.offset for h in edges if h.row_start and not _all_set(matched, max(h.offset - h.length + 1, 0), h.offset)]
        ends = [h.offset for h in edges if h.row_end and not _all_set(matched, h.offset + 1, h.offset + h.length)]
        if starts:
            self.ledger.add(example, lane_of(variant, ROW_START), starts)
        if ends:
            self.ledger.add(example, lane_of(variant, ROW_END), ends)

    # -- per step: agree over ranks which examples became dirty; the reporter reports -------------------------------

    @hookimpl
    def on_before_optimizer_step(self, ctx: Any, step: int) -> None:
        if not self._shared or self.ledger is None:
            return
        if self._max_steps and step >= self._max_steps:
            self._wait_for_checker()  # the last exchange: every batch trained is looked up and agreed before run end
        self._drain()
        values = self.ledger.outgoing(EXCHANGE_INTS)
        if values:
            ctx.share(SLOT, values, owner=self.name)
        self._exchanged = step

    @hookimpl
    def on_step_end(self, ctx: Any, step: int) -> None:
        if self.ledger is None:
            return
        if self._buffer is not None and self._buffer.full and not self._buffer.flush():
            self._raise_worker_error()  # a training_step that never calls compute_loss has no on_loss: flushed here
        if not self._shared:  # one process: agree with itself, when the checker brought something
            if self._max_steps and step >= self._max_steps:
                self._wait_for_checker()
            if self._drain():
                self._settle(ctx, [self.ledger.outgoing(None)])
            return
        self._drain()
        if self._exchanged == step:
            self._exchanged = None
            self._settle(ctx, ctx.shared(SLOT, owner=self.name) or [])

    def _wait_for_checker(self) -> None:
        if self._buffer is not None and self.checker is not None and self.checker.alive:
            self._buffer.flush(timeout=LAST_STEP_WAIT_S)
        if self.checker is not None and self.checker.alive and not self.checker.wait_idle(LAST_STEP_WAIT_S):
            log.warning("contamination: the background checker did not finish the last step's batches within %.0f s; "
                        "what it finds later is judged by this rank alone at run end.", LAST_STEP_WAIT_S)

    def _settle(self, ctx: Any, per_rank: list[Any]) -> None:
        assert self.ledger is not None
        dirty = self.ledger.agree(per_rank, self._is_dirty)
        self._report_most_copied_first([(d.example, d.ranks) for d in dirty if d.reporter == ctx.rank], agreed=True)
        self._verdicts.clear()

    def _report_most_copied_first(self, dirty: list[tuple[int, tuple[int, ...]]], agreed: bool) -> None:
        """Report the examples that became dirty together, the most copied first (judged share, then longest span):
        under ``max_reports`` the findings go to the worst of them. Rows that become dirty at later steps cannot be
        weighed against those already reported; the summary counts the dirty rows left without a finding."""
        judged = [(self._verdict(example), example, ranks) for example, ranks in dirty if self._sightings.get(example)]
        judged.sort(key=lambda item: (-item[0]["matched_fraction"], -item[0]["longest_span"], item[1]))
        for verdict, example, ranks in judged:
            self._report(example, ranks, agreed, verdict)

    def _report(self, example: int, ranks: tuple[int, ...], agreed: bool, verdict: dict[str, Any] | None = None) -> None:
        assert self.index is not None and self.ledger is not None
        kept = self._sightings.get(example)
        if not kept:
            return
        verdict = verdict if verdict is not None else self._verdict(example)
        message, step, evidence = finding(self.index.examples[example], verdict, self.index.n, kept, ranks, self._snippet,
                                          self._judging.dirty_span)
        evidence["agreed"] = agreed  # False: judged at run end on this rank's late matches alone (no exchange is left)
        self.report(CONTAMINATION.code, message, step=step, evidence=evidence, limit=self.options.max_reports)

    def _snippet(self, tokens: Any) -> str | None:
        if self._tokenizer is None:
            return None
        try:
            return str(self._tokenizer.decode(tokens.tolist()))[:200]
        except Exception:  # noqa: BLE001 - a snippet is a courtesy
            return None

    # -- checkpoints: the agreed windows go on with a resume --------------------------------------------------------

    @hookimpl
    def checkpoint_state(self, ctx: Any, step: int) -> dict[str, Any] | None:
        return state_of(self.index, self.ledger) if self.ledger is not None and self.index is not None else None

    @hookimpl
    def on_resume(self, ctx: Any, state: dict[str, Any] | None) -> None:
        if self.ledger is not None and self.index is not None and isinstance(state, dict):
            restore(self.index, self.ledger, state)

    # -- the Trainer's own split ------------------------------------------------------------------------------

    @hookimpl
    def inspect_dataset(self, ctx: Any, dataset: Any, split: str) -> None:
        if not self.options.check_split_overlap or not hasattr(dataset, "__len__") or len(dataset) > 200_000:
            return
        hashes = dataset_hashes(dataset, "input_ids", len(dataset))
        if hashes is None:
            return
        if split == "train":
            self._train_hashes = set(hashes)
            return
        if split != "eval" or self._train_hashes is None or not ctx.is_main:
            return
        shared = [i for i, h in enumerate(hashes) if h in self._train_hashes]
        if shared:
            self.report(
                EVAL_SPLIT_OVERLAP.code,
                f"{len(shared)} of the {len(hashes)} rows of the Trainer's eval_dataset also appear in its train_dataset "
                f"(eval rows {shared[:10]}{' ...' if len(shared) > 10 else ''}): eval loss on them measures memorisation.",
                evidence={"shared_rows": len(shared), "eval_rows": len(hashes), "examples": shared[:50]},
            )

    # -- run end: the last matches, the summary and the lists ------------------------------------------------------

    @hookimpl(tryfirst=True)  # before the mlflow plugin uploads the run directory
    def on_run_end(self, ctx: Any) -> None:
        if self.index is None or self.checker is None or self.ledger is None:
            return
        if self._buffer is not None:
            self._buffer.flush(timeout=RUN_END_WAIT_S)
        finished = self.checker.finish(RUN_END_WAIT_S)  # a dead worker is not waited for, a stuck one not for long
        self._drain()
        late = self.ledger.dirty_here_only(self._is_dirty)  # matched after the last exchange: no collective now
        self._report_most_copied_first([(e, tuple(sorted(self.ledger.contributors.get(e, set()) | {ctx.rank}))) for e in late],
                                       agreed=False)
        self._verdicts.clear()
        rows = [self._judge(e, self.ledger.combined(e)) for e in range(len(self.index.examples))]
        out = ctx.path("contamination", f"summary.rank-{ctx.rank}.json").parent
        per_set = write_summary(out, ctx.rank, rows, self.checked_tokens, finished, self._judging.dirty_span, self._judging.n)
        if ctx.is_main:
            self._report_summary(ctx, rows)
        for name, counts in per_set.items():
            ctx.log_metrics({f"contamination/{name}/{status}": counts.get(status, 0) for status in ("clean", "partial", "dirty")})
        if ctx.is_main:
            log.info(console_line(rows, self._judging.dirty_fraction, self._judging.dirty_span))
        if not finished and self.checker.error is None and not self._worker_error_reported:
            self._worker_error_reported = True
            raise RuntimeError(f"contamination: the background checker did not finish within {RUN_END_WAIT_S:.0f} s at run end; "
                               "the summary covers the batches checked so far.")
        if self.checker.error is not None:
            self._raise_worker_error()  # died after the last batch was queued: said now (once)

    def _report_summary(self, ctx: Any, rows: list[dict[str, Any]]) -> None:
        """CONTAMINATION_SUMMARY: per eval set with a dirty row, how many rows hold training spans (the findings per
        example stop at ``max_reports``); not again when an earlier attempt in this run directory said the same."""
        o = self._judging
        findings = read_run_findings(ctx.run_dir)  # every rank's and every earlier attempt's findings
        named = {(str(f.evidence.get("eval_set")), str(f.evidence.get("example_id"))) for f in findings if f.code == CONTAMINATION.code}
        counts = span_counts(rows, o.dirty_span, named)
        message = summary_message(counts, o.dirty_span, o.dirty_fraction, o.n, f"contamination/dirty_ids.rank-{ctx.rank}.txt",
                                  f"contamination/summary.rank-{ctx.rank}.json", self.options.max_reports)
        if message is None:
            return
        evidence = {"eval_sets": counts, "dirty_span": o.dirty_span, "dirty_fraction": o.dirty_fraction, "n": o.n}
        if any(f.evidence.get("eval_sets") == counts for f in findings if f.code == CONTAMINATION_SUMMARY.code):
            return  # an earlier attempt said the same
        self.report(CONTAMINATION_SUMMARY.code, message, evidence=evidence)

    @hookimpl
    def report_sections(self, run: Any) -> Any:
        """Per eval set: examples clean/partial/dirty (worst over ranks), the dirtiest ones, the id lists."""
        return report_section(run.run_dir)
