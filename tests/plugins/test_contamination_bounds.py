"""contamination, in milliseconds: the step-end verdict on joined eval rows judges only rows that may be dirty.

A run_clm-style eval block joins lines; its full verdict (training spans with numpy) costs about 140 us, and a step
that matched a few partial blocks used to pay it for each of them on the training thread. Cheap bounds on the matched
bits (harness.lib.span_bounds) now rule most of them out; the verdicts must stay exactly those of the full judgement.
"""
from __future__ import annotations

import random
from typing import Any

import numpy as np
import pytest

from harness.lib.copied_spans import copied_spans, crossing_windows, inner_bits
from harness.lib.ngrams import EvalExample, NgramIndex
from harness.lib.overlap_ledger import LANES, MATCHED, ROW_END, ROW_START, bits_of, lane_of
from harness.lib.span_bounds import RowShape, has_run, spread

N = 13


def _plugin(examples: list[EvalExample], n: int = N, **options: Any) -> Any:
    from harness.plugins.contamination import Contamination

    plugin = Contamination()
    plugin.options = plugin.Options(n=n, template_min_examples=0, min_length=1, **options)
    plugin.index = NgramIndex.build(examples, n, 0, 1)
    return plugin


def _block(lengths: list[int], first: int = 1) -> tuple[np.ndarray, np.ndarray]:
    """Lines of these lengths joined (ids of their own, each line ends in token 0) and the cuts where lines start."""
    units = np.concatenate([np.r_[np.arange(first + 1000 * i, first + 1000 * i + n - 1), 0] for i, n in enumerate(lengths)])
    return units.astype(np.int64), np.cumsum(lengths)[:-1]


def _before(plugin: Any, example: int, bits: dict[int, int]) -> bool:
    """The step-end verdict as it was: a joined row with any matched window inside a line went to the full judgement."""
    may = False
    for lane, matched in bits.items():
        variant, kind = divmod(lane, LANES)
        if kind != MATCHED:
            continue
        x = plugin.index.examples[example]
        units, cuts = x.variants[variant], x.cuts_of(variant)
        window = min(plugin.index.n, len(units))
        crossing = crossing_windows(len(units), window, cuts)
        inner, joined = inner_bits(crossing), copied_spans([], len(units), window, crossing, cuts).joined
        inside = matched & inner
        may = may or (bool(inside) if joined else inside.bit_count() >= plugin.options.dirty_fraction * max(inner.bit_count(), 1))
    return may and plugin._judge(example, bits)["status"] == "dirty"


def test_a_partial_block_is_not_judged_at_step_end(monkeypatch: Any) -> None:
    """A 64-token block of three lines, the 20-token one copied whole (31% of its units, 8 of its 28 counted
    13-grams), plus two lone 13-grams of the 30-token line: no training span of 32 tokens can be made of these bits,
    nor a half-copied block. Before, every step that matched such a block ran the full judgement (about 140 us)."""
    from harness.plugins.contamination import Contamination

    units, cuts = _block([30, 20, 14])
    plugin = _plugin([EvalExample("eval_dataset", "0", None, [units], [cuts])])
    copied = bits_of(range(30, 30 + 20 - N + 1))  # every window inside the 20-token line
    lone = bits_of([2, 6])  # two 13-grams of the first line, apart
    across = bits_of(range(36, 44))  # the copied line's last windows and some across the next line break
    for bits in (copied, copied | lone, across):
        assert plugin._judge(0, {0: bits})["status"] == "partial"
    monkeypatch.setattr(Contamination, "_judge", lambda *a: pytest.fail("judged a block that cannot be dirty"))
    assert not any(plugin._is_dirty(0, {0: bits}) for bits in (copied, copied | lone, across))


def test_a_block_that_may_be_dirty_is_judged_and_found() -> None:
    """The same block with its first two lines copied together (50 of 64 units, every 13-gram across their break): dirty."""
    units, cuts = _block([30, 20, 14])
    plugin = _plugin([EvalExample("eval_dataset", "0", None, [units], [cuts])])
    both = bits_of(range(0, 50 - N + 1))
    assert plugin._is_dirty(0, {0: both}) and plugin._judge(0, {0: both})["dirty_by"] == "fraction"


