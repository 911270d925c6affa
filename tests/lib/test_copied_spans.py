"""Issue 43 item 6, in milliseconds: eval rows that join lines are judged by the spans of training text they hold.

A run_clm-style eval block joins lines; a line copied into training on its own matches only the n-grams inside it,
and a training block boundary through a copied line hides the n-grams across that cut. Neither may make a copied
block look clean, and template text around a line break may not make a clean block look copied.
"""
from __future__ import annotations

import numpy as np

from harness.lib.copied_spans import copied_spans, crossing_windows, inner_bits
from harness.lib.ngrams import EvalExample, NgramIndex
from harness.lib.overlap import ScanOptions, Tally, judge

N = 13
NL = 0  # the line-break token of these made-up rows


def _line(seed: int, length: int) -> list[int]:
    """A line of ``length`` tokens ending in the line break; its other ids are its own (no n-gram shared by chance)."""
    return [1000 * seed + k + 1 for k in range(length - 1)] + [NL]


def _row(lines: list[list[int]]) -> tuple[np.ndarray, np.ndarray]:
    units = np.array([t for line in lines for t in line], dtype=np.int64)
    return units, np.flatnonzero(units == NL)[:-1] + 1 if units[-1] == NL else np.flatnonzero(units == NL) + 1


def _verdict(units: np.ndarray, cuts: np.ndarray | None, training: list[np.ndarray], **options: int | float) -> dict:
    index = NgramIndex.build([EvalExample("eval", "0", None, [units], None if cuts is None else [cuts])], N, 0, 1)
    tally = Tally()
    for row in training:
        for hit in index.query(row):
            tally.note(hit)
    return judge(index, 0, tally, ScanOptions(n=N, **options))


def test_a_block_of_lines_each_copied_alone_is_wholly_copied() -> None:
    """Four 16-token lines, each copied into training between other lines: every n-gram inside a line matches, and
    of those across a line break only the 3 that start at the shared line-break token. On all its windows (today's
    judging) the block is 19 of 52 = 37% matched, partial; judged by its lines it is wholly copied."""
    lines = [_line(i, 16) for i in range(1, 5)]
    units, cuts = _row(lines)
    training = [np.array(_line(50 + i, 15) + line + _line(60 + i, 15)) for i, line in enumerate(lines)]
    plain = _verdict(units, None, training)
    assert plain["matched_fraction"] == round(19 / 52, 6) and plain["status"] == "partial" and not plain["joined"]
    row = _verdict(units, cuts, training)
    assert row["joined"] and row["matched_ngrams"] == row["ngrams"] == 4 * 4 and row["boundary_ngrams"] == 36
    assert row["boundary_matched"] == 3 and row["copied_fraction"] == 1.0 and row["longest_span"] == 16
    assert row["matched_fraction"] == 1.0 and row["status"] == "dirty" and row["dirty_by"] == "fraction"


def test_a_copied_line_cut_by_a_training_block_keeps_its_tokens() -> None:
    """A 40-token line copied into training, where a block boundary falls 20 tokens in: the 12 n-grams across the cut
    never occur, but the two runs abut, so the line is one training span of 40 tokens (the copied share counts it)."""
    copied, clean = _line(1, 40), _line(2, 40)
    units, cuts = _row([copied, clean])
    training = [np.array(_line(50, 30) + copied[:20]), np.array(copied[20:] + _line(51, 30))]
    row = _verdict(units, cuts, training, dirty_span=0)
    assert row["matched_ngrams"] == 16 and row["ngrams"] == 56 and row["boundary_ngrams"] == 12
    assert row["ngram_fraction"] == round(16 / 68, 6)  # of all its n-grams: those across the break count against
    assert row["longest_span"] == 40 and row["copied_fraction"] == 0.5 and row["status"] == "dirty"
    assert _verdict(units, cuts, training, dirty_span=0, dirty_fraction=0.6)["status"] == "partial"


def test_a_long_training_span_makes_a_joined_row_dirty_whatever_its_fraction() -> None:
    """A 2,000-token eval row (a packed block) holding one copied 100-token document: 5% of it, dirty by its span;
    the same text as a single example keeps the fraction rule (a long template its few siblings share stays partial)."""
    lines = [_line(i, 100) for i in range(1, 21)]
    units, cuts = _row(lines)
    training = [np.array(_line(90, 30) + lines[7] + _line(91, 30))]
    row = _verdict(units, cuts, training)
    assert row["status"] == "dirty" and row["dirty_by"] == "span" and row["longest_span"] == 100 and row["matched_fraction"] < 0.06
    assert _verdict(units, cuts, training, dirty_span=0)["status"] == "partial"
    single = _verdict(units, None, training)
    assert single["status"] == "partial" and single["longest_span"] >= 100  # a single example: the fraction decides


