"""The bounded seen-table of data_hash: exact counts across every growth (numpy rehash), bounded once full."""
from __future__ import annotations

import random
from collections import Counter

from harness.lib.seentable import SeenTable


def test_counts_stay_exact_across_growth_with_random_and_clustered_keys() -> None:
    rng = random.Random(0)
    keys = [rng.getrandbits(64) or 1 for _ in range(20_000)]
    keys += keys[:5_000] + list(range(1, 8_000)) * 2  # repeats, and sequential ids that cluster and wrap around
    rng.shuffle(keys)
    table, reference = SeenTable(50_000), Counter()
    for key in keys:
        reference[key] += 1
        assert table.add(key) == reference[key]
    assert len(table) == len(reference) and table.slots >= 2 * len(reference)
    assert all(table.count(key) == count for key, count in reference.items())
    assert table.setdefault(keys[0], 99) == reference[keys[0]]  # held keys keep their value


def test_a_full_table_stores_nothing_more_and_never_invents_a_repeat() -> None:
    table = SeenTable(1_000)
    for key in range(1, 1_001):
        table.add(key)
    size, nbytes = len(table), table.nbytes
    assert [table.add(key) for key in range(5_000, 5_100)] == [0] * 100  # not stored: a repeat can be missed, not made up
    assert len(table) == size == 1_000 and table.nbytes == nbytes and table.untracked == 100
    assert table.add(500) == 2  # keys it holds are still counted
