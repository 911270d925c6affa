"""`harness scan --write-clean DIR`: a copy of the training data without the dirty eval examples, and the eval sets split.

After the scan has judged every eval example, a second pass reads the
training inputs again against the same n-gram index, counting only matches
of the examples judged ``dirty``. A training document with such a match is
dropped, or, with ``--mask-spans``, the matched spans are cut out of its
original text with a margin (lm-eval's janitor: 200 characters, more than 10
cuts drop the document). The copy keeps each input's format and relative
layout under ``DIR/train``; each eval set is split into
``DIR/eval/<name>.clean.<ext>`` and ``<name>.dirty.<ext>``;
``DIR/decontamination.md`` and ``.json`` say what was removed.

The index holds every eval example, as the scan's does, so n-grams shared by
many examples (prompt templates) are left out here as they were there; a
document is judged on its matches of dirty examples only.
"""
from __future__ import annotations

import json
from collections import Counter, deque
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from harness.lib.documents import ScanError, document_files
from harness.lib.ngrams import Hit, NgramIndex
from harness.lib.ordered_pool import OrderedPool
from harness.lib.overlap import FrontEnd, ScanOptions, eval_set_names, load_eval_examples
from harness.lib.records import Record, RecordWriter, iter_records, output_suffix
from harness.lib.safe_paths import UnsafePathError, safe_mkdir, safe_open_write, safe_rmtree, safe_target, safe_write_text
from harness.lib.spans import cut_spans, word_char_spans

REPORT_IDS = 200  # dropped ids listed in decontamination.md (all of them are in decontamination.json)


@dataclass(frozen=True)
class CleanOptions:
    """Where the clean copy goes and how a dirty document is treated."""

    out: Path
    mask_spans: bool = False
    margin: int = 200
    max_spans: int = 10
    force: bool = False


@dataclass
class FileStats:
    """One training file: documents read, kept unchanged, kept with spans cut, dropped (and why)."""

    source: str
    output: str
    documents: int = 0
    kept: int = 0
    masked: int = 0
    dropped: int = 0
    spans_cut: int = 0
    chars_removed: int = 0
    reasons: dict[str, int] = field(default_factory=dict)


@dataclass
class EvalStats:
    source: str
    clean: str
    dirty: str
    examples: int = 0
    to_dirty: int = 0


@dataclass
class Decontamination:
    out: Path
    options: CleanOptions
    train: list[FileStats]
    evals: list[EvalStats]
    dropped: list[dict[str, Any]]
    masked: list[dict[str, Any]]
    notes: list[str]
    paths: dict[str, Path]

    @property
    def totals(self) -> dict[str, int]:
        keys = ("documents", "kept", "masked", "dropped", "spans_cut", "chars_removed")
        return {k: sum(getattr(f, k) for f in self.train) for k in keys}


# -- before the scan: is DIR a place we may write? ----------------------------------------------------


def check_clean_dir(options: CleanOptions, inputs: list[str], report_dir: str | None = None) -> None:
    """Refuse DIR when it is a link, not empty (without --force), inside an input or holding one: before any work."""
    out = Path(options.out)
    for name in ("", "train", "eval", "decontamination.md", "decontamination.json"):  # what write_clean replaces
        if (out / name if name else out).is_symlink():
            raise UnsafePathError(f"harness scan: --write-clean {out}{'/' + name if name else ''} is a symlink; nothing is "
                                  "written or deleted through a link. Fix: replace the link with a real folder, or pass a new DIR.")
    safe_target(out, out)  # the same checks again where every write happens
    if out.exists() and not out.is_dir():
        raise ScanError(f"harness scan: --write-clean {out} is a file. Fix: pass a new or empty folder.")
    resolved = out.resolve()
    for path in inputs:
        source = Path(path).resolve()
        if resolved == source or resolved.is_relative_to(source):
            raise ScanError(f"harness scan: --write-clean {out} is inside the input {path}, which it must never overwrite "
                            "(and a rescan of the input would read the copy). Fix: pass a folder outside every --train and --eval path.")
        if source.is_relative_to(resolved):
            raise ScanError(f"harness scan: the input {path} lies inside --write-clean {out}, whose contents are replaced. "
                            "Fix: pass a folder that holds no input.")
    if report_dir is not None:
        report = Path(report_dir).resolve()
        if any(report == resolved / part or report.is_relative_to(resolved / part) for part in ("train", "eval")):
            raise ScanError(f"harness scan: --out {report_dir} lies inside {out}/train or {out}/eval, where the report would "
                            "be read as data on a rescan. Fix: pass another --out (e.g. DIR/report).")
    if out.is_dir() and any(out.iterdir()) and not options.force:
        raise ScanError(f"harness scan: --write-clean {out} is not empty. Fix: pass an empty or new folder, or --force to "
                        f"replace {out}/train, {out}/eval and the decontamination report in it.")