def test_template_text_around_line_breaks_is_not_training_text() -> None:
    """Every line ends and starts with the same template tokens, so n-grams across the breaks match training, while
    no line is copied: the row holds no training span and stays clean (today: partial, some n-grams 'matched')."""
    template_end, template_start = [7, 8, 9, 10, 11, 12, NL], [13, 14, 15, 16, 17, 18]
    def line(seed: int) -> list[int]:
        return template_start + [1000 * seed + k for k in range(1, 12)] + template_end
    units, cuts = _row([line(i) for i in range(1, 5)])
    training = [np.array(line(50) + line(51) + line(52))]
    assert _verdict(units, None, training)["status"] == "partial"
    row = _verdict(units, cuts, training)
    assert row["status"] == "clean" and row["boundary_matched"] > 0 and row["longest_span"] == 0 and row["matched_ngrams"] == 0


def test_a_template_phrase_inside_each_line_is_not_a_copy() -> None:
    """Issue 43 trial: 31-token recipe lines that all start with the same 16-token phrase (``To make dumplings, slice
    the``...). Training holds other lines of the template, so every eval line matches a 16-token span at its start:
    the old rule (spans of more than two n-grams) called the block half copied. The phrase is a piece of each line,
    no line is covered, and the block stays clean of copies (its n-gram share decides: 4 n-grams per line of the
    block's 112)."""
    phrase = list(range(101, 117))
    def line(seed: int) -> list[int]:
        return phrase + [1000 * seed + k for k in range(1, 15)] + [NL]
    units, cuts = _row([line(i) for i in range(1, 5)])
    training = [np.array(line(50) + line(51) + line(52))]
    row = _verdict(units, cuts, training, dirty_fraction=0.5)
    assert row["joined"] and row["longest_span"] == 16 and row["copied_fraction"] == 0.0
    assert row["judged_share"] == "ngrams" and row["matched_fraction"] == round(4 * 4 / (4 * 31 - 12), 6) and row["status"] == "partial"


def test_a_copied_line_cut_near_its_start_is_still_whole() -> None:
    """A 40-token line copied into training where a block boundary falls 5 tokens in: the windows over its first 5
    tokens never occur, so its span starts 5 tokens late. A cut closer than one window to a line's end is a training
    block boundary, not a template: the whole line counts as copied. Training holding only the line's last 27 tokens
    (a span starting a whole window in, which no single cut leaves) is a piece of the line, not a copy of it. The cut
    is known by the training row that starts there; the same line at the eval row's start counts alike."""
    before, copied, after = _line(3, 20), _line(1, 40), _line(2, 20)
    units, cuts = _row([before, copied, after])
    training = [np.array(_line(50, 30) + copied[:5]), np.array(copied[5:] + _line(51, 30))]
    row = _verdict(units, cuts, training, dirty_span=0)
    assert row["longest_span"] == 35 and row["copied_fraction"] == 0.5 and row["judged_share"] == "tokens"
    late = [np.array(_line(50, 30)), np.array(copied[13:] + _line(51, 30))]
    assert _verdict(units, cuts, late, dirty_span=0)["copied_fraction"] == 0.0
    units, cuts = _row([copied, after])  # the same cut line at the row's start
    assert _verdict(units, cuts, training, dirty_span=0)["copied_fraction"] == round(40 / 60, 6)


def test_the_same_sentence_with_another_name_is_not_a_copy() -> None:
    """Issue 43 trial (a templated corpus, ``Dev packed a blue notebook ...``): training holds the eval line but for its
    first 5 tokens (another name), inside a training row. The span stops 5 tokens short of the line's start, as a
    training block cut there would leave it, but the training row does not start there: other text came before, so
    the line is no copy (before: counted whole, and 7 such lines made a clean block dirty)."""
    before, line, after = _line(3, 20), _line(1, 40), _line(2, 20)
    units, cuts = _row([before, line, after])
    other_name = [np.array(_line(50, 30) + [99_001, 99_002, 99_003, 99_004, 99_005] + line[5:] + _line(51, 30))]
    row = _verdict(units, cuts, other_name, dirty_span=0)
    assert row["longest_span"] == 35 and row["copied_fraction"] == 0.0 and row["judged_share"] == "ngrams"
    other_end = [np.array(_line(50, 30) + line[:-6] + [99_001] * 6 + _line(51, 30))]  # another word at its end
    assert _verdict(units, cuts, other_end, dirty_span=0)["copied_fraction"] == 0.0
    cut_at_end = [np.array(_line(50, 30) + line[:-6]), np.array(line[-6:] + _line(51, 30))]  # a training cut there
    assert _verdict(units, cuts, cut_at_end, dirty_span=0)["copied_fraction"] == 0.5


