"""`harness scan`: which eval examples appear in the training data, found before training starts.

Eval examples are indexed once (``harness.lib.ngrams``); the training data is
streamed, in chunks of documents, through worker processes that each hold
the index, so memory grows with the eval sets, not with the training data.
Every eval example gets: the fraction of its n-grams found in training data,
the fraction of its units covered by them, the longest matched span, how many
training documents contain a match (with the first few locations and
snippets) and a status, ``clean``, ``partial`` or ``dirty``. The results go
to a table (CSV, Parquet, markdown) and to lists of clean and dirty ids, so
an evaluation can be rerun on the clean subset.
"""
from __future__ import annotations

import json
import multiprocessing
import os
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from harness.lib.documents import TEXT_SUFFIXES, ScanError, document_files, iter_documents  # noqa: F401 - re-exported
from harness.lib.ngrams import EvalExample, Hit, NgramIndex, normalise_words, word_units  # noqa: F401
from harness.lib.overlap import FrontEnd, ScanOptions, Tally, judge, load_eval_examples  # noqa: F401 - re-exported

# -- near duplicates: MinHash LSH, confirmed by exact Jaccard ------------------------------------------------------


def shingles(text: str, size: int) -> set[str]:
    """Word ``size``-grams of the normalised text (the whole text when shorter)."""
    words = normalise_words(text)
    if len(words) <= size:
        return {" ".join(words)} if words else set()
    return {" ".join(words[i : i + size]) for i in range(len(words) - size + 1)}


class NearDuplicates:
    """Eval examples in a MinHash LSH; a training document's candidates are confirmed by exact Jaccard similarity."""

    def __init__(self, examples: list[EvalExample], options: ScanOptions) -> None:
        from datasketch import MinHash, MinHashLSH

        self.options = options
        # the LSH proposes from a lower similarity than the one that counts, so that a true near duplicate just above
        # the threshold is rarely missed (LSH recall near its own threshold is only about one half); Jaccard decides
        self.lsh = MinHashLSH(threshold=0.7 * options.near_dup_threshold, num_perm=options.num_perm)
        self.sets: dict[int, set[str]] = {}
        for e, example in enumerate(examples):
            grams = shingles(example.text or "", options.shingle)
            if not grams:
                continue
            self.sets[e] = grams
            self.lsh.insert(str(e), self._minhash(grams, MinHash))

    def _minhash(self, grams: set[str], factory: Any) -> Any:
        sketch = factory(num_perm=self.options.num_perm, seed=1)
        sketch.update_batch([g.encode() for g in grams])
        return sketch

    def query(self, text: str) -> list[tuple[int, float]]:
        from datasketch import MinHash

        grams = shingles(text, self.options.shingle)
        if not grams:
            return []
        out = []
        for key in self.lsh.query(self._minhash(grams, MinHash)):
            e = int(key)
            jaccard = len(grams & self.sets[e]) / len(grams | self.sets[e])
            if jaccard >= self.options.near_dup_threshold:  # the sketch only proposes; the sets decide
                out.append((e, round(jaccard, 4)))
        return out


# -- the scan ------------------------------------------------------------------------------------------------

_WORKER: dict[str, Any] = {}


def _init_worker(index: NgramIndex, front: FrontEnd, options: ScanOptions, near: NearDuplicates | None = None) -> None:
    _WORKER.update(index=index, front=front, options=options, near=near)


Found = tuple[list[tuple[int, Hit, str, str]], list[tuple[int, str, float]]]


def _scan_chunk(documents: list[tuple[str, str]]) -> tuple[int, int, Found]:
    """Documents and units scanned, n-gram hits (example, hit, document id, snippet) and near duplicates
    (example, document id, Jaccard similarity) of one chunk of training documents."""
    index: NgramIndex = _WORKER["index"]
    front: FrontEnd = _WORKER["front"]
    options: ScanOptions = _WORKER["options"]
    near: NearDuplicates | None = _WORKER.get("near")
    units_scanned, found, near_found = 0, [], []
    for document_id, text in documents:
        units, words = front.document(text)
        units_scanned += len(units)
        for hit in index.query(units):
            found.append((hit.example, hit, document_id, _snippet(front, units, words, hit, options.snippet_chars)))
        near_found += [(example, document_id, jaccard) for example, jaccard in (near.query(text) if near is not None else [])]
    return len(documents), units_scanned, (found, near_found)