# -- the second pass -----------------------------------------------------------------------------------------


class _Judge:
    """Decides, for one training document, keep / cut / drop, against the matches of dirty examples only."""

    def __init__(self, index: NgramIndex, dirty: set[int], front: FrontEnd, scan_options: ScanOptions,
                 options: CleanOptions, near: Any = None) -> None:
        self.index, self.dirty, self.front, self.options, self.near = index, dirty, front, options, near
        self.min_words = scan_options.n

    def hits(self, text: str) -> tuple[list[Hit], Any]:
        units, words = self.front.document(text)
        return [h for h in self.index.query(units) if h.example in self.dirty], units

    def near_dirty(self, text: str) -> bool:
        return self.near is not None and any(e in self.dirty for e, _ in self.near.query(text))

    def decide(self, text: str) -> tuple[str, str | None, int, int]:
        """(reason, new text, spans cut, chars removed); reason '' keeps the document as it is."""
        hits, units = self.hits(text)
        near = self.near_dirty(text)
        if not hits and not near:
            return "", text, 0, 0
        if not self.options.mask_spans:
            return "match" if hits else "near_duplicate", None, 0, len(text)
        if near:
            return "near_duplicate", None, 0, len(text)  # a lightly edited copy has no span to cut
        matches = self._char_ranges(text, units, hits)
        if matches is None:
            return "unmapped", None, 0, len(text)
        cut = cut_spans(text, matches, self.options.margin, self.options.max_spans, self.min_words)
        if cut.text is None:
            return cut.reason, None, len(cut.ranges), len(text)
        if self.hits(cut.text)[0] or self.near_dirty(cut.text):  # the joins made a match again: never write it
            return "still_dirty", None, len(cut.ranges), len(text)
        return "masked", cut.text, len(cut.ranges), len(text) - len(cut.text)

    def _char_ranges(self, text: str, units: Any, hits: list[Hit]) -> list[tuple[int, int]] | None:
        """Char ranges of the original text the hits cover; None when units cannot be mapped to chars exactly."""
        runs: list[tuple[int, int]] = []
        for hit in sorted(hits, key=lambda h: h.position):
            end = hit.position + hit.length
            if runs and hit.position <= runs[-1][1]:
                runs[-1] = (runs[-1][0], max(runs[-1][1], end))
            else:
                runs.append((hit.position, end))
        spans = self._unit_spans(text, units)
        if spans is None or len(spans) != len(units):
            return None
        return [(spans[a][0], spans[b - 1][1]) for a, b in runs]

    def _unit_spans(self, text: str, units: Any) -> list[tuple[int, int]] | None:
        tokenizer = self.front.tokenizer
        if tokenizer is None:
            return word_char_spans(text)
        try:
            encoded = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
        except (NotImplementedError, ValueError, TypeError):  # a slow tokenizer has no offsets
            return None
        if list(encoded["input_ids"]) != [int(u) for u in units]:
            return None
        return [(int(a), int(b)) for a, b in encoded["offset_mapping"]]


