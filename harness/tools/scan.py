"""`harness scan`: which eval examples appear in the training data, found before training starts.

Eval examples are indexed once (``harness.lib.ngrams``); the training data is
streamed through worker processes that each hold the index, so memory grows
with the eval sets, not with the training data. Text and JSON-lines files go
to the workers as newline-aligned byte ranges that each worker reads and
normalises whole (``harness.tools.scan_work``); only the matches come back.
Every eval example gets: the fraction of its n-grams found in training data,
the fraction of its units covered by them, the longest matched span, how many
training documents contain a match (with the first few locations and
snippets) and a status, ``clean``, ``partial`` or ``dirty``. The results go
to a table (CSV, Parquet, markdown) and to lists of clean and dirty ids, so
an evaluation can be rerun on the clean subset.
"""
from __future__ import annotations

import json
import sys
from collections.abc import Iterator
from contextlib import nullcontext
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from harness.lib.allocator import keep_freed_memory
from harness.lib.documents import TEXT_SUFFIXES, ScanError, document_files, iter_documents  # noqa: F401 - re-exported
from harness.lib.ngrams import EvalExample, Hit, NgramIndex, normalise_words, word_units  # noqa: F401
from harness.lib.ordered_pool import OrderedPool
from harness.lib.overlap import (FrontEnd, ScanOptions, Tally, eval_chars_per_unit, judge, load_eval_examples,  # noqa: F401 - re-exported
                                 scaled_to_text)
from harness.lib.text_ranges import LINE_FILES, RANGE_BYTES, byte_ranges
from harness.tools.scan_work import Done, Scanner, Work

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

WORKS_PER_TASK = 8  # works (ranges of about RANGE_BYTES, or document batches) a worker gets per round trip


def _run_works(scanner: Scanner, works: list[Work]) -> list[Done]:
    return [scanner.run(work) for work in works]


def _grouped(works: Iterator[Work], size: int) -> Iterator[list[Work]]:
    """Consecutive works in lists of ``size``: one round trip to a worker per list, not per range (the parent's
    dispatch and the results' transfer were what kept two workers from scanning twice as fast as one)."""
    group: list[Work] = []
    try:
        for work in works:
            group.append(work)
            if len(group) >= size:
                yield group
                group = []
    except ScanError:  # the parent could not read on: what it read before the problem is scanned first
        if group:
            yield group
        raise
    if group:
        yield group


def _works(paths: list[str], field: str, id_field: str, size: int, range_bytes: int) -> Iterator[Work]:
    """The training inputs as work: newline-aligned byte ranges of .txt/.jsonl files (read by the worker), batches of
    ``size`` documents of the other formats, and an end marker after each path."""
    for p, path in enumerate(paths):
        for file in document_files(Path(path)):
            kind = LINE_FILES.get(file.suffix.lower()) if file.is_file() else None
            if kind is not None:
                yield from (Work(p, str(file), kind, start, stop) for start, stop in byte_ranges(file, range_bytes))
                continue
            batch: list[tuple[str, str]] = []
            for document in iter_documents(file, field, id_field):
                batch.append(document)
                if len(batch) >= size:
                    yield Work(p, str(file), "docs", documents=batch)
                    batch = []
            if batch:
                yield Work(p, str(file), "docs", documents=batch)
        yield Work(p, path, "end")


@dataclass
class ScanResult:
    rows: list[dict[str, Any]]
    documents: int
    units: int
    index_windows: int
    templates_dropped: int
    front_end: str
    options: ScanOptions = ScanOptions()  # as judged: n and dirty_span scaled to the tokens' text
    scale_note: str | None = None  # the line saying they were scaled, when they were

    def frame(self) -> Any:
        import pandas as pd

        return pd.DataFrame([{k: v for k, v in r.items() if k not in ("locations", "near_duplicate_documents")} for r in self.rows])


