"""Text and JSON-lines files in newline-aligned byte ranges, each read whole by the worker that scans it.

A scan worker reads its own range, so the parent sends (file, start, stop)
and gets back only the matches: no document crosses a process boundary.
A range knows its lines only locally (line 1 is its first line); the parent,
merging ranges in file order, adds the lines of the ranges before it.
A problem in a range (not UTF-8, not JSON, no text field) comes back as a
:class:`Failure` and becomes the same error, naming the file and the line,
that reading the file line by line raises (:mod:`harness.lib.documents`).
"""
from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from harness.lib.documents import ScanError, missing_field, not_json, not_text, not_utf8
from harness.lib.word_scan import ASCII_WHITESPACE, LINE_TABLE, WordChunk, documents_buffer, lines_buffer

RANGE_BYTES = 1 << 19  # bytes a worker reads per range: whole-range numpy passes whose arrays stay in cache, and balance
LINE_FILES = {".txt": "txt", ".jsonl": "jsonl", ".json": "jsonl"}


def byte_ranges(file: Path | str, size: int = RANGE_BYTES) -> list[tuple[int, int]]:
    """[start, stop) byte ranges covering ``file``, each about ``size`` bytes and ending just after a line break (or at the end)."""
    total = Path(file).stat().st_size
    ranges: list[tuple[int, int]] = []
    start = 0
    with open(file, "rb") as handle:
        while start < total:
            stop = start + max(size, 1)
            if stop < total:
                handle.seek(stop - 1)
                handle.readline()  # on to the end of the line the nominal end falls in
                stop = handle.tell()
            stop = min(stop, total)
            ranges.append((start, stop))
            start = stop
    return ranges


@dataclass
class Failure:
    """Why a range stopped: ``kind`` utf8 (byte, column), json (message), missing (keys) or type (the text field's
    type name, its value's start), at local ``line``."""

    kind: str
    line: int
    detail: tuple | None  # None for "missing": the line is not a JSON object

    def error(self, file: Path | str, field: str, line_base: int) -> ScanError:
        line = line_base + self.line
        if self.kind == "utf8":
            return not_utf8(file, line, *self.detail)
        if self.kind == "json":
            return not_json(file, line, *self.detail)
        if self.kind == "type":
            return not_text(file, line, field, *self.detail)
        return missing_field(Path(file), field, None if self.detail is None else list(self.detail), line)


@dataclass
class RangeDocuments:
    """The documents of one range: their normalised words (a segment per entry of ``refs``) and/or their texts.

    A ref is the document's id (str) or its local line number (int, 1-based in
    the range); ``segment_refs`` None means segment k is local line k + 1.
    """

    lines: int
    count: int
    buffer: bytes | None = None
    chunk: WordChunk | None = None
    segment_refs: list[int | str] | None = None
    texts: list[str] = field(default_factory=list)
    text_refs: list[int | str] = field(default_factory=list)
    failure: Failure | None = None

    def segment_ref(self, segment: int) -> int | str:
        return segment + 1 if self.segment_refs is None else self.segment_refs[segment]


def read_range(file: Path | str, start: int, stop: int, kind: str, field: str, id_field: str, words: bool,
               texts: bool) -> RangeDocuments:
    """Read one range of a .txt (a document per non-blank line) or .jsonl file; ``words``: build the normalised
    buffer, ``texts``: keep the documents' texts (token front end, near duplicates)."""
    with open(file, "rb") as handle:
        handle.seek(start)
        raw = handle.read(stop - start)
    failure = None
    if kind == "txt" and words and not texts and raw.isascii():
        return _ascii_text_range(raw)
    lines_read = raw.count(b"\n")
    ascii_only = raw.isascii()
    if not ascii_only:
        try:
            raw.decode("utf-8")
        except UnicodeDecodeError as exc:
            bad = raw.count(b"\n", 0, exc.start)
            line_start = raw.rfind(b"\n", 0, exc.start) + 1
            failure = Failure("utf8", bad + 1, (raw[exc.start], exc.start - line_start + 1))
            raw = raw[:line_start]  # the lines before it are read as usual (an earlier problem there is reported first)
    lines = raw.split(b"\n")
    if lines and not lines[-1]:
        lines.pop()
    if kind == "txt":
        return _text_range(raw, lines, ascii_only and failure is None, lines_read, failure, words, texts)
    return _jsonl_range(lines, lines_read, failure, field, id_field, words, texts)