def test_two_sentences_sharing_halves_of_a_line_are_not_its_copy() -> None:
    """Template chaining: one training sentence shares the eval line's first 20 tokens, another its last 20, each inside
    other text. The two runs abut (the second starts where the first's last window ends) as a training block cut
    would leave them, but neither training row ends or starts there: two sentences, no copy of the line. The same
    halves at the edges of two training rows are one line cut by a block boundary (a copy)."""
    before, line, after = _line(3, 20), _line(1, 40), _line(2, 20)
    units, cuts = _row([before, line, after])
    halves = [np.array(_line(50, 30) + line[:20] + _line(52, 30)), np.array(_line(53, 30) + line[20:] + _line(51, 30))]
    row = _verdict(units, cuts, halves, dirty_span=0)
    assert row["longest_span"] == 20 and row["copied_fraction"] == 0.0
    cut = [np.array(_line(50, 30) + line[:20]), np.array(line[20:] + _line(51, 30))]
    row = _verdict(units, cuts, cut, dirty_span=0)
    assert row["longest_span"] == 40 and row["copied_fraction"] == 0.5


def test_crossing_windows_and_inner_bits() -> None:
    crossing = crossing_windows(10, 4, np.array([3, 7]))
    # windows 0..6 of 4 units; gap 3 inside windows 0-2, gap 7 inside windows 4-6; window 3 ([3, 7)) holds neither
    assert crossing.tolist() == [True, True, True, False, True, True, True]
    assert inner_bits(crossing) == 0b0001000 and inner_bits(np.ones(3, dtype=bool)) == 0b111  # no whole line: all count
    assert crossing_windows(10, 4, None).tolist() == [False] * 7 and len(crossing_windows(3, 4, None)) == 0
    spans = copied_spans([0, 1, 2, 3, 4, 5, 6], 10, 4, crossing, np.array([3, 7]))
    assert spans.spans == [(3, 7)] and spans.matched == 1 and spans.crossing_matched == 6 and spans.joined


def test_a_line_cut_by_a_training_block_is_whole_though_template_windows_lie_between() -> None:
    """Issue 43 trial (``... honey, a pinch of eggs, and some patience. A stormy wind ...``): a copied line cut by a
    training block boundary, where other training rows match template windows just after the cut's first half. The
    two halves no longer abut as runs (the template windows join the first), but the first training row ends where
    the next one starts: one copy, the line counted whole (before: 44% of the block's n-grams, partial)."""
    before, line, after = _line(3, 20), _line(1, 40), _line(2, 20)
    units, cuts = _row([before, line, after])
    cut = [np.array(_line(50, 30) + line[:15]), np.array(line[15:] + _line(51, 30))]
    template = [np.array(_line(52, 30) + line[5:22] + _line(53, 30))]  # another row sharing tokens 5-21 of the line
    row = _verdict(units, cuts, cut + template, dirty_span=0)
    assert row["longest_span"] == 40 and row["copied_fraction"] == 0.5
    assert _verdict(units, cuts, cut + template, dirty_span=0, dirty_fraction=0.5)["status"] == "dirty"


def test_a_copied_line_is_judged_by_its_tokens_though_it_alone_holds_a_whole_window() -> None:
    """Issue 43 trial, n-grams counted in text (23 tokens of a 512-token vocabulary): a 64-token block whose copied
    first line (43 tokens) is the only line long enough to hold a window (here: 13 of them, the other line 10). Judged on its n-gram share alone, as a
    single example, it was 44% matched and partial (the first 12 tokens in a training row that was not trained); it joins lines, so its copied tokens judge it (dirty). A row
    whose only long line is not copied stays clean."""
    first, second = _line(1, 43), _line(2, 10)
    units, cuts = _row([first, second])
    row = _verdict(units, cuts, [np.array(first[12:] + _line(51, 30))], dirty_span=0)  # its training row starts 12 in
    assert row["joined"] and row["judged_share"] == "tokens" and row["copied_fraction"] == 1.0 and row["status"] == "dirty"
    piece = _verdict(units, cuts, [np.array(_line(50, 30) + first[5:25] + _line(51, 30))], dirty_span=0)
    assert piece["copied_fraction"] == 0.0 and piece["status"] != "dirty"  # a piece of the line is no copy


def test_more_matches_never_undo_a_copy_cut_near_its_line_start() -> None:
    """Issue 43 trial (eval block 13, dirty at step 24, partial at run end): a copied line whose training row starts 5
    tokens in is copied whole; template windows another row matched just before that start moved the span's start
    off the row start, and the line was no longer counted. The row start inside the span still says where training
    cut it."""
    before, line, after = _line(3, 20), _line(1, 30), _line(2, 20)
    units, cuts = _row([before, line, after])
    copy = [np.array(line[5:] + _line(51, 30))]  # its training row starts 5 tokens into the line
    alone = _verdict(units, cuts, copy, dirty_span=0)
    assert alone["copied_fraction"] == round(30 / 70, 6)  # the whole line, of the 70 tokens
    template = [np.array(_line(52, 30) + line[1:18] + _line(53, 30))]  # windows 1-5 of the line, from another row
    assert _verdict(units, cuts, copy + template, dirty_span=0)["copied_fraction"] == alone["copied_fraction"]