def write_clean(result: Any, train: list[str], evals: list[str], field: str, eval_field: str | None, id_field: str,
                tokenizer: Any, scan_options: ScanOptions, options: CleanOptions,
                near_factory: Callable[[list[Any], ScanOptions], Any] | None = None, progress: bool = True,
                checked: bool = False, workers: int = 1, every_document: bool = False) -> Decontamination:
    """The clean copy of ``train`` and the split of ``evals`` under ``options.out``, from a scan's ``result``.

    ``checked``: :func:`check_clean_dir` already ran before the scan (which may have written its report inside DIR).
    ``every_document``: judge every document again even when the scan located all matches (the tests use it).
    """
    out = Path(options.out)
    if not checked:
        check_clean_dir(options, train + evals)
    front = FrontEnd(tokenizer)
    examples = load_eval_examples(evals, eval_field or field, front, id_field)
    if [(e.eval_set, e.example_id) for e in examples] != [(r["eval_set"], r["id"]) for r in result.rows]:
        raise ScanError("harness scan: the eval sets changed between the scan and --write-clean (other examples read). "
                        "Fix: run the scan again on files that are not being written.")
    dirty = {e for e, row in enumerate(result.rows) if row["status"] == "dirty"}
    index = NgramIndex.build(examples, scan_options.n, scan_options.template_min_examples, scan_options.min_length)
    near = near_factory(examples, scan_options) if near_factory is not None and scan_options.near_dup else None
    judge = _Judge(index, dirty, front, scan_options, options, near)
    safe_mkdir(out, out)
    for part in ("train", "eval"):
        safe_rmtree(out, out / part)
    notes: list[str] = []
    dropped: list[dict[str, Any]] = []
    masked: list[dict[str, Any]] = []
    stats: list[FileStats] = []
    candidates = None if every_document else located_documents(result.rows, dirty)
    notes.append("only the documents the scan located for the dirty examples were judged again (it located every one)"
                 if candidates is not None else "every training document was judged again")
    with _Deciders(judge, workers) as deciders, _progress(progress) as bar:  # workers fork before the bar's thread
        task = bar.add_task("writing the clean training data", total=result.documents or None)
        for source, target in _layout(train, out / "train"):
            if source.is_dir():
                notes.append(f"{source} (a `datasets` folder) was written as JSON lines to {target}.")
            file_stats = FileStats(str(source), str(target))
            with safe_open_write(out, target) as handle:
                writer = RecordWriter(handle, source, field)
                for chunk, decisions in deciders.map(_chunks(iter_records(source, field, id_field), candidates)):
                    for record, decision in zip(chunk, decisions):
                        if record.text is None:
                            writer.write(record)
                            continue
                        file_stats.documents += 1
                        _count(file_stats, record, *decision, writer, dropped, masked)
                    bar.update(task, advance=sum(r.text is not None for r in chunk))
                writer.close()
            stats.append(file_stats)
    eval_stats = _split_evals(evals, out / "eval", out, result.rows, eval_field or field, id_field)
    report = Decontamination(out, options, stats, eval_stats, dropped, masked, notes, {})
    report.paths = _write_report(report, result)
    return report


def located_documents(rows: list[dict[str, Any]], dirty: set[int]) -> set[str] | None:
    """Ids of every training document that matched a dirty example, when the scan's capped locations name them all.

    A row lists its first ``max_locations`` documents out of ``documents_hit``
    (near duplicates likewise); when no dirty example has more, the documents
    to judge are known and every other one is copied without being read as
    units. None: some are not named, so every document is judged. A shared id
    (``a.txt:3`` in two folders) only adds documents to judge, never hides one.
    """
    ids: set[str] = set()
    for e in dirty:
        row = rows[e]
        located = {str(d["document"]) for d in row.get("locations") or []}
        near = {str(d["document"]) for d in row.get("near_duplicate_documents") or []}
        if int(row.get("documents_hit") or 0) > len(located) or int(row.get("near_duplicates") or 0) > len(near):
            return None
        ids |= located | near
    return ids


Decision = tuple[str, "str | None", int, int]
_KEEP: Decision = ("", None, 0, 0)
_CHUNK = 512


def _chunks(records: Iterator[Record], candidates: set[str] | None) -> Iterator[tuple[list[Record], list[int]]]:
    """Records in chunks, with the positions in each chunk of the documents to judge."""
    chunk: list[Record] = []
    for record in records:
        chunk.append(record)
        if len(chunk) >= _CHUNK:
            yield chunk, _to_judge(chunk, candidates)
            chunk = []
    if chunk:
        yield chunk, _to_judge(chunk, candidates)


def _to_judge(chunk: list[Record], candidates: set[str] | None) -> list[int]:
    return [i for i, r in enumerate(chunk) if r.text is not None and (candidates is None or r.id in candidates)]


def _decide_all(judge: _Judge, texts: list[str]) -> list[Decision]:
    return [judge.decide(text) for text in texts]


