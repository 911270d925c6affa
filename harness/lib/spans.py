"""Cutting matched spans out of the original text of a document, with a margin, as lm-eval's janitor does.

Matches are found on normalised words (or token ids); the cut is made in the
original text. :func:`word_char_spans` finds every normalised word's place in
the original, consistently with ``normalise_words`` (NFKC, lower case,
``[\\W_]+`` as separators), and says None when it cannot be exact (NFKC joins
or splits words across a separator, a combining mark after a letter ...):
the caller then drops the document rather than cut the wrong text.
"""
from __future__ import annotations

import bisect
import re
from dataclasses import dataclass

from harness.lib.ngrams import normalise_words

_WORD = re.compile(r"[^\W_]+", re.UNICODE)


def word_char_spans(text: str) -> list[tuple[int, int]] | None:
    """(start, end) in ``text`` of each word of ``normalise_words(text)``, or None when no exact mapping exists.

    A run of word characters of the original that normalises to several words
    gives each of them the whole run (a cut then takes the whole run, never
    less than the word).
    """
    runs = [(m.start(), m.end()) for m in _WORD.finditer(text)]
    if text.isascii():  # NFKC and lower() keep ASCII as it is: one run, one word (checked all the same)
        return runs if [text[a:b].lower() for a, b in runs] == normalise_words(text) else None
    spans: list[tuple[int, int]] = []
    words: list[str] = []
    for start, end in runs:
        parts = normalise_words(text[start:end])
        words += parts
        spans += [(start, end)] * len(parts)
    return spans if words == normalise_words(text) else None


@dataclass
class Cut:
    """What cutting did to one document: the new text (None: drop it), the ranges cut and why it was dropped."""

    text: str | None
    ranges: list[tuple[int, int]]
    removed: int
    reason: str = ""


def cut_spans(text: str, matches: list[tuple[int, int]], margin: int, max_spans: int, min_words: int) -> Cut:
    """Cut each matched char range, widened by ``margin`` chars on each side to whole words, out of ``text``.

    Overlapping cuts merge; more than ``max_spans`` cuts, or fewer than
    ``min_words`` words left, drops the document. The pieces left are joined by
    one space (a .txt document stays one line).
    """
    runs = [(m.start(), m.end()) for m in _WORD.finditer(text)]
    ranges: list[tuple[int, int]] = []
    for start, end in sorted(matches):
        start, end = _widen(runs, max(0, start - margin), min(len(text), end + margin))
        if ranges and start <= ranges[-1][1]:
            ranges[-1] = (ranges[-1][0], max(ranges[-1][1], end))
        else:
            ranges.append((start, end))
    removed = sum(end - start for start, end in ranges)
    if len(ranges) > max_spans:
        return Cut(None, ranges, removed, "too_many_spans")
    pieces, previous = [], 0
    for start, end in ranges:
        pieces.append(text[previous:start])
        previous = end
    pieces.append(text[previous:])
    kept = [p.rstrip() if i == 0 else p.lstrip() if i == len(pieces) - 1 else p.strip() for i, p in enumerate(pieces)]
    cleaned = " ".join(p for p in kept if p)
    if len(normalise_words(cleaned)) < max(min_words, 1):
        return Cut(None, ranges, removed, "too_little_left")
    return Cut(cleaned, ranges, removed)


def _widen(runs: list[tuple[int, int]], start: int, end: int) -> tuple[int, int]:
    """The range grown so that no word of the original is cut in two."""
    i = bisect.bisect_right(runs, (start, 1 << 62)) - 1
    if i >= 0 and runs[i][0] < start < runs[i][1]:
        start = runs[i][0]
    j = bisect.bisect_right(runs, (end, 1 << 62)) - 1
    if j >= 0 and runs[j][0] < end < runs[j][1]:
        end = runs[j][1]
    return start, end
