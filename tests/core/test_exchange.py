"""StepExchange (harness.core.exchange): one int64 row per rank, a core header then fixed plugin slots."""
from __future__ import annotations

import pytest

from harness.core.exchange import NOT_SHARED, StepExchange

HEADER = 2


def _ranks(n: int = 3) -> list[StepExchange]:
    """n ranks that reserved the same slots in the same order (as on_run_start does on every rank)."""
    ranks = [StepExchange() for _ in range(n)]
    for exchange in ranks:
        exchange.reserve("data_hash", "hashes", 4)
        exchange.reserve("grad_sync", "wait_us", 1)
    return ranks


def _meet(ranks: list[StepExchange]) -> list[list[list[int]]]:
    """What the all-gather does: every rank packs its row, every rank unpacks all of them."""
    rows = [exchange.pack([10 + r, 20 + r]) for r, exchange in enumerate(ranks)]
    assert len({len(row) for row in rows}) == 1 and len(rows[0]) == HEADER + ranks[0].width
    return [exchange.unpack(rows, HEADER) for exchange in ranks]


def test_three_ranks_see_every_rank_s_values_and_headers() -> None:
    ranks = _ranks()
    for r, exchange in enumerate(ranks):
        exchange.share("data_hash", "hashes", [r, r + 1, -(2**63), 2**63 - 1])
        exchange.share("grad_sync", "wait_us", [1000 * r])
    headers = _meet(ranks)
    for exchange, seen in zip(ranks, headers):
        assert seen == [[10, 20], [11, 21], [12, 22]]
        assert exchange.received("data_hash", "hashes") == [[r, r + 1, -(2**63), 2**63 - 1] for r in range(3)]
        assert exchange.received("grad_sync", "wait_us") == [[0], [1000], [2000]]


def test_a_rank_that_shared_nothing_is_none_and_nobody_sharing_is_none() -> None:
    ranks = _ranks()
    ranks[0].share("data_hash", "hashes", [5])
    ranks[2].share("data_hash", "hashes", [])
    _meet(ranks)
    assert ranks[1].received("data_hash", "hashes") == [[5], None, []]  # an empty share is not "nothing"
    assert ranks[1].received("grad_sync", "wait_us") is None
    assert ranks[1].received("data_hash", "never_reserved") is None


def test_values_beyond_the_capacity_are_cut_and_the_count_says_so() -> None:
    ranks = _ranks()
    ranks[0].share("data_hash", "hashes", list(range(7)))
    row = ranks[0].pack([0, 0])
    assert row[HEADER : HEADER + 5] == [7, 0, 1, 2, 3]  # count 7 > capacity 4
    rows = [row] + [exchange.pack([0, 0]) for exchange in ranks[1:]]
    ranks[0].unpack(rows, HEADER)
    assert ranks[0].received("data_hash", "hashes") == [[0, 1, 2, 3], None, None]
    assert ranks[0].truncated("data_hash", "hashes", 7) and not ranks[0].truncated("data_hash", "hashes", 4)


def test_slots_follow_the_reservation_order_and_a_repeated_reservation_keeps_its_place() -> None:
    exchange = StepExchange()
    exchange.reserve("a", "x", 1)
    exchange.reserve("b", "y", 2)
    exchange.reserve("a", "x", 3)  # grows in place
    exchange.share("b", "y", [8, 9])
    assert exchange.width == (1 + 3) + (1 + 2)
    assert exchange.pack([42]) == [42, NOT_SHARED, 0, 0, 0, 2, 8, 9]


def test_a_row_packed_in_another_reservation_order_is_misread() -> None:
    """Why every rank must reserve in the same order: the layout is positional."""
    here, there = StepExchange(), StepExchange()
    here.reserve("a", "x", 1), here.reserve("b", "y", 1)
    there.reserve("b", "y", 1), there.reserve("a", "x", 1)
    there.share("a", "x", [5])
    here.unpack([there.pack([])], 0)
    assert here.received("a", "x") is None and here.received("b", "y") == [[5]]


def test_contributions_are_per_step_and_reset_forgets_the_last_exchange() -> None:
    ranks = _ranks(1)
    ranks[0].share("grad_sync", "wait_us", [3])
    _meet(ranks)
    assert ranks[0].received("grad_sync", "wait_us") == [[3]]
    _meet(ranks)  # nothing shared this step
    assert ranks[0].received("grad_sync", "wait_us") is None
    ranks[0].share("grad_sync", "wait_us", [4])
    _meet(ranks)
    ranks[0].reset()
    assert ranks[0].received("grad_sync", "wait_us") is None


def test_sharing_without_a_reservation_and_a_negative_capacity_are_errors() -> None:
    exchange = StepExchange()
    with pytest.raises(KeyError, match="on_run_start"):
        exchange.share("p", "k", [1])
    with pytest.raises(ValueError, match="capacity"):
        exchange.reserve("p", "k", -1)


@pytest.mark.parametrize("shares", [{}, {"hashes": [1, 2]}, {"hashes": [1, 2, 3, 4, 5, 6], "wait_us": [7]}, {"wait_us": []}])
def test_loop_back_is_what_one_rank_s_own_row_gives(shares: dict[str, list[int]]) -> None:
    """One process skips the row: ``loop_back`` must leave what ``pack`` then ``unpack`` of its own row would."""
    via_row, looped = _ranks(2)
    owners = {"hashes": "data_hash", "wait_us": "grad_sync"}
    for exchange in (via_row, looped):
        for key, values in shares.items():
            exchange.share(owners[key], key, values)
    via_row.unpack([via_row.pack([0, 0])], HEADER)
    looped.loop_back()
    for key, owner in owners.items():
        assert looped.received(owner, key) == via_row.received(owner, key)
        assert looped.cut_ranks(owner, key) == via_row.cut_ranks(owner, key)
    assert looped.pack([0, 0]) == via_row.pack([0, 0])  # nothing left outgoing on either
