"""The C kernels of `harness scan` give the numpy code's arrays bit for bit, and the scan's rows are the same either way."""
from __future__ import annotations

import os
import random
from pathlib import Path

import numpy as np
import pytest

from harness.lib import ngrams, word_scan
from harness.lib.ngrams import EvalExample, NgramIndex, window_hashes
from harness.lib.scan_kernels import KERNELS
from harness.lib.word_scan import LINE_TABLE, WordChunk, find_words, word_hashes

if KERNELS is None:  # CI builds them (`.ci/run` sets HARNESS_REQUIRE_SCAN_KERNELS): there a missing build is a failure
    if os.environ.get("HARNESS_REQUIRE_SCAN_KERNELS") == "1":
        pytest.fail("harness.lib._scan_kernels was not built: the install needs a C compiler and the Python headers "
                    "(scripts/setup compiles it); without it harness scan runs its numpy code, several times slower", pytrace=False)
    pytest.skip("harness.lib._scan_kernels is not built here (no C compiler at install time)", allow_module_level=True)


@pytest.fixture
def numpy_only(monkeypatch: pytest.MonkeyPatch) -> None:
    """What the callers do where the kernels are not built."""
    monkeypatch.setattr(word_scan, "KERNELS", None)
    monkeypatch.setattr(ngrams, "KERNELS", None)


def _normalised_buffers(seed: int) -> list[bytes]:
    """Normalised buffers as the scan makes them: words of a-z0-9 and UTF-8 bytes, spaces and line breaks between,
    words from 1 to 40 bytes (one block, two, several), separators at either end or none, runs of line breaks."""
    rng = random.Random(seed)
    letters = b"abcdefghijklmnopqrstuvwxyz0123456789"
    out = [b"", b" ", b"\n", b"\n\n", b"a", b"abcdefgh", b"abcdefghi", b"x" * 64, b" \n a \n", b"\xc3\xa9t\xc3\xa9 caf\xc3\xa9"]
    for _ in range(60):
        parts = []
        for _ in range(rng.randint(0, 40)):
            length = rng.choice([1, 2, 5, 7, 8, 9, 15, 16, 17, 24, 25, 40])
            word = bytes(rng.choice(letters) if rng.random() < 0.9 else rng.randint(0x80, 0xFF) for _ in range(length))
            parts.append(word + rng.choice([b" ", b" ", b"  ", b"\n", b" \n ", b"\n\n"]))
        buffer = b"".join(parts)
        out.append(buffer.rstrip() if rng.random() < 0.5 else buffer)  # ending inside a word or after a separator
    return out


def _any_bytes(seed: int) -> list[bytes]:
    """Buffers of every byte value (control bytes, punctuation, 0x20/0x21 side by side, 0x80 and up), as a caller
    that passes a buffer normalised some other way would: a word is still a run of bytes above space."""
    rng = random.Random(seed)
    out = [bytes(range(256)), bytes(range(255, -1, -1)), b"\x20\x21" * 9, b"\x21" * 17 + b"\x20", b"\x00\x7f\xff\x80"]
    for _ in range(300):
        out.append(bytes(rng.choice([rng.randint(0, 255), 0x20, 0x21, 0x0A, rng.randint(0x21, 0x7F)]) for _ in range(rng.randint(0, 70))))
    return out


def _chunk_arrays(chunk: WordChunk) -> tuple[bytes, list[list[int]]]:
    return bytes(chunk.buffer), [a.tolist() for a in (chunk.starts, chunk.ends, chunk.units, chunk.bounds, chunk.breaks)]


def test_words_equal_the_numpy_front_end(monkeypatch: pytest.MonkeyPatch) -> None:
    for buffer in _normalised_buffers(0) + _any_bytes(2):
        fast = WordChunk.of(buffer)
        starts, ends = find_words(buffer)
        assert fast.starts.tolist() == starts.tolist() and fast.ends.tolist() == ends.tolist(), buffer
        assert fast.units.tolist() == word_hashes(buffer, starts, ends).tolist(), buffer
        with monkeypatch.context() as patch:
            patch.setattr(word_scan, "KERNELS", None)
            slow = WordChunk.of(buffer)
        assert _chunk_arrays(fast) == _chunk_arrays(slow), buffer


