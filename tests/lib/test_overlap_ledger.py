"""The contamination plugin's judging and agreement logic, without a Trainer: bitsets, triples, ranks, attempts (milliseconds)."""
from __future__ import annotations

import numpy as np
import pytest

from harness.lib.ngrams import EvalExample, NgramIndex
from harness.lib.overlap import ScanOptions, judge
from harness.lib.overlap_ledger import (CHUNK, MatchLedger, bits_of, decode, encode, example_keys, offsets_of,
                                        tally_from_bits)

N = 13
OPTIONS = ScanOptions(n=N, dirty_fraction=0.5, min_length=8)


def _index(count: int = 4, length: int = 64) -> NgramIndex:
    """``count`` eval examples of ``length`` distinct token ids each (52 windows of 13 at length 64)."""
    examples = [EvalExample("eval_dataset", str(e), None, [np.arange(length, dtype=np.int64) + 1000 * e]) for e in range(count)]
    return NgramIndex.build(examples, N, template_min_examples=10, min_length=8)


def _ledgers(index: NgramIndex, ranks: int) -> list[MatchLedger]:
    keys = example_keys((x.eval_set, x.example_id) for x in index.examples)
    return [MatchLedger(keys) for _ in range(ranks)]


def _dirty(index: NgramIndex):  # noqa: ANN202 - the judge the plugin uses: harness scan's
    return lambda e, bits: judge(index, e, tally_from_bits(bits), OPTIONS)["status"] == "dirty"


def _query(index: NgramIndex, units: np.ndarray) -> dict[int, list[int]]:
    found: dict[int, list[int]] = {}
    for hit in index.query(units):
        found.setdefault(hit.example, []).append(hit.offset)
    return found


def test_bits_and_triples_round_trip_past_one_chunk() -> None:
    offsets = [0, 1, 61, 62, 63, 200, 1000]
    bits = bits_of(offsets)
    assert offsets_of(bits) == offsets and offsets_of(0) == []
    values = encode(7, 1, bits) + encode(9, 0, bits_of([5]))
    assert len(values) % 3 == 0 and all(0 <= v < (1 << 63) for v in values)
    merged: dict[tuple[int, int], int] = {}
    for key, variant, part in decode(values):
        merged[(key, variant)] = merged.get((key, variant), 0) | part
    assert merged == {(7, 1): bits, (9, 0): 1 << 5}
    assert decode(values[:-1]) == decode(values[:-3])  # a cut tail that is not a whole triple is dropped
    assert decode([-1, 0, 5, 3, 0, 0]) == []  # never produced by encode: ignored
    assert max(v for v in values[2::3]) < (1 << CHUNK)


def test_keys_are_stable_and_distinct_for_repeated_ids() -> None:
    names = [("quiz", "1"), ("quiz", "2"), ("quiz", "1"), ("other", "1")]
    keys = example_keys(names)
    assert keys == example_keys(names) and len(set(keys)) == 4 and all(0 <= k < (1 << 62) for k in keys)


def test_template_ngrams_stay_below_the_dirty_fraction_however_often_they_come() -> None:
    """Two windows of 52 (the 13-gram of template text from the issue) seen on every step of two ranks: never dirty."""
    index = _index()
    ledgers = _ledgers(index, 2)
    template = np.arange(14, dtype=np.int64) + 1000 * 3 + 20  # windows 20 and 21 of example 3
    for _ in range(20):
        per_rank = []
        for ledger in ledgers:
            for e, offsets in _query(index, template).items():
                ledger.add(e, 0, offsets)
            per_rank.append(ledger.outgoing(192))
        assert [ledger.agree(per_rank, _dirty(index)) for ledger in ledgers] == [[], []]
    verdict = judge(index, 3, tally_from_bits(ledgers[0].combined(3)), OPTIONS)
    assert verdict["status"] == "partial" and verdict["matched_fraction"] == pytest.approx(2 / 52, abs=1e-6)