def scan(train: list[str], evals: list[str], field: str = "text", tokenizer: Any = None, workers: int = 1,
         options: ScanOptions | None = None, id_field: str = "id", chunk_size: int = 1024, progress: bool = True,
         eval_field: str | None = None, range_bytes: int = RANGE_BYTES) -> ScanResult:
    """Scan every training document (text in ``field``) against every eval example (in ``eval_field``, default ``field``).

    .txt/.jsonl files go to the workers as byte ranges of about ``range_bytes``; other formats as batches of
    ``chunk_size`` documents. Results are merged in input order, so they do not depend on ``workers``.
    The calling process keeps the memory it frees from then on (glibc's trim and mmap thresholds raised,
    ``harness.lib.allocator``): meant for the `harness scan` command's own process, harmless in a test or a notebook.
    """
    options = options or ScanOptions()
    keep_freed_memory()  # this process and the workers it forks keep freed memory for reuse (harness.lib.allocator)
    front = FrontEnd(tokenizer)
    for path in train:
        document_files(Path(path))  # a missing path fails before any work
    examples = load_eval_examples(evals, eval_field or field, front, id_field)
    given, scale = options, None
    if front.kind == "tokens":  # words are words: counted as given
        options, scale = scaled_to_text(options, eval_chars_per_unit(examples))
    note = scale.line(given, options, "pass --no-scale-to-text") if scale is not None else None
    if note is not None and progress:
        print(f"harness scan: {note}", file=sys.stderr)
    index = NgramIndex.build(examples, options.n, options.template_min_examples, options.min_length)
    near = NearDuplicates(examples, options) if options.near_dup else None
    scanner = Scanner(index, front, field, id_field, options.snippet_chars, near)
    merged = _Merged(train, field, options)
    works = _works(train, field, id_field, chunk_size, range_bytes)
    pool = OrderedPool(_run_works, scanner, workers) if workers > 1 else None
    with pool or nullcontext(), _progress(progress) as bar:  # the workers fork before the progress bar's thread starts
        task = bar.add_task("scanning training documents", total=None)
        if pool is not None:
            for group in pool.map(_grouped(works, WORKS_PER_TASK)):
                for done in group:
                    merged.add(done)
                bar.update(task, completed=merged.documents, description=f"scanning training documents ({merged.units:,} units)")
        else:
            for work in works:
                merged.add(scanner.run(work))
                bar.update(task, completed=merged.documents, description=f"scanning training documents ({merged.units:,} units)")
    rows = [judge(index, e, merged.tallies.get(e), options) for e in range(len(examples))]
    return ScanResult(rows, merged.documents, merged.units, index.windows, index.templates_dropped, front.kind, options, note)


class _Merged:
    """The tallies so far; turns local line numbers into ``file:line`` ids, raises a range's problem, checks every
    training path had a document."""

    def __init__(self, paths: list[str], field: str, options: ScanOptions) -> None:
        self.paths, self.field, self.options = paths, field, options
        self.tallies: dict[int, Tally] = {}
        self.documents = self.units = 0
        self._lines: dict[tuple[int, str], int] = {}  # (training input, file) -> lines read so far (a file may be in two inputs)
        self._per_path: dict[int, int] = {}

    def add(self, done: Done) -> None:
        work = done.work
        if work.kind == "end":
            if not self._per_path.get(work.path):
                raise ScanError(f"harness scan: the training input {work.file} has no document with text in field '{self.field}' "
                                "(0 documents read), so nothing could be checked against the eval sets. "
                                "Fix: check the path, its files and --field.")
            return
        base = self._lines.get((work.path, work.file), 0)
        if done.failure is not None:
            raise done.failure.error(work.file, self.field, base)
        name = Path(work.file).name
        for example, hit, ref, snippet in done.hits:
            document = ref if isinstance(ref, str) else f"{name}:{base + ref}"
            self.tallies.setdefault(example, Tally()).add(hit, document, snippet, self.options.max_locations)
        for example, ref, jaccard in done.near:
            document = ref if isinstance(ref, str) else f"{name}:{base + ref}"
            self.tallies.setdefault(example, Tally()).near.append({"document": document, "jaccard": jaccard})
        self._lines[(work.path, work.file)] = base + done.lines
        self._per_path[work.path] = self._per_path.get(work.path, 0) + done.documents
        self.documents += done.documents
        self.units += done.units


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
        f"n-grams left out).{f' Note: {result.scale_note}' if result.scale_note else ''}\n\n## Per eval set\n\n{markdown_table(summary)}\n\n## Most contaminated\n\n"
        f"{markdown_table(worst)}\n",
        encoding="utf-8",
    )
    return paths


def markdown_table(frame: Any) -> str:
    """A pandas frame as a GitHub markdown table (pandas' own needs the optional `tabulate`)."""
    from harness.report.model import md_table

    return md_table([str(c) for c in frame.columns], frame.itertuples(index=False), limit=10_000)


