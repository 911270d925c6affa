"""Judging overlap between eval examples and training data: text to units, per-example tallies, the verdict row.

The thresholds and the judging are shared by ``harness scan``
(:mod:`harness.tools.scan`) and the ``contamination`` plugin, so a scan
before training and the plugin during it call the same example dirty.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import numpy as np

from harness.lib.copied_spans import CopiedSpans, copied_spans, crossing_windows
from harness.lib.documents import MissingFieldError, ScanError, iter_documents, unique_names
from harness.lib.ngrams import EvalExample, Hit, NgramIndex, normalise_words, word_units
from harness.lib.word_scan import WordChunk, documents_buffer


@dataclass(frozen=True)
class ScanOptions:
    """How matches are counted and judged (the same thresholds the `contamination` plugin uses)."""

    n: int = 13
    template_min_examples: int = 10
    dirty_fraction: float = 0.5
    partial_fraction: float = 0.0
    dirty_span: int = 32  # a training span of this many units makes an example dirty whatever its fraction (0: off)
    scale_to_text: bool = True  # token thresholds scaled up for a tokenizer with short tokens (scaled_to_text)
    max_locations: int = 5
    snippet_chars: int = 160
    min_length: int = 4
    near_dup: bool = False
    near_dup_threshold: float = 0.8
    shingle: int = 5
    num_perm: int = 128


# -- thresholds counted in text ------------------------------------------------------------------------------

REFERENCE_CHARS_PER_UNIT = 4.0  # English through a 32k-50k token BPE vocabulary (GPT-2's, Llama's): what n and dirty_span count
MIN_TEXT_SCALE = 1.25  # a tokenizer within this factor of the reference keeps n and dirty_span as given
MAX_TEXT_SCALE = 8.0  # bytes or characters of a script with long words: no more than this
TEXT_SAMPLE = 256  # eval examples measured (evenly spread, so every rank measures the same ones)


@dataclass(frozen=True)
class TextScale:
    """How many characters of eval text a token holds, and the factor ``n`` and ``dirty_span`` were scaled by."""

    chars_per_unit: float
    factor: float

    def line(self, given: ScanOptions, scaled: ScanOptions, how_to_keep: str) -> str:
        """The one line that says the thresholds were scaled, and how to keep them as given."""
        span = f" and a dirty span as {scaled.dirty_span} instead of {given.dirty_span}" if given.dirty_span else ""
        return (f"the tokenizer holds {self.chars_per_unit:.1f} characters of eval text per token (about "
                f"{REFERENCE_CHARS_PER_UNIT:g} is usual), so n-grams count {scaled.n} tokens instead of {given.n}{span}: "
                f"about the text that many tokens hold with a usual tokenizer, not a few words any template repeats. "
                f"To count tokens as given: {how_to_keep}.")


def eval_chars_per_unit(examples: list[EvalExample], decode: Any = None) -> float | None:
    """Characters of eval text per unit over an even sample of the examples (their text, else their units decoded
    with ``decode``); None when nothing could be measured."""
    if not examples:
        return None
    chars = units = 0
    for example in examples[:: max(1, len(examples) // TEXT_SAMPLE)][:TEXT_SAMPLE]:
        ids = example.variants[0] if example.variants else None
        if ids is None or not len(ids):
            continue
        text = example.text
        if text is None and decode is not None:
            try:
                text = str(decode([int(t) for t in ids]))
            except Exception:  # noqa: BLE001 - a tokenizer that cannot decode its own ids: not measured
                text = None
        if text is None:
            continue
        chars += len(text.strip())
        units += len(ids)
    return chars / units if units and chars else None


def scaled_to_text(options: ScanOptions, chars_per_unit: float | None) -> tuple[ScanOptions, TextScale | None]:
    """``options`` with ``n`` and ``dirty_span`` scaled up to hold about the text they hold with a usual tokenizer,
    when the eval text's tokens are much shorter (a small vocabulary, bytes, characters); else ``options`` as given.

    A 13-gram of a 512-token vocabulary is three or four words, which sentence templates share; the same 13 tokens of
    GPT-2's vocabulary are about ten words. Never scaled down: a long-token vocabulary keeps the thresholds given.
    """
    if not options.scale_to_text or chars_per_unit is None or chars_per_unit <= 0:
        return options, None
    factor = min(REFERENCE_CHARS_PER_UNIT / chars_per_unit, MAX_TEXT_SCALE)
    if factor < MIN_TEXT_SCALE:
        return options, None
    scaled = replace(options, n=math.ceil(options.n * factor), dirty_span=math.ceil(options.dirty_span * factor))
    return scaled, TextScale(round(chars_per_unit, 2), round(factor, 2))


# -- front ends: text -> units ---------------------------------------------------------------------------


class FrontEnd:
    """Turns text into unit sequences: normalised words (no tokenizer) or the run's token ids."""

    def __init__(self, tokenizer: Any = None) -> None:
        self.tokenizer = tokenizer
        self.kind = "tokens" if tokenizer is not None else "words"

    def eval_variants(self, text: str) -> list[np.ndarray]:
        """Token ids as the text starts a document and as it follows a space mid-document; or its words."""
        if self.tokenizer is None:
            return [word_units(normalise_words(text))]
        plain = self._ids(text)
        spaced = self._ids(" " + text.lstrip())
        return [plain] if np.array_equal(plain, spaced) else [plain, spaced]

    def eval_variants_many(self, texts: list[str]) -> list[list[np.ndarray]]:
        """``eval_variants`` of many texts; words: all hashed in one chunk (the same units, without a call per text)."""
        if self.tokenizer is not None or not texts:
            return [self.eval_variants(text) for text in texts]
        chunk = WordChunk.of(documents_buffer(texts))
        return [[units] for units in np.split(chunk.units, chunk.bounds[1:])]

    def document(self, text: str) -> tuple[np.ndarray, list[str] | None]:
        if self.tokenizer is None:
            words = normalise_words(text)
            return word_units(words), words
        return self._ids(text), None

    def _ids(self, text: str) -> np.ndarray:
        return np.asarray(self.tokenizer(text, add_special_tokens=False)["input_ids"], dtype=np.int64)