def test_a_raw_ascii_range_is_translated_as_bytes_translate_does(monkeypatch: pytest.MonkeyPatch) -> None:
    rng = random.Random(1)
    pool = "abcXYZ019_ \t\r\n.,;:!?'\"-()[]{}<>/\\|@#$%^&*+=~`\x0b\x0c\x00\x7f"
    for _ in range(40):
        raw = "".join(rng.choice(pool) if rng.random() < 0.4 else rng.choice("abcdefghijklmnopqrstuvwxyzQWERTY") * rng.randint(1, 19)
                      for _ in range(rng.randint(0, 200))).encode("ascii")
        fast = WordChunk.of(raw, LINE_TABLE)
        assert bytes(fast.buffer) == raw.translate(LINE_TABLE)
        with monkeypatch.context() as patch:
            patch.setattr(word_scan, "KERNELS", None)
            assert _chunk_arrays(fast) == _chunk_arrays(WordChunk.of(raw, LINE_TABLE))


@pytest.mark.parametrize("n", [1, 5, 13])
@pytest.mark.parametrize("bits", [16, 21, 24, 28])
def test_window_candidates_are_the_windows_that_pass_the_bitmap(n: int, bits: int) -> None:
    rng = np.random.default_rng(n * 100 + bits)
    index = NgramIndex(n=n, examples=[], bitmap_bits=bits)
    index._bitmap = rng.integers(0, 256, 1 << (bits - 3), dtype=np.uint8) & rng.integers(0, 256, 1 << (bits - 3), dtype=np.uint8)
    index._bitmap[0] |= 1  # slot 0: where the hashes of single small units (n = 1) fall
    for units in (rng.integers(0, 1 << 63, 5000, dtype=np.int64).view(np.uint64), rng.integers(0, 50_000, 3000),
                  rng.integers(0, 50_000, 2000).astype(np.int32), np.arange(n - 1, dtype=np.uint64), np.zeros(n, dtype=np.uint64)):
        hashes = window_hashes(units, n)
        expected = index._maybe(hashes)
        assert index._maybe_many(hashes).tolist() == expected.tolist()  # the numpy path the kernel replaces
        data = units if units.dtype in (np.int64, np.uint64) else units.astype(np.uint64)  # what _window_candidates passes
        positions, found = KERNELS.window_candidates(data, n, index._bitmap, bits)
        assert np.frombuffer(positions, dtype=np.int64).tolist() == expected.tolist()
        assert np.frombuffer(found, dtype=np.uint64).tolist() == hashes[expected].tolist()
        assert len(expected) > 0 or len(hashes) < 100  # the test sees candidates (a quarter of the slots are set)


def test_query_segments_finds_the_same_hits_either_way(numpy_only: None, monkeypatch: pytest.MonkeyPatch) -> None:
    rng = np.random.default_rng(3)
    examples = [EvalExample("e", f"x{k}", None, [rng.integers(0, 1 << 40, int(rng.integers(4, 30))).astype(np.uint64)]) for k in range(50)]
    index = NgramIndex.build(examples, n=8, template_min_examples=0)
    documents = [rng.integers(0, 1 << 40, int(rng.integers(0, 200))).astype(np.uint64) for _ in range(40)]
    for k, document in enumerate(documents[:30]):  # plant windows (some cut by a document's end), short examples too
        example = examples[k].variants[0]
        at = int(rng.integers(0, max(len(document) - 5, 1)))
        piece = example[: min(len(example), len(document) - at)]
        document[at : at + len(piece)] = piece
    units = np.concatenate(documents)
    bounds = np.cumsum([0] + [len(d) for d in documents[:-1]])
    slow = [(h.example, h.offset, h.length, h.position, h.row) for h in index.query_segments(units, bounds)]
    monkeypatch.setattr(ngrams, "KERNELS", KERNELS)
    fast = [(h.example, h.offset, h.length, h.position, h.row) for h in index.query_segments(units, bounds)]
    assert fast == slow and len(slow) > 30