SAMPLE_BYTES = 1 << 16  # the start of a .txt file read to tell hard-wrapped prose


def wrapped_text_notes(train: list[str], n: int) -> list[str]:
    """A note per .txt training file that looks hard-wrapped: a .txt line is one document and n-grams never cross a
    line break, so an eval example wrapped over lines shorter than ``n`` words is missed (training, which joins the
    lines, sees it). Judged from the file's first 64 KiB: most lines shorter than ``n`` words, in blocks of several."""
    notes = []
    for path in train:
        try:
            files = [f for f in document_files(Path(path)) if f.is_file() and f.suffix.lower() == ".txt"]
        except ScanError:
            continue
        for file in files:
            try:
                with open(file, "rb") as handle:
                    sample = handle.read(SAMPLE_BYTES).decode("utf-8", errors="replace")
            except OSError:
                continue
            lines = sample.splitlines()[:-1] if len(sample) == SAMPLE_BYTES else sample.splitlines()  # no cut last line
            counts = [len(line.split()) for line in lines]
            words = sorted(c for c in counts if c)
            joined = sum(1 for a, b in zip(counts, counts[1:]) if a and b)  # a non-blank line right after another
            if len(words) >= 8 and words[len(words) // 2] < n and joined >= len(words) // 2:
                notes.append(f"{file} looks hard-wrapped (median {words[len(words) // 2]} words a line, under -n {n}): "
                             "each .txt line is one document and n-grams across line breaks are not matched, while "
                             "training joins the lines. Fix: one paragraph per line, or JSON lines with a text field.")
    return notes


def _check_out_dir(out: Path) -> None:
    """``--out`` must be a folder that can be made: said before the scan's work, not as a traceback after it."""
    if out.exists() and not out.is_dir():
        raise ScanError(f"harness scan: --out {out} is a file, not a folder. Fix: pass a folder for the report "
                        "(it is made if missing).")
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise ScanError(f"harness scan: --out {out} cannot be made ({exc.strerror or exc}). Fix: pass a folder whose "
                        "parent is a folder you can write.") from None


def _load_tokenizer(tokenizer_dir: str) -> Any:
    """The run's tokenizer from a local folder (nothing is downloaded); a folder that holds none is a clear error."""
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(tokenizer_dir, local_files_only=True)
    except Exception as exc:  # noqa: BLE001 - transformers raises many kinds; the message carries the detail
        detail = " ".join(str(exc).split())[:300]
        raise ScanError(f"harness scan: --tokenizer {tokenizer_dir} holds no tokenizer that loads ({type(exc).__name__}: "
                        f"{detail}). Fix: pass the folder the run saved its tokenizer to (tokenizer.json or "
                        "tokenizer_config.json with its files), e.g. the training output_dir.") from None


def print_scan(train: list[str], evals: list[str], field: str, tokenizer_dir: str | None, out: str, workers: int,
               options: ScanOptions, id_field: str = "id", eval_field: str | None = None, clean: Any = None) -> int:
    """`harness scan`: run, write the outputs, print the per-set summary; exit 1 when an eval example is dirty.

    ``clean`` (a ``decontaminate.CleanOptions``): also write the training data without the dirty examples, eval sets split.
    """
    from harness.tools import decontaminate

    if clean is not None:
        decontaminate.check_clean_dir(clean, train + evals, out)  # before the scan's work, not after it
    from rich.console import Console
    from rich.table import Table

    _check_out_dir(Path(out))
    tokenizer = None
    if tokenizer_dir:
        if not Path(tokenizer_dir).exists():
            raise ScanError(f"harness scan: --tokenizer {tokenizer_dir} does not exist. Fix: pass a tokenizer directory.")
        tokenizer = _load_tokenizer(tokenizer_dir)
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
    if tokenizer is None:
        for note in wrapped_text_notes(train, options.n):
            console.print(f"note: {note}", style="yellow", markup=False, highlight=False, soft_wrap=True)  # a path whole
    if clean is not None:
        written = decontaminate.write_clean(result, train, evals, field, eval_field, id_field, tokenizer, result.options, clean,
                                            near_factory=NearDuplicates, checked=True, workers=workers)
        console.print(decontaminate.summary_line(written))
    return 1 if (frame["status"] == "dirty").any() else 0