def eval_set_names(paths: list[str]) -> list[str]:
    """Each eval set's name: its file stem (a folder's name), made distinct when two share one (-2, -3 ...), as
    ``--write-clean`` names their split files."""
    return unique_names([Path(p).stem if Path(p).is_file() else Path(p).name for p in paths])


def load_eval_examples(paths: list[str], field: str, front: FrontEnd, id_field: str = "id") -> list[EvalExample]:
    """Every eval example of every path; an eval set without usable text is an error naming the file and field."""
    examples: list[EvalExample] = []
    for path, name in zip(paths, eval_set_names(paths)):
        before = len(examples)
        try:
            found = list(iter_documents(path, field, id_field))
        except MissingFieldError as exc:
            raise exc.with_fix("pass --eval-field with the name of the eval sets' text field") from None
        variants = front.eval_variants_many([text for _, text in found])
        examples += [EvalExample(name, example_id, text, units) for (example_id, text), units in zip(found, variants)]
        if len(examples) == before:
            raise ScanError(f"harness scan: the eval set {path} has no example with text in field '{field}'. "
                            "Fix: check the file and --field.")
    return examples


# -- matching: per-example tallies -------------------------------------------------------------------------


@dataclass
class Tally:
    """What the training data matched of one eval example."""

    matched: dict[int, set[int]] = field(default_factory=dict)  # variant -> matched window offsets
    row_starts: dict[int, set[int]] = field(default_factory=dict)  # variant -> matched windows that start a training row
    row_ends: dict[int, set[int]] = field(default_factory=dict)  # variant -> matched windows that end a training row
    documents: set[str] = field(default_factory=set)
    locations: list[dict[str, Any]] = field(default_factory=list)
    near: list[dict[str, Any]] = field(default_factory=list)  # training documents that are near-duplicates of the example

    def note(self, hit: Hit) -> None:
        """The window ``hit`` matched, and whether it sits at its training row's edge (where training may cut a copy)."""
        self.matched.setdefault(hit.variant, set()).add(hit.offset)
        if hit.row_start:
            self.row_starts.setdefault(hit.variant, set()).add(hit.offset)
        if hit.row_end:
            self.row_ends.setdefault(hit.variant, set()).add(hit.offset)

    def add(self, hit: Hit, document: str, snippet: str, max_locations: int) -> None:
        self.note(hit)
        if document not in self.documents:
            self.documents.add(document)
            if len(self.locations) < max_locations:
                self.locations.append({"document": document, "position": hit.position, "snippet": snippet})