def test_a_block_that_becomes_dirty_is_judged_once_for_its_verdict_and_its_finding() -> None:
    """At step end the verdict that found the block dirty is the one its CONTAMINATION finding reports (before, the
    report judged the same bits again: a second 140 us on the step that found it)."""
    from types import SimpleNamespace

    from harness.lib.overlap_ledger import MatchLedger
    from harness.plugins.contamination.sightings import Sighting

    units, cuts = _block([30, 20, 14])
    plugin = _plugin([EvalExample("eval_dataset", "0", None, [units], [cuts])])
    plugin.ledger = MatchLedger([11])
    reports: list[tuple[str, dict[str, Any]]] = []
    ctx = SimpleNamespace(rank=0, report=lambda code, message, evidence=None, **k: reports.append((code, evidence)))
    plugin.__dict__["ctx"] = ctx
    full, calls = plugin._judge, []
    plugin._judge = lambda e, b: calls.append(e) or full(e, b)
    plugin._sightings[0] = [Sighting(3, 0, 0, 1, None, 0, 38, units[:50])]
    plugin.ledger.add(0, 0, range(0, 50 - N + 1))  # the first two lines, copied together
    plugin._settle(ctx, [plugin.ledger.outgoing(None)])
    ((code, evidence),) = reports
    assert code == "CONTAMINATION" and evidence["matched_fraction"] >= 0.5 and calls == [0]
    plugin.ledger.add(0, 0, [51])
    plugin._settle(ctx, [plugin.ledger.outgoing(None)])
    assert len(reports) == 1 and calls == [0]  # reported once per run: not judged again


def _lengths(rng: random.Random, units: int, window: int) -> list[int]:
    """Line lengths summing to ``units``: some shorter than a window (they hold no whole one), some long."""
    out: list[int] = []
    while sum(out) < units:
        out.append(rng.choice([rng.randint(2, window), rng.randint(window, 3 * window), rng.randint(window, window + 2)]))
    out[-1] -= sum(out) - units
    return [n for n in out if n > 0]


def _matched(rng: random.Random, total: int, window: int, crossing: np.ndarray, cuts: np.ndarray) -> int:
    """Matched windows like training makes them: copied lines (some cut by a training block), whole line breaks,
    abutting runs, lone template windows, noise."""
    bits = 0
    inside = np.flatnonzero(~crossing).tolist()
    for _ in range(rng.randint(0, 4)):  # runs, some abutting the next one across a training cut
        start = rng.randrange(total)
        length = rng.randint(1, 2 * window)
        bits |= ((1 << length) - 1) << start
        if rng.random() < 0.5:
            bits |= ((1 << rng.randint(1, window)) - 1) << (start + length - 1 + window)
    for gap in cuts.tolist():  # a line break whose windows all matched (lines copied together), or some of them
        if rng.random() < 0.3:
            lo, hi = max(0, gap - window + 1), min(total, gap)
            if lo < hi:
                bits |= (((1 << (hi - lo)) - 1) << lo) if rng.random() < 0.6 else bits_of(rng.sample(range(lo, hi), 1))
    for _ in range(rng.randint(0, 3)):  # lone windows
        bits |= 1 << rng.choice(inside if inside and rng.random() < 0.7 else range(total))
    if rng.random() < 0.2:
        bits |= bits_of(o for o in range(total) if rng.random() < rng.choice([0.1, 0.5, 0.9]))
    return bits & ((1 << total) - 1)