def test_the_scan_gives_the_same_rows_without_the_kernels(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from harness.tools.scan import ScanOptions, scan

    rng = random.Random(5)
    vocabulary = [f"{rng.choice('bcdfgXY')}{i}{rng.choice('aeiou')}" for i in range(3000)] + ["café", "straße", "abcdefghijklmnopq"]
    evals = [" ".join(rng.choice(vocabulary) for _ in range(rng.randint(15, 40))) for _ in range(30)]
    lines = [" ".join(rng.choice(vocabulary) for _ in range(rng.randint(20, 90))) + rng.choice(["", ".", ", !"]) for _ in range(800)]
    for k in range(0, 800, 80):
        lines[k] += " " + evals[k // 80].upper().replace(" ", "; ")
    (tmp_path / "train.txt").write_text("\n".join(lines) + "\n", encoding="utf-8")
    (tmp_path / "eval.txt").write_text("\n".join(evals) + "\n", encoding="utf-8")
    run = lambda: scan([str(tmp_path / "train.txt")], [str(tmp_path / "eval.txt")], options=ScanOptions(n=13), progress=False,  # noqa: E731
                       range_bytes=4000).rows
    fast = run()
    monkeypatch.setattr(word_scan, "KERNELS", None)
    monkeypatch.setattr(ngrams, "KERNELS", None)
    assert run() == fast
    assert sum(row["status"] == "dirty" for row in fast) == 10


def test_window_candidates_refuses_what_it_cannot_read() -> None:
    with pytest.raises(ValueError, match="8-byte values"):
        KERNELS.window_candidates(np.zeros(5, dtype=np.int32), 2, np.zeros(1 << 13, dtype=np.uint8), 16)
    with pytest.raises(ValueError, match="2\\^bits"):
        KERNELS.window_candidates(np.zeros(5, dtype=np.uint64), 2, np.zeros(8, dtype=np.uint8), 16)


def test_query_rows_finds_the_same_hits_either_way_and_never_across_rows(numpy_only: None, monkeypatch: pytest.MonkeyPatch) -> None:
    """The contamination checker's lookup of a micro-batch: every window inside a row that is an indexed eval window."""
    rng = np.random.default_rng(5)
    examples = [EvalExample("e", f"x{k}", None, [rng.integers(0, 50_000, 24).astype(np.int64)]) for k in range(40)]
    index = NgramIndex.build(examples, n=8, template_min_examples=0)
    rows = rng.integers(0, 50_000, (32, 40)).astype(np.int64)
    for k in range(20):  # whole windows inside a row, at every offset from the start to the last that fits
        at = k % 33
        rows[k, at : at + 8] = examples[k].variants[0][:8]
    rows[30, 36:], rows[31, :4] = examples[30].variants[0][:4], examples[30].variants[0][4:8]  # one cut by the row's end
    windows = {tuple(e.variants[0][i : i + 8].tolist()) for e in examples for i in range(17)}
    expected = sorted((r, p) for r in range(32) for p in range(33) if tuple(rows[r, p : p + 8].tolist()) in windows)
    slow = sorted((h.row, h.position) for h in index.query_rows(rows))
    monkeypatch.setattr(ngrams, "KERNELS", KERNELS)
    fast = sorted((h.row, h.position) for h in index.query_rows(rows))
    assert fast == slow == expected and len(expected) >= 20 and all(r != 30 or p < 33 for r, p in expected)


def test_hits_say_when_their_window_starts_or_ends_its_training_row() -> None:
    """The contamination judgement tells a training block boundary from other text by the row's edges (issue 43)."""
    eval_units = np.arange(100, 140, dtype=np.int64)
    index = NgramIndex.build([EvalExample("eval", "0", None, [eval_units])], 4, 0, 1)
    rows = np.stack([np.r_[eval_units[10:20], 7, 8], np.r_[7, 8, eval_units[:10]]]).astype(np.int64)
    edges = {(h.row, h.offset): (h.row_start, h.row_end) for h in index.query_rows(rows)}
    assert edges[(0, 10)] == (True, False) and edges[(0, 16)] == (False, False) and edges[(1, 6)] == (False, True)
    assert not any(start or end for (row, offset), (start, end) in edges.items() if (row, offset) not in {(0, 10), (1, 6)})
    segments = index.query_segments(rows.reshape(-1), np.array([0, 12]))
    assert {(h.row, h.offset): (h.row_start, h.row_end) for h in segments} == edges
