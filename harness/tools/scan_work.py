"""One unit of `harness scan` work, run in a worker: a byte range of a text file, or a batch of documents read already.

A worker reads its range itself, turns all of its documents into units at
once (words: :class:`harness.lib.word_scan.WordChunk`; tokens: one batched
tokenizer call), looks every window up in the index with windows kept inside
their document (:meth:`NgramIndex.query_segments`), and sends back only the
hits. A words hit must also have the eval example's exact words, so not even
a collision of the 64-bit word hashes can be reported as a match.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from itertools import chain
from typing import Any

import numpy as np

from harness.lib.ngrams import Hit, NgramIndex
from harness.lib.overlap import FrontEnd
from harness.lib.text_ranges import Failure, RangeDocuments, documents_of, read_range
from harness.lib.word_scan import WordChunk, normalise_words


@dataclass
class Work:
    """A range [start, stop) of a .txt/.jsonl ``file`` (kind txt/jsonl), a batch of ``documents`` (kind docs), or the
    end of training path ``path`` (kind end: the parent checks it had documents)."""

    path: int
    file: str
    kind: str
    start: int = 0
    stop: int = 0
    documents: list[tuple[str, str]] | None = None


@dataclass
class Done:
    """What a worker found in one :class:`Work`; refs are ids, or local line numbers the parent turns into ``file:line``."""

    work: Work
    lines: int = 0
    documents: int = 0
    units: int = 0
    hits: list[tuple[int, Hit, int | str, str]] = field(default_factory=list)
    near: list[tuple[int, int | str, float]] = field(default_factory=list)
    failure: Failure | None = None


class Scanner:
    """The index, front end and options one worker scans with (built once per process)."""

    def __init__(self, index: NgramIndex, front: FrontEnd, field: str, id_field: str, snippet_chars: int, near: Any = None) -> None:
        self.index, self.front, self.field, self.id_field = index, front, field, id_field
        self.snippet_chars, self.near = snippet_chars, near
        self._words: dict[int, list[bytes]] = {}

    def run(self, work: Work) -> Done:
        if work.kind == "end":
            return Done(work)
        words = self.front.tokenizer is None
        texts = not words or self.near is not None
        if work.kind == "docs":
            documents = documents_of(work.documents or [], words, texts)
        else:
            documents = read_range(work.file, work.start, work.stop, work.kind, self.field, self.id_field, words, texts)
        done = Done(work, documents.lines, documents.count, failure=documents.failure)
        if words:
            self._words_hits(documents, done)
        else:
            self._token_hits(documents, done)
        if self.near is not None:
            done.near = [(e, ref, jaccard) for text, ref in zip(documents.texts, documents.text_refs)
                         for e, jaccard in self.near.query(text)]
        return done

    def _words_hits(self, documents: RangeDocuments, done: Done) -> None:
        chunk = documents.chunk if documents.chunk is not None else WordChunk.of(documents.buffer or b"")
        done.units = len(chunk.units)
        for hit in self.index.query_segments(chunk.units, chunk.bounds):
            window = chunk.words(int(chunk.bounds[hit.row]) + hit.position, hit.length)
            expected = self._example_words(hit.example)
            if expected is not None and window != expected[hit.offset : hit.offset + hit.length]:
                continue  # equal word hashes, other words
            done.hits.append((hit.example, hit, documents.segment_ref(hit.row), b" ".join(window).decode("utf-8")[: self.snippet_chars]))

    def _example_words(self, example: int) -> list[bytes] | None:
        if example not in self._words:
            text = self.index.examples[example].text
            if text is None:
                return None
            self._words[example] = [w.encode("utf-8") for w in normalise_words(text)]
        return self._words[example]

    def _token_hits(self, documents: RangeDocuments, done: Done) -> None:
        if not documents.texts:
            return
        tokenizer = self.front.tokenizer
        ids = tokenizer(documents.texts, add_special_tokens=False)["input_ids"]
        lengths = np.fromiter((len(row) for row in ids), dtype=np.int64, count=len(ids))
        units = np.fromiter(chain.from_iterable(ids), dtype=np.int64, count=int(lengths.sum()))
        bounds = np.concatenate([np.zeros(1, dtype=np.int64), np.cumsum(lengths)[:-1]])
        done.units = len(units)
        for hit in self.index.query_segments(units, bounds):
            start = int(bounds[hit.row]) + hit.position
            snippet = tokenizer.decode(units[start : start + hit.length].tolist())[: self.snippet_chars]
            done.hits.append((hit.example, hit, documents.text_refs[hit.row], snippet))