def test_the_bounded_verdict_equals_the_full_judgement_on_random_rows() -> None:
    """3,600 matched patterns on 300 synthetic joined rows (lines shorter and longer than a window, line breaks matched
    in whole or in part, abutting runs, two tokenisation variants) under several thresholds: the bounded step-end
    verdict is the one of the step-end test as it was (any window inside a line: the full judgement) every time, and
    the bounds spare many full judgements even on these patterns, made to sit near the thresholds."""
    rng = random.Random(43)
    cases = judged = skipped = dirty = 0
    for trial in range(300):
        n = rng.choice([4, 5, 13])
        length = rng.randint(n + 2, 140)
        units, cuts = _block(_lengths(rng, length, n))
        variants, all_cuts = [units], [cuts]
        if rng.random() < 0.3:  # a second tokenisation: one more token up front
            variants.append(np.r_[7, units].astype(np.int64))
            all_cuts.append(cuts + 1)
        options = {"dirty_fraction": rng.choice([0.0, 0.2, 0.5, 0.8, 1.0]), "dirty_span": rng.choice([0, 5, 16, 32])}
        plugin = _plugin([EvalExample("eval_dataset", "0", None, variants, all_cuts)], n=n, **options)
        full = plugin._judge
        calls = 0

        def counted(example: int, bits: dict[int, int]) -> dict[str, Any]:
            nonlocal calls
            calls += 1
            return full(example, bits)

        for row, row_cuts in zip(variants, all_cuts):
            _same_shape(len(row), min(n, len(row)), row_cuts)
        for _ in range(12):
            bits = {}
            for v, (row, row_cuts) in enumerate(zip(variants, all_cuts)):
                window = min(n, len(row))
                crossing = crossing_windows(len(row), window, row_cuts)
                if v == 0 or rng.random() < 0.5:
                    matched = bits[lane_of(v)] = _matched(rng, len(crossing), window, crossing, row_cuts)
                    for kind, run_edges in ((ROW_START, matched & ~(matched << 1)), (ROW_END, matched & ~(matched >> 1))):
                        edges = bits_of(o for o in range(len(crossing)) if rng.random() < 0.15)  # training rows' edges:
                        bits[lane_of(v, kind)] = matched & (run_edges | edges) & rng.choice([edges, -1])  # at runs' ends, any
            expected = _before(plugin, 0, bits)
            plugin._judge = counted
            calls = 0
            got = plugin._is_dirty(0, bits)
            plugin._judge = full
            assert got == expected, (trial, n, [len(v) for v in variants], cuts.tolist(), options, bits)
            cases, judged, dirty = cases + 1, judged + calls, dirty + expected
            skipped += not calls and _before_judges(plugin, 0, bits)
    assert cases == 3600 and 300 < dirty < cases - 300
    assert skipped > judged / 3, (skipped, judged)  # the bounds do spare judgements, on these hard cases too


def _same_shape(units: int, window: int, cuts: np.ndarray) -> None:
    """RowShape (Python ints) holds what copied_spans (numpy) makes of the row: counted windows, joined, coverable units."""
    shape = RowShape.of(units, window, cuts)
    crossing = crossing_windows(units, window, cuts)
    every = copied_spans(list(range(len(crossing))), units, window, crossing, cuts)
    assert (shape.windows, shape.inner, shape.counted) == (len(crossing), inner_bits(crossing), every.windows)
    assert shape.joined == every.joined
    if shape.joined:
        assert shape.coverable == every.coverable and shape.crossing == inner_bits(~crossing)
        every_bit = (1 << len(crossing)) - 1  # all windows matched: the bound on whole lines holds what copied_spans copies
        bound = sum(units for needed, first, last, own, units in shape.lines if every_bit & needed == needed)
        assert bound >= every.copied and (bound == every.copied or min(np.diff([0, *cuts.tolist(), units])) < window)


def _before_judges(plugin: Any, example: int, bits: dict[int, int]) -> bool:
    """Whether the old step-end test went on to the full judgement for these bits."""
    calls = []
    full = plugin._judge
    plugin._judge = lambda e, b: calls.append(1) or {"status": "clean"}
    try:
        _before(plugin, example, bits)
    finally:
        plugin._judge = full
    return bool(calls)


def test_spread_and_has_run() -> None:
    assert spread(0b1, 13) == (1 << 13) - 1 and spread(0b1001, 2) == 0b11011 and spread(0b101, 1) == 0b101
    assert has_run(0b0111_0110, 3) and not has_run(0b0111_0110, 4) and has_run(0b1, 1) and not has_run(0, 1)
    assert has_run((1 << 40) - 1 << 5, 40) and not has_run((1 << 39) - 1 << 5, 40) and has_run(0b10, -3)