class _Deciders:
    """Decisions for chunks of records, in order: here, or in ``workers`` processes that each hold the judge
    (``OrderedPool``, the scan's own: started on entering, before the progress bar's thread)."""

    def __init__(self, judge: _Judge, workers: int) -> None:
        self.judge = judge
        self.pool = OrderedPool(_decide_all, judge, workers) if workers > 1 else None

    def __enter__(self) -> "_Deciders":
        if self.pool is not None:
            self.pool.__enter__()
        return self

    def __exit__(self, *exc: Any) -> None:
        if self.pool is not None:
            self.pool.__exit__(*exc)

    def map(self, chunks: Iterator[tuple[list[Record], list[int]]]) -> Iterator[tuple[list[Record], list[Decision]]]:
        if self.pool is None:
            for chunk, judged in chunks:
                yield _ready(chunk, judged, _decide_all(self.judge, [chunk[i].text or "" for i in judged]))
            return
        sent: deque[tuple[list[Record], list[int]]] = deque()  # the chunks whose texts the pool has, in order

        def texts() -> Iterator[list[str]]:
            for chunk, judged in chunks:
                sent.append((chunk, judged))
                yield [chunk[i].text or "" for i in judged]

        for decisions in self.pool.map(texts()):
            yield _ready(*sent.popleft(), decisions)


def _ready(chunk: list[Record], judged: list[int], decisions: list[Decision]) -> tuple[list[Record], list[Decision]]:
    out = [_KEEP] * len(chunk)
    for i, decision in zip(judged, decisions):
        out[i] = decision
    return chunk, out


def _count(stats: FileStats, record: Record, reason: str, text: str | None, spans: int, removed: int, writer: RecordWriter,
           dropped: list[dict[str, Any]], masked: list[dict[str, Any]]) -> None:
    if not reason:
        stats.kept += 1
        writer.write(record)
        return
    stats.reasons[reason] = stats.reasons.get(reason, 0) + 1
    stats.spans_cut += spans if text is not None else 0
    stats.chars_removed += removed
    if text is None:
        stats.dropped += 1
        dropped.append({"id": record.id, "file": stats.source, "reason": reason, "chars": removed})
    else:
        stats.masked += 1
        masked.append({"id": record.id, "file": stats.source, "spans": spans, "chars_removed": removed})
        writer.write(record, text)


def _layout(inputs: list[str], root: Path) -> Iterator[tuple[Path, Path]]:
    """(input file, its copy's path): a file input keeps its name, a folder its name and the layout below it."""
    used: Counter[str] = Counter()
    for path in inputs:
        path = Path(path)
        base = _unique(path.stem if path.is_file() else path.name, used, path.suffix if path.is_file() else "")
        for file in document_files(path):
            if file == path and path.is_file():
                yield file, root / base
            elif file == path:  # a `datasets` folder
                yield file, root / f"{base}{output_suffix(file)}"
            else:
                relative = file.relative_to(path)
                yield file, root / base / relative.with_suffix(output_suffix(file))


def _unique(stem: str, used: Counter[str], suffix: str) -> str:
    """``stem``+``suffix``, or with -2, -3 ... when an earlier input took that name."""
    used[stem + suffix] += 1
    count = used[stem + suffix]
    return f"{stem}{suffix}" if count == 1 else f"{stem}-{count}{suffix}"


def _split_evals(evals: list[str], root: Path, out: Path, rows: list[dict[str, Any]], field: str, id_field: str) -> list[EvalStats]:
    """Each eval file as <name>.clean.<ext> (everything not dirty) and <name>.dirty.<ext>, rows paired in scan order."""
    stats: list[EvalStats] = []
    row = 0
    for path, name in zip(map(Path, evals), eval_set_names(evals)):  # the names the scan's report gives them
        for file in document_files(path):
            stem = Path(name) if file == path else Path(name) / file.relative_to(path).with_suffix("")
            suffix = output_suffix(file)
            clean, dirty = root / f"{stem}.clean{suffix}", root / f"{stem}.dirty{suffix}"
            entry = EvalStats(str(file), str(clean), str(dirty))
            with safe_open_write(out, clean) as clean_handle, safe_open_write(out, dirty) as dirty_handle:
                writers = {"clean": RecordWriter(clean_handle, file, field), "dirty": RecordWriter(dirty_handle, file, field)}
                for record in iter_records(file, field, id_field):
                    status = "clean"
                    if record.text is not None:
                        if row >= len(rows) or rows[row]["id"] != record.id:
                            raise ScanError(f"harness scan: {file} changed between the scan and --write-clean (record {record.id}). "
                                            "Fix: run the scan again on files that are not being written.")
                        status = "dirty" if rows[row]["status"] == "dirty" else "clean"
                        row += 1
                        entry.examples += 1
                        entry.to_dirty += status == "dirty"
                    writers[status].write(record)
                for writer in writers.values():
                    writer.close()
            stats.append(entry)
    return stats


