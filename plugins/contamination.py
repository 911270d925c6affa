"""contamination: watches every training micro-batch for the eval sets' n-grams, off the critical path.

At run start the eval sets named in config (and, by default, the Trainer's
own ``eval_dataset``) are tokenised with the run's tokenizer and indexed
(``harness.lib.ngrams``: the same index ``harness scan`` uses, token front end,
each example also as it tokenises after a space mid-document). Each checked
micro-batch's token ids are copied to the host and handed to a background
thread, which looks every window of every row up in the index; matches come
back to the training thread and become ``CONTAMINATION`` findings naming the
eval example, the step, rank, row and sample id. At run end every eval set
gets a summary and lists of clean, partial and dirty ids in
``<output_dir>/harness/contamination/`` (uploaded by the ``mlflow`` plugin).
``EVAL_SPLIT_OVERLAP`` compares the Trainer's train and eval datasets row by
row before training.
"""
from __future__ import annotations

import json
import queue
import threading
from collections import Counter
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np
import torch
from pydantic import BaseModel, ConfigDict, Field

from harness.lib.capture import sample_ids
from harness.core.findings import FindingCode, Severity
from harness.lib.hashing import dataset_hashes, dataset_rows
from harness.core.hookspecs import hookimpl
from harness.core.plugin import Plugin
from harness.lib.ngrams import EvalExample, Hit, NgramIndex
from harness.lib.documents import ScanError, iter_documents
from harness.lib.overlap import FrontEnd, ScanOptions, Tally, judge

CONTAMINATION = FindingCode(
    "CONTAMINATION",
    Severity.WARNING,
    "A training batch contains text of an eval example: scores on that example measure memory, not skill.",
    "contamination#contamination",
)
EVAL_SPLIT_OVERLAP = FindingCode(
    "EVAL_SPLIT_OVERLAP",
    Severity.WARNING,
    "The Trainer's eval dataset shares samples with its train dataset: eval loss and metrics look better than they are.",
    "contamination#eval_split_overlap",
)
CONTAMINATION_UNCHECKED = FindingCode(
    "CONTAMINATION_UNCHECKED",
    Severity.WARNING,
    "An eval set named in config could not be indexed, so training is not checked against it.",
    "contamination#contamination_unchecked",
)


QUEUE_SIZE = 64  # micro-batches waiting for the background checker at most (then training waits for it)
PUT_POLL_S = 0.5  # how often a waiting put looks whether the checker is still alive
RUN_END_WAIT_S = 60.0  # run end waits this long at most for the checker to finish the queue


class EvalSet(BaseModel):
    """One eval set to watch for."""

    model_config = ConfigDict(extra="forbid")

    path: str = Field(description="A .txt (one example per line), .jsonl, .parquet file or `datasets` folder.")
    field: str = Field("text", description="The field holding the example's text.")
    name: str | None = Field(None, description="Name in findings and summaries (default: the file name).")
    id_field: str = Field("id", description="The field holding the example's id (default: file:line).")


class ContaminationOptions(BaseModel):
    """Options of the ``contamination`` plugin."""

    model_config = ConfigDict(extra="forbid")

    eval_sets: list[EvalSet] = Field(default_factory=list, description="Eval sets whose examples must not appear in training batches.")
    trainer_eval: bool = Field(True, description="Also watch for the rows of the Trainer's eval_dataset (token ids as they are).")
    n: int = Field(13, ge=2, description="n-gram length in tokens.")
    min_length: int = Field(8, ge=1, description="Eval examples shorter than this many tokens are not indexed (too short to tell).")
    template_min_examples: int = Field(10, ge=0, description="n-grams shared by this many eval examples are templates and left out (0 keeps all).")
    sample_every: int = Field(1, ge=1, description="Check one micro-batch in this many.")
    dirty_fraction: float = Field(0.5, ge=0, le=1, description="Run-end status dirty from this fraction of an example's n-grams seen in training.")
    partial_fraction: float = Field(0.0, ge=0, le=1, description="Run-end status partial above this fraction.")
    check_split_overlap: bool = Field(True, description="EVAL_SPLIT_OVERLAP: compare the Trainer's train and eval rows before training.")
    max_reports: int = Field(20, ge=1, description="CONTAMINATION findings per run at most (each eval example once; the summary counts all).")