def _ascii_text_range(raw: bytes) -> RangeDocuments:
    """The fast path: an ASCII text range, words only; lines and documents counted from the words' positions."""
    chunk = WordChunk.of(raw, LINE_TABLE)
    lines = len(chunk.breaks) + (1 if raw and not raw.endswith(b"\n") else 0)
    segment_starts = np.concatenate([np.zeros(1, dtype=np.int64), chunk.breaks + 1])
    words_per_line = np.diff(np.append(chunk.bounds, len(chunk.starts)))[:lines]
    wordless = np.flatnonzero(words_per_line == 0).tolist()  # blank, or punctuation only (still a document)
    ends = np.append(chunk.breaks, len(raw)).tolist()
    starts = segment_starts.tolist()
    count = lines - len(wordless) + sum(1 for k in wordless if raw[starts[k] : ends[k]].strip(ASCII_WHITESPACE))
    return RangeDocuments(len(chunk.breaks), count, chunk=chunk)


def _text_range(raw: bytes, lines: list[bytes], ascii_only: bool, lines_read: int, failure: Failure | None, words: bool,
                texts: bool) -> RangeDocuments:
    if ascii_only:
        documents = [k for k, line in enumerate(lines) if line.strip(ASCII_WHITESPACE)]
    else:
        documents = [k for k, line in enumerate(lines)
                     if (line.strip(ASCII_WHITESPACE) if line.isascii() else line.decode("utf-8").strip())]
    out = RangeDocuments(lines_read, len(documents), failure=failure)
    if words:
        out.buffer = raw.translate(LINE_TABLE) if ascii_only else lines_buffer(lines)
    if texts:
        out.texts = [lines[k].decode("utf-8").rstrip("\r\n") for k in documents]
        out.text_refs = [k + 1 for k in documents]
    return out


def _jsonl_range(lines: list[bytes], lines_read: int, failure: Failure | None, field: str, id_field: str, words: bool,
                 texts: bool) -> RangeDocuments:
    found: list[str] = []
    refs: list[int | str] = []
    for k, raw_line in enumerate(lines):
        line = raw_line.decode("utf-8").rstrip("\r\n")
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError as exc:
            failure = Failure("json", k + 1, (exc.msg,))
            break
        if not isinstance(record, dict) or field not in record:
            failure = Failure("missing", k + 1, tuple(map(str, record)) if isinstance(record, dict) else None)
            break
        text = record[field]
        if text is not None and not isinstance(text, str):
            failure = Failure("type", k + 1, (type(text).__name__, str(text)[:40]))
            break
        if isinstance(text, str) and text.strip():
            found.append(text)
            refs.append(str(record[id_field]) if id_field in record else k + 1)
    out = RangeDocuments(lines_read, len(found), segment_refs=refs, failure=failure)
    if words:
        out.buffer = documents_buffer(found)
    if texts:
        out.texts, out.text_refs = found, refs
    return out


def documents_of(documents: list[tuple[str, str]], words: bool, texts: bool) -> RangeDocuments:
    """A batch of (id, text) documents already read (Parquet, `datasets` folders) in the shape of a range."""
    refs: list[int | str] = [d for d, _ in documents]
    found = [t for _, t in documents]
    return RangeDocuments(0, len(found), buffer=documents_buffer(found) if words else None, segment_refs=refs,
                          texts=found if texts else [], text_refs=refs if texts else [])