def judge(index: NgramIndex, e: int, tally: Tally | None, options: ScanOptions) -> dict[str, Any]:
    """The report row of one eval example: fractions, training spans, documents, status.

    A single example is judged on the share of its n-grams seen in training. A row that joins lines or documents
    (``harness.lib.copied_spans``: the n-grams across its boundaries count neither way) is judged on the larger of
    that share and the share of its tokens that training copied (whole lines inside training spans, spans of
    ``dirty_span`` units), since a copied line cut by a training block loses the n-grams across the cut but not its
    tokens (``judged_share`` says which share it is); and a training span of ``dirty_span`` units makes it dirty
    whatever its fractions (a single example's long span may be template text its few siblings share).
    """
    example = index.examples[e]
    best, longest, by_span = None, 0, False
    for v, units in enumerate(example.variants):
        offsets = sorted((tally.matched.get(v) or set()) if tally else set())
        window = min(index.n, len(units))
        if not index.windows_of(e, v):
            continue
        cuts = example.cuts_of(v)
        crossing = crossing_windows(len(units), window, cuts) if cuts is not None else np.zeros(index.windows_of(e, v), np.bool_)
        copy = copied_spans(offsets, len(units), window, crossing, cuts, options.dirty_span,
                            tally.row_starts.get(v, ()) if tally else (), tally.row_ends.get(v, ()) if tally else ())
        longest = max(longest, copy.longest)
        by_span = by_span or (copy.joined and bool(options.dirty_span) and copy.longest >= options.dirty_span)
        if best is None or (copy.judged_fraction, copy.longest) > (best.judged_fraction, best.longest):
            best = copy
    best = best or CopiedSpans()
    near = sorted(tally.near, key=lambda d: -d["jaccard"]) if tally else []
    fraction = best.judged_fraction
    if example.length < options.min_length and not near:
        status, why = "too_short", None
    elif fraction >= options.dirty_fraction or by_span or near:
        status = "dirty"
        why = "fraction" if fraction >= options.dirty_fraction else "span" if by_span else "near_duplicate"
    elif fraction > options.partial_fraction:
        status, why = "partial", None
    else:
        status, why = "clean", None
    return {
        "eval_set": example.eval_set, "id": example.example_id, "status": status, "dirty_by": why, "units": example.length,
        "matched_fraction": round(fraction, 6), "judged_share": best.judged_share, "ngram_fraction": round(best.fraction, 6),
        "matched_ngrams": best.matched,
        "ngrams": best.windows, "boundary_ngrams": best.crossing, "boundary_matched": best.crossing_matched,
        "coverage": round(best.covered / best.units, 6) if best.units else 0.0, "copied_fraction": round(best.copied_fraction, 6),
        "joined": best.joined, "longest_span": longest, "training_spans": len(best.spans),
        "documents_hit": len(tally.documents) if tally else 0, "locations": tally.locations if tally else [],
        "near_duplicates": len(near), "near_duplicate_jaccard": near[0]["jaccard"] if near else None,
        "near_duplicate_documents": near[: options.max_locations],
    }