def _snippet(front: FrontEnd, units: np.ndarray, words: list[str] | None, hit: Hit, chars: int) -> str:
    if words is not None:
        text = " ".join(words[hit.position : hit.position + hit.length])
    else:
        text = front.tokenizer.decode(units[hit.position : hit.position + hit.length].tolist())
    return text[:chars]


def _chunks(paths: list[str], field: str, id_field: str, size: int) -> Iterator[list[tuple[str, str]]]:
    """Chunks of training documents; a training path without one document is an error (it would make every example clean)."""
    chunk: list[tuple[str, str]] = []
    for path in paths:
        read = 0
        for document in iter_documents(path, field, id_field):
            read += 1
            chunk.append(document)
            if len(chunk) >= size:
                yield chunk
                chunk = []
        if not read:
            raise ScanError(f"harness scan: the training input {path} has no document with text in field '{field}' "
                            "(0 documents read), so nothing could be checked against the eval sets. "
                            "Fix: check the path, its files and --field.")
    if chunk:
        yield chunk


@dataclass
class ScanResult:
    rows: list[dict[str, Any]]
    documents: int
    units: int
    index_windows: int
    templates_dropped: int
    front_end: str

    def frame(self) -> Any:
        import pandas as pd

        return pd.DataFrame([{k: v for k, v in r.items() if k not in ("locations", "near_duplicate_documents")} for r in self.rows])


def scan(train: list[str], evals: list[str], field: str = "text", tokenizer: Any = None, workers: int = 1,
         options: ScanOptions | None = None, id_field: str = "id", chunk_size: int = 256, progress: bool = True,
         eval_field: str | None = None) -> ScanResult:
    """Scan every training document (text in ``field``) against every eval example (in ``eval_field``, default ``field``)."""
    options = options or ScanOptions()
    front = FrontEnd(tokenizer)
    for path in train:
        document_files(Path(path))  # a missing path fails before any work
    examples = load_eval_examples(evals, eval_field or field, front, id_field)
    index = NgramIndex.build(examples, options.n, options.template_min_examples, options.min_length)
    near = NearDuplicates(examples, options) if options.near_dup else None
    tallies: dict[int, Tally] = {}
    documents = units = 0
    chunks = _chunks(train, field, id_field, chunk_size)
    with _progress(progress) as bar:
        task = bar.add_task("scanning training documents", total=None)
        if workers > 1:
            context = multiprocessing.get_context("fork" if os.name == "posix" else "spawn")
            with context.Pool(workers, initializer=_init_worker, initargs=(index, front, options, near)) as pool:
                for counted, scanned, found in _bounded(pool, chunks, ahead=4 * workers):
                    documents, units = _merge(tallies, found, options, documents + counted, units + scanned)
                    bar.update(task, completed=documents, description=f"scanning training documents ({units:,} units)")
        else:
            _init_worker(index, front, options, near)
            for chunk in chunks:
                counted, scanned, found = _scan_chunk(chunk)
                documents, units = _merge(tallies, found, options, documents + counted, units + scanned)
                bar.update(task, completed=documents, description=f"scanning training documents ({units:,} units)")
    rows = [judge(index, e, tallies.get(e), options) for e in range(len(examples))]
    return ScanResult(rows, documents, units, index.windows, index.templates_dropped, front.kind)


def _bounded(pool: Any, chunks: Iterator[list[tuple[str, str]]], ahead: int) -> Iterator[tuple[int, int, Found]]:
    """Results in order, with at most ``ahead`` chunks read and in flight (``Pool.imap`` would read the whole input)."""
    from collections import deque

    pending: deque[Any] = deque()
    for chunk in chunks:
        pending.append(pool.apply_async(_scan_chunk, (chunk,)))
        if len(pending) >= ahead:
            yield pending.popleft().get()
    while pending:
        yield pending.popleft().get()