def test_an_example_cut_across_two_blocks_and_two_ranks_is_dirty_once_reported_by_the_lowest_contributor() -> None:
    """Each half alone (20 of 52 windows) is partial; together (40 of 52) dirty: one report, named the same on every rank."""
    index = _index()
    ledgers = _ledgers(index, 3)
    example = index.examples[1].variants[0]
    halves = {1: example[:32], 2: example[32:]}  # ranks 1 and 2 train one half each (a block boundary at token 32)
    for rank, part in halves.items():
        for e, offsets in _query(index, part).items():
            assert e == 1 and ledgers[rank].add(e, 0, offsets) == 20
        assert judge(index, 1, tally_from_bits(ledgers[rank].combined(1)), OPTIONS)["status"] == "partial"
    per_rank = [ledger.outgoing(192) for ledger in ledgers]
    assert per_rank[0] == [] and per_rank[1] and per_rank[2]
    answers = [ledger.agree(per_rank, _dirty(index)) for ledger in ledgers]
    assert answers[0] == answers[1] == answers[2] and [(d.example, d.reporter, d.ranks) for d in answers[0]] == [(1, 1, (1, 2))]
    assert all(ledger.outgoing(192) == [] for ledger in ledgers)  # agreed: nothing left to share
    # the same windows again (a second epoch): already reported, nothing new
    for e, offsets in _query(index, halves[1]).items():
        assert ledgers[1].add(e, 0, offsets) == 0
    again = [ledger.outgoing(192) for ledger in ledgers]
    assert [ledger.agree(again, _dirty(index)) for ledger in ledgers] == [[], [], []]


def test_a_full_slot_carries_the_rest_to_the_next_exchange() -> None:
    index = _index(count=6)
    (ledger,) = _ledgers(index, 1)
    for e in range(6):
        ledger.add(e, 0, range(40))  # six examples dirty at once, one triple each
    first = ledger.outgoing(9)
    assert len(first) == 9  # three triples fit
    assert [d.example for d in ledger.agree([first], _dirty(index))] == [0, 1, 2]
    second = ledger.outgoing(9)
    assert [d.example for d in ledger.agree([second], _dirty(index))] == [3, 4, 5]
    assert ledger.outgoing(9) == []


def test_a_long_example_split_over_chunks_is_cut_by_whole_triples() -> None:
    index = _index(count=1, length=400)  # 388 windows: seven chunks of 62
    (ledger,) = _ledgers(index, 1)
    ledger.add(0, 0, range(388))
    parts = ledger.outgoing(10)
    assert len(parts) == 9  # three whole triples, never a torn one
    assert ledger.agree([parts], _dirty(index)) == []  # 186 of 388 windows so far: below one half
    rest = ledger.outgoing(None)
    assert [d.example for d in ledger.agree([rest], _dirty(index))] == [0]


def test_examples_reported_by_an_earlier_attempt_are_not_reported_again() -> None:
    index = _index()
    (ledger,) = _ledgers(index, 1)
    ledger.reported |= {2}  # read from the run directory's findings at run start
    ledger.add(2, 0, range(52))
    ledger.add(0, 0, range(52))
    assert [d.example for d in ledger.agree([ledger.outgoing(None)], _dirty(index))] == [0]


def test_run_end_reports_only_what_this_rank_alone_made_dirty() -> None:
    index = _index()
    ledgers = _ledgers(index, 2)
    ledgers[0].add(0, 0, range(30))
    ledgers[1].add(1, 0, range(10))
    per_rank = [ledger.outgoing(192) for ledger in ledgers]
    for ledger in ledgers:
        assert [d.example for d in ledger.agree(per_rank, _dirty(index))] == [0]
    ledgers[1].add(1, 0, range(10, 30))  # after the last exchange: rank 1 alone knows example 1 is dirty now
    ledgers[0].add(0, 0, range(30, 40))  # already reported: never again
    assert ledgers[0].dirty_here_only(_dirty(index)) == [] and ledgers[1].dirty_here_only(_dirty(index)) == [1]
    assert ledgers[1].dirty_here_only(_dirty(index)) == []


def test_restored_windows_count_towards_the_verdict() -> None:
    """A checkpoint's agreed windows (half an example) plus the other half after the resume: dirty."""
    index = _index()
    (ledger,) = _ledgers(index, 1)
    ledger.restore(0, 0, bits_of(range(20)))
    ledger.add(0, 0, range(26, 52))
    assert [d.example for d in ledger.agree([ledger.outgoing(None)], _dirty(index))] == [0]