class Contamination(Plugin):
    """Indexes the eval sets, checks training micro-batches in a background thread, reports and summarises hits."""

    name = "contamination"
    Options = ContaminationOptions
    CODES = (CONTAMINATION, EVAL_SPLIT_OVERLAP, CONTAMINATION_UNCHECKED)

    def __init__(self) -> None:
        self.options = ContaminationOptions()
        self.index: NgramIndex | None = None
        self._queue: queue.Queue[Any] = queue.Queue(maxsize=QUEUE_SIZE)
        self._hits: queue.Queue[tuple[int, int, int, list[Any] | None, list[Hit], np.ndarray]] = queue.Queue()
        self._thread: threading.Thread | None = None
        self._tallies: dict[int, Tally] = {}
        self._reported: set[int] = set()  # eval examples already named in a finding (each once)
        self._micro_batches = 0
        self._train_hashes: set[int] | None = None
        self._tokenizer: Any = None
        self.checked_tokens = 0
        self._worker_error: BaseException | None = None  # what killed the background thread (set there, read here)
        self._worker_error_reported = False

    # -- the index ------------------------------------------------------------------------------------------

    @hookimpl
    def on_run_start(self, ctx: Any, trainer: Any) -> None:
        self.index, self._thread = None, None  # a second train() call starts from nothing (no index, no worker) until built
        tokenizer = getattr(trainer, "processing_class", None)
        self._tokenizer = getattr(tokenizer, "tokenizer", tokenizer)
        examples: list[EvalExample] = []
        front = FrontEnd(self._tokenizer) if self._tokenizer is not None else None
        for spec in self.options.eval_sets:
            name = spec.name or Path(spec.path).stem
            try:
                if front is None:
                    raise ScanError(f"the run has no tokenizer (processing_class) to tokenise {spec.path}. Fix: pass processing_class to the Trainer.")
                found = [EvalExample(name, i, text, front.eval_variants(text)) for i, text in iter_documents(spec.path, spec.field, spec.id_field)]
                if not found:
                    raise ScanError(f"the eval set {spec.path} has no example with text in field '{spec.field}'. Fix: check the file and 'field'.")
                examples += found
            except ScanError as exc:
                if ctx.is_main:
                    self.report(CONTAMINATION_UNCHECKED.code, f"contamination: {exc}".replace("harness scan: ", ""),
                               evidence={"eval_set": spec.path, "field": spec.field})
        if self.options.trainer_eval and getattr(trainer, "eval_dataset", None) is not None:
            examples += _trainer_eval_examples(trainer.eval_dataset)
        if not examples:
            return
        self.index = NgramIndex.build(examples, self.options.n, self.options.template_min_examples, self.options.min_length)
        self._worker_error, self._worker_error_reported = None, False
        self._queue = queue.Queue(maxsize=QUEUE_SIZE)  # a second train() call: nothing left over from the last
        self._thread = threading.Thread(target=self._work, args=(self._queue, self.index), name="harness-contamination", daemon=True)
        self._thread.start()

    # -- per micro-batch: a host copy, the lookup in the background ------------------------------------------------

    @hookimpl
    def inspect_batch(self, ctx: Any, batch: Any, step: int, micro_step: int) -> None:
        if self.index is None or not isinstance(batch, Mapping):
            return
        ids = batch.get("input_ids")
        if not torch.is_tensor(ids) or ids.dim() != 2:
            return
        self._micro_batches += 1
        if (self._micro_batches - 1) % self.options.sample_every:
            return
        self._drain(ctx)
        if not self._worker_alive():
            self._raise_worker_error()  # once: an INTERNAL_PLUGIN_ERROR with the worker's traceback; then nothing is queued
            return
        host = ids.detach().to("cpu", non_blocking=True) if ids.is_cuda else ids.detach().clone()
        ready = torch.cuda.Event() if ids.is_cuda else None
        if ready is not None:
            ready.record()
        if not self._put((step, micro_step, ctx.rank, sample_ids(batch), host, ready)):
            self._raise_worker_error()

    def _worker_alive(self) -> bool:
        return self._thread is not None and self._thread.is_alive() and self._worker_error is None

    def _put(self, item: Any, timeout: float | None = None) -> bool:
        """Queue for the worker, waiting while it is busy but never on a dead one (or past ``timeout``); False if not queued."""
        waited = 0.0
        while self._worker_alive():
            try:
                self._queue.put(item, timeout=PUT_POLL_S)
                return True
            except queue.Full:
                waited += PUT_POLL_S
                if timeout is not None and waited >= timeout:
                    return False
        return False

    def _raise_worker_error(self) -> None:
        """Turn a dead worker into one exception on the training thread (the manager makes it an INTERNAL_PLUGIN_ERROR)."""
        if self._worker_error_reported:
            return
        self._worker_error_reported = True
        error = self._worker_error
        detail = f"{type(error).__name__}: {error}" if error is not None else "it stopped"
        raise RuntimeError(
            f"contamination: the background checker died ({detail}); training batches are no longer checked against the "
            f"eval sets after {self.checked_tokens} tokens. The run-end summary covers only those."
        ) from error

    def _work(self, jobs: "queue.Queue[Any]", index: NgramIndex) -> None:
        """The worker of one train() call: its own queue and index (one stuck past the run end never serves the next call)."""
        while True:
            item = jobs.get()
            if item is None:
                jobs.task_done()
                return
            step, micro, rank, ids, host, ready = item
            try:
                if ready is not None:
                    ready.synchronize()
                rows = host.numpy().astype(np.int64, copy=False)
                hits = index.query_rows(rows)
                self.checked_tokens += rows.size
                if hits:
                    self._hits.put((step, micro, rank, ids, hits, rows))
            except BaseException as exc:  # noqa: BLE001 - the training thread reports it; this thread ends
                self._worker_error = exc
                return
            finally:
                jobs.task_done()

    def _drain(self, ctx: Any) -> None:
        """Report what the background thread found (on the training thread: findings are not thread-safe)."""
        while True:
            try:
                step, micro, rank, ids, hits, rows = self._hits.get_nowait()
            except queue.Empty:
                return
            assert self.index is not None
            for hit in hits:
                self._tallies.setdefault(hit.example, Tally()).add(hit, f"step {step} micro-batch {micro} row {hit.row}", "", 3)
            first: dict[int, Hit] = {}
            for hit in hits:
                first.setdefault(hit.example, hit)
            for example, hit in first.items():
                if example in self._reported or self.reported(CONTAMINATION.code) >= self.options.max_reports:
                    continue
                self._reported.add(example)
                self._report_hit(ctx, step, micro, rank, ids, hit, rows, len({h.offset for h in hits if h.example == example and h.variant == hit.variant}))

    def _report_hit(self, ctx: Any, step: int, micro: int, rank: int, ids: list[Any] | None, hit: Hit, rows: np.ndarray, windows: int) -> None:
        assert self.index is not None
        example = self.index.examples[hit.example]
        sample = ids[hit.row] if ids is not None and hit.row < len(ids) else None
        snippet = None
        if self._tokenizer is not None:
            try:
                snippet = self._tokenizer.decode(rows[hit.row, hit.position : hit.position + hit.length].tolist())[:200]
            except Exception:  # noqa: BLE001 - a snippet is a courtesy
                snippet = None
        total = self.index.windows_of(hit.example, hit.variant)
        self.report(
            CONTAMINATION.code,
            f"eval example '{example.example_id}' of eval set '{example.eval_set}' is in the training batch of step {step} "
            f"(rank {rank}, micro-batch {micro}, row {hit.row}{f', sample id {sample}' if sample is not None else ''}): "
            f"{windows} of its {total} {self.index.n}-grams matched" + (f', e.g. "{snippet}"' if snippet else "") + ".",
            step=step,
            evidence={"eval_set": example.eval_set, "example_id": example.example_id, "rank": rank, "micro_batch": micro,
                      "row": hit.row, "sample_id": sample, "position": hit.position, "matched_ngrams": windows, "ngrams": total,
                      "snippet": snippet},
            limit=self.options.max_reports,
        )

    @hookimpl
    def on_step_end(self, ctx: Any) -> None:
        if self.index is not None:
            self._drain(ctx)

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

    # -- run end: the summary and the lists --------------------------------------------------------------------------

    @hookimpl(tryfirst=True)  # before the mlflow plugin uploads the run directory
    def on_run_end(self, ctx: Any) -> None:
        if self.index is None or self._thread is None:
            return
        if self._put(None, timeout=RUN_END_WAIT_S):  # a dead worker is not waited for, a stuck one not for long
            self._thread.join(timeout=RUN_END_WAIT_S)
        self._drain(ctx)
        alive, self._thread = self._thread.is_alive(), None
        failed = self._worker_error is not None or alive
        options = ScanOptions(n=self.options.n, dirty_fraction=self.options.dirty_fraction,
                              partial_fraction=self.options.partial_fraction, min_length=self.options.min_length)
        rows = [judge(self.index, e, self._tallies.get(e), options) for e in range(len(self.index.examples))]
        out = ctx.path("contamination", f"summary.rank-{ctx.rank}.json").parent
        per_set: dict[str, Counter[str]] = {}
        for row in rows:
            per_set.setdefault(row["eval_set"], Counter())[row["status"]] += 1
        summary = {"rank": ctx.rank, "checked_tokens": self.checked_tokens, "eval_sets": {k: dict(v) for k, v in per_set.items()},
                   "complete": not failed,
                   "examples": [{k: v for k, v in r.items() if k != "locations"} for r in rows if r["status"] != "clean"]}
        tmp = out / f".summary.rank-{ctx.rank}.json.tmp"
        tmp.write_text(json.dumps(summary, indent=1), encoding="utf-8")
        tmp.replace(out / f"summary.rank-{ctx.rank}.json")  # rank 0's report may read it at any moment
        for status in ("clean", "partial", "dirty"):
            (out / f"{status}_ids.rank-{ctx.rank}.txt").write_text(
                "".join(f"{r['eval_set']}\t{r['id']}\n" for r in rows if r["status"] == status), encoding="utf-8")
        for name, counts in per_set.items():
            ctx.log_metrics({f"contamination/{name}/{status}": counts.get(status, 0) for status in ("clean", "partial", "dirty")})
        if failed and self._worker_error is None and not self._worker_error_reported:
            self._worker_error_reported = True
            raise RuntimeError(f"contamination: the background checker did not finish within {RUN_END_WAIT_S:.0f} s at run end; "
                               "the summary covers the batches checked so far.")
        if self._worker_error is not None:
            self._raise_worker_error()  # died after the last batch was queued: said now (once)


    @hookimpl
    def report_sections(self, run: Any) -> Any:
        """Per eval set: examples clean/partial/dirty (worst over ranks), the dirtiest ones, the id lists."""
        from urllib.parse import quote

        from harness.report.model import Raw, ReportSection, md_table
        from harness.lib.textsafe import md_escape

        summaries = []
        for path in sorted(run.run_dir.glob("contamination/summary.rank-*.json")):
            try:
                summaries.append(json.loads(path.read_text(encoding="utf-8")))
            except (OSError, ValueError):
                continue  # one unreadable rank costs its numbers, not the section
        if not summaries:
            return None
        order = {"clean": 0, "partial": 1, "dirty": 2}
        worst: dict[tuple[str, str], dict[str, Any]] = {}
        totals: dict[str, int] = {}
        for summary in summaries:
            for name, counts in summary.get("eval_sets", {}).items():
                totals[name] = max(totals.get(name, 0), sum(counts.values()))
            for example in summary.get("examples", []):
                key = (example["eval_set"], str(example["id"]))
                if key not in worst or order[example["status"]] > order[worst[key]["status"]]:
                    worst[key] = example
        rows = []
        for name, total in totals.items():
            hit = Counter(e["status"] for (s, _), e in worst.items() if s == name)
            rows.append([name, total, total - hit["partial"] - hit["dirty"], hit["partial"], hit["dirty"]])
        text = (f"Eval examples met in the training batches of this run ({sum(s.get('checked_tokens', 0) for s in summaries):,} "
                "training tokens checked; an example counts at its worst over ranks).\n\n")
        text += md_table(["eval set", "examples", "clean", "partial", "dirty"], rows) + "\n\n"
        dirtiest = sorted(worst.values(), key=lambda e: (-order[e["status"]], -float(e.get("matched_fraction") or 0)))[:10]
        if dirtiest:
            text += md_table(["eval set", "example", "status", "matched fraction", "longest span", "training documents hit"],
                             [[e["eval_set"], e["id"], e["status"], e.get("matched_fraction"), e.get("longest_span"), e.get("documents_hit")] for e in dirtiest])
            text += "\n\n"
        lists = sorted(run.run_dir.glob("contamination/*_ids.rank-*.txt"))
        if lists:
            text += "Id lists (eval set, tab, id): " + ", ".join(  # file names from the run dir are data: escaped, quoted
                Raw(f"[{md_escape(p.name)}](contamination/{quote(p.name)})").markdown for p in lists) + ".\n"
        return ReportSection("Contamination", text)


def _trainer_eval_examples(dataset: Any) -> list[EvalExample]:
    """The Trainer's eval rows as token-id examples (padding excluded when an attention mask says where it is)."""
    if not hasattr(dataset, "__len__") or len(dataset) > 200_000:
        return []
    rows = dataset_rows(dataset, "input_ids", range(len(dataset)))
    masks = dataset_rows(dataset, "attention_mask", range(len(dataset)))
    if rows is None:
        return []
    out = []
    for i, row in enumerate(rows):
        if masks is not None:
            row = [t for t, m in zip(row, masks[i]) if m]
        out.append(EvalExample("eval_dataset", str(i), None, [np.asarray(row, dtype=np.int64)]))
    return out
