"""The ranks' RNG digests and the exchange row of rank_rng: digests, grouping, row round trip, sampler verdicts (milliseconds)."""
from __future__ import annotations

import random

import numpy as np
import pytest
import torch

from harness.lib.rng_digest import ABSENT, MASK63, digest63, equal_groups, python_digest, stream_digests, streams_equal_within
from harness.lib.rng_ranks import WIDTH, majority_seed, pack, rows_of, sampler_mismatch, shared_streams, unpack
from harness.lib.sampler_seed import SamplerSeed, decode_seed, encode_seed


def test_a_digest_is_63_bits_stable_and_sees_where_the_parts_split() -> None:
    values = {digest63(b"ab", b"c"), digest63(b"a", b"bc"), digest63(b"abc"), digest63(b"")}
    assert len(values) == 4 and all(0 <= v <= MASK63 for v in values)  # never -1: ABSENT stays free
    assert digest63(b"ab", b"c") == digest63(b"ab", b"c")


def test_each_stream_follows_its_own_seed() -> None:
    saved = (torch.get_rng_state(), random.getstate(), np.random.get_state())
    try:
        torch.manual_seed(0), random.seed(0), np.random.seed(0)
        first = stream_digests()
        torch.manual_seed(0), random.seed(0), np.random.seed(0)
        assert stream_digests() == first  # the same seeds, the same states
        torch.manual_seed(1)
        changed = stream_digests()
        assert changed["torch"] != first["torch"] and changed["python"] == first["python"] and changed["numpy"] == first["numpy"]
        random.seed(1), np.random.seed(1)
        again = stream_digests()
        assert again["python"] != first["python"] and again["numpy"] != first["numpy"]
        torch.rand(3)  # drawing moves the state: a digest is of the state, not of the seed
        assert stream_digests()["torch"] != again["torch"]
        if not (torch.cuda.is_available() and torch.cuda.is_initialized()):
            assert first["cuda"] == ABSENT
    finally:
        torch.set_rng_state(saved[0]), random.setstate(saved[1]), np.random.set_state(saved[2])


def test_python_digest_reads_the_state_given() -> None:
    state = random.Random(5).getstate()
    assert python_digest(state) == python_digest(random.Random(5).getstate()) != python_digest(random.Random(6).getstate())


def test_equal_groups_and_the_streams_a_group_shares() -> None:
    digests = {0: {"torch": 1, "cuda": ABSENT, "python": 7}, 1: {"torch": 1, "cuda": ABSENT, "python": 8},
               2: {"torch": 2, "cuda": ABSENT, "python": 7}, 3: {"torch": 1, "cuda": ABSENT, "python": 7}}
    assert equal_groups(digests, "torch") == [(0, 1, 3)]
    assert equal_groups(digests, "cuda") == []  # no rank has the stream: nothing is "equal"
    assert equal_groups(digests, "python") == [(0, 2, 3)]
    assert streams_equal_within(digests, (0, 3)) == ["torch", "python"] and streams_equal_within(digests, (0, 1)) == ["torch"]


@pytest.mark.parametrize("seed", [0, 42, 2**63 - 1, 2**63, 2**64 - 1])
def test_a_seed_survives_the_int64_slot(seed: int) -> None:
    assert -(2**63) <= encode_seed(seed) < 2**63 and decode_seed(encode_seed(seed)) == seed


def _row(torch_digest: int, seed: int | None, kind: str = "seedable", sharded: bool = True, epoch: int = 0) -> list[int]:
    digests = {"torch": torch_digest, "cuda": ABSENT, "python": 5, "numpy": 6}
    return pack(digests, SamplerSeed(kind, seed, epoch, sharded) if seed is not None else SamplerSeed())


def test_a_row_round_trips_and_rows_of_skips_ranks_that_sent_nothing() -> None:
    row = _row(11, 2**64 - 5, epoch=3)
    assert len(row) == WIDTH
    back = unpack(row)
    assert back is not None and back.digests["torch"] == 11 and back.digests["cuda"] == ABSENT
    assert (back.sampler.kind, back.sampler.seed, back.sampler.epoch, back.sampler.sharded) == ("seedable", 2**64 - 5, 3, True)
    assert unpack(_row(1, None)).sampler.seed is None  # type: ignore[union-attr]
    assert unpack(row[:-1]) is None and unpack(None) is None
    assert sorted(rows_of([row, None, row])) == [0, 2]


def test_shared_streams_name_the_ranks_and_every_stream_they_share() -> None:
    rows = rows_of([_row(1, 0), _row(1, 0), _row(2, 0)])
    (group,) = shared_streams(rows, "torch")
    assert group.ranks == (0, 1) and group.streams == ("torch", "python", "numpy") and group.stream == "torch"
    assert shared_streams(rows, "cuda") == []  # a CPU run has no CUDA stream to share
    assert shared_streams(rows_of([_row(1, 0), _row(2, 0)]), "torch") == []


def test_sampler_mismatch_only_among_sharded_ranks_with_a_known_seed() -> None:
    assert sampler_mismatch(rows_of([_row(1, 42), _row(1, 42)])) is None
    seeds = sampler_mismatch(rows_of([_row(1, 42), _row(1, 1234)]))
    assert seeds is not None and {r: s.seed for r, s in seeds.items()} == {0: 42, 1: 1234}
    assert sampler_mismatch(rows_of([_row(1, 42, epoch=0), _row(1, 42, epoch=1)])) is not None  # one seed, another epoch: another order
    assert sampler_mismatch(rows_of([_row(1, 42, sharded=False), _row(1, 7, sharded=False)])) is None  # unsharded: each rank its own order
    assert sampler_mismatch(rows_of([_row(1, 42), _row(1, None)])) is None  # nothing to compare with


def test_the_majority_seed_is_the_expected_one_and_rank_0_breaks_a_tie() -> None:
    seeds = sampler_mismatch(rows_of([_row(1, 7), _row(1, 42), _row(1, 42)]))
    assert seeds is not None and majority_seed(seeds).seed == 42
    tie = sampler_mismatch(rows_of([_row(1, 42), _row(1, 1234)]))
    assert tie is not None and majority_seed(tie).seed == 42