def _merge(tallies: dict[int, Tally], found: Found, options: ScanOptions, documents: int, units: int) -> tuple[int, int]:
    hits, near = found
    for example, hit, document, snippet in hits:
        tallies.setdefault(example, Tally()).add(hit, document, snippet, options.max_locations)
    for example, document, jaccard in near:
        tallies.setdefault(example, Tally()).near.append({"document": document, "jaccard": jaccard})
    return documents, units


def _progress(enabled: bool) -> Any:
    from rich.progress import BarColumn, Progress, SpinnerColumn, TextColumn, TimeElapsedColumn

    return Progress(SpinnerColumn(), TextColumn("{task.description}"), BarColumn(), TextColumn("{task.completed:,} documents"),
                    TimeElapsedColumn(), disable=not enabled, transient=False)


def write_outputs(result: ScanResult, out: Path | str) -> dict[str, Path]:
    """report.csv / report.parquet / report.md, details.jsonl, clean_ids.txt, partial_ids.txt, dirty_ids.txt."""
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    frame = result.frame()
    paths = {"csv": out / "report.csv", "parquet": out / "report.parquet", "markdown": out / "report.md", "details": out / "details.jsonl"}
    frame.to_csv(paths["csv"], index=False)
    frame.to_parquet(paths["parquet"], index=False)
    with open(paths["details"], "w", encoding="utf-8") as handle:
        for row in result.rows:
            handle.write(json.dumps(row) + "\n")
    for status in ("clean", "partial", "dirty"):
        paths[status] = out / f"{status}_ids.txt"
        paths[status].write_text("".join(f"{r['id']}\n" for r in result.rows if r["status"] == status), encoding="utf-8")
    summary = frame.groupby(["eval_set", "status"]).size().unstack(fill_value=0).reset_index() if len(frame) else frame
    worst = frame.sort_values("matched_fraction", ascending=False).head(20)
    paths["markdown"].write_text(
        f"# Contamination scan\n\n{result.documents:,} training documents ({result.units:,} {result.front_end}) against "
        f"{len(result.rows):,} eval examples ({result.index_windows:,} indexed n-grams, {result.templates_dropped:,} template "
        f"n-grams left out).\n\n## Per eval set\n\n{markdown_table(summary)}\n\n## Most contaminated\n\n"
        f"{markdown_table(worst)}\n",
        encoding="utf-8",
    )
    return paths


def markdown_table(frame: Any) -> str:
    """A pandas frame as a GitHub markdown table (pandas' own needs the optional `tabulate`)."""
    from harness.report.model import md_table

    return md_table([str(c) for c in frame.columns], frame.itertuples(index=False), limit=10_000)


def print_scan(train: list[str], evals: list[str], field: str, tokenizer_dir: str | None, out: str, workers: int,
               options: ScanOptions, id_field: str = "id", eval_field: str | None = None) -> int:
    """`harness scan`: run, write the outputs, print the per-set summary; exit 1 when an eval example is dirty."""
    from rich.console import Console
    from rich.table import Table

    tokenizer = None
    if tokenizer_dir:
        if not Path(tokenizer_dir).exists():
            raise ScanError(f"harness scan: --tokenizer {tokenizer_dir} does not exist. Fix: pass a tokenizer directory.")
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)
    result = scan(train, evals, field, tokenizer, workers, options, id_field, eval_field=eval_field)
    paths = write_outputs(result, out)
    frame = result.frame()
    table = Table(title=f"contamination: {result.documents:,} training documents, {len(frame):,} eval examples ({result.front_end})")
    for column in ("eval set", "examples", "clean", "partial", "dirty", "too short"):
        table.add_column(column)
    for name, group in frame.groupby("eval_set"):
        counts = group["status"].value_counts()
        table.add_row(str(name), str(len(group)), *(str(int(counts.get(s, 0))) for s in ("clean", "partial", "dirty", "too_short")))
    console = Console()
    console.print(table)
    console.print(f"report: {paths['markdown']}  table: {paths['csv']}  clean ids: {paths['clean']}  dirty ids: {paths['dirty']}")
    return 1 if (frame["status"] == "dirty").any() else 0