def _progress(enabled: bool) -> Any:
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    return Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TextColumn("documents"),
                    TimeElapsedColumn(), disable=not enabled, transient=False)


# -- the report ---------------------------------------------------------------------------------------------


def _write_report(report: Decontamination, result: Any) -> dict[str, Path]:
    from harness.report.model import md_table

    out = report.out
    totals = report.totals
    data = {
        "options": {k: str(v) if isinstance(v, Path) else v for k, v in asdict(report.options).items()},
        "front_end": result.front_end, "totals": totals, "train": [asdict(f) for f in report.train],
        "eval": [asdict(e) for e in report.evals], "dropped": report.dropped, "masked": report.masked, "notes": report.notes,
    }
    paths = {"json": out / "decontamination.json", "markdown": out / "decontamination.md"}
    safe_write_text(out, paths["json"], json.dumps(data, indent=1) + "\n")
    mode = (f"matched spans cut with a {report.options.margin}-character margin (more than {report.options.max_spans} cuts, "
            "or too little left, drops the document)" if report.options.mask_spans else "documents with a match dropped")
    train_rows = [(f.source, f.output, f.documents, f.kept, f.masked, f.dropped, f.spans_cut, f.chars_removed,
                   ", ".join(f"{k}: {v}" for k, v in sorted(f.reasons.items())) or "-") for f in report.train]
    eval_rows = [(e.source, e.examples, e.examples - e.to_dirty, e.to_dirty, e.clean, e.dirty) for e in report.evals]
    listed = report.dropped[:REPORT_IDS]
    left = len(report.dropped) - REPORT_IDS
    more = f"\n\n... and {left:,} more (all in decontamination.json)." if left > 0 else ""
    text = (
        f"# Decontamination\n\n{totals['documents']:,} training documents read: {totals['kept']:,} kept unchanged, "
        f"{totals['masked']:,} kept with {totals['spans_cut']:,} spans cut, {totals['dropped']:,} dropped; "
        f"{totals['chars_removed']:,} characters removed. Mode: {mode}; matches of the "
        f"{sum(e.to_dirty for e in report.evals):,} dirty eval examples only ({result.front_end}).\n\n"
        "## Training files\n\n"
        + md_table(["input", "written to", "documents", "unchanged", "masked", "dropped", "spans cut", "chars removed", "why"], train_rows)
        + "\n\n## Eval sets\n\n"
        + md_table(["eval file", "examples", "clean", "dirty", "clean file", "dirty file"], eval_rows)
        + "\n\n## Dropped documents\n\n"
        + (md_table(["id", "file", "why"], [(d["id"], d["file"], d["reason"]) for d in listed]) if listed else "none")
        + more + "\n"
        + ("\n## Notes\n\n" + "".join(f"- {n}\n" for n in report.notes) if report.notes else "")
    )
    safe_write_text(out, paths["markdown"], text)
    return paths


def summary_line(report: Decontamination) -> str:
    """The one console line: what was written and what was removed."""
    t = report.totals
    cut = f", {t['masked']:,} with {t['spans_cut']:,} spans cut" if report.options.mask_spans else ""
    dirty = sum(e.to_dirty for e in report.evals)
    return (f"clean copy: {report.out}/train ({t['kept'] + t['masked']:,} of {t['documents']:,} training documents kept{cut}; "
            f"{t['dropped']:,} dropped, {t['chars_removed']:,} characters removed), {report.out}/eval "
            f"({dirty:,} dirty eval examples split off); report: {report.paths['markdown']}")
