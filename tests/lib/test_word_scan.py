"""The chunked words front end: the same words and units as ``normalise_words`` + ``word_units``, whatever the path."""
from __future__ import annotations

import random

import numpy as np

from harness.lib.ngrams import EvalExample, NgramIndex, normalise_words, window_hashes, word_units
from harness.lib.word_scan import LINE_TABLE, WORD_TABLE, WordChunk, documents_buffer, lines_buffer, normalised_bytes, word_hashes

ASCII_POOL = list("abcXYZ019_ \t\r.,;:!?'\"-()[]{}<>/\\|@#$%^&*+=~`") + ["\x0b", "\x0c", "\x1c", "\x1f", "\x00", "\x7f"]
UNICODE_POOL = ["é", "É", "ß", "Ｈ", "ﬁ", "Ω", "ω", "中", "文", "\u3000", "\u00a0", "\u2028", "e\u0301", "İ", "①", "٣", "ǅ", "—", "…", "\u200b"]


def _texts(seed: int, count: int, unicode: bool) -> list[str]:
    rng = random.Random(seed)
    pool = ASCII_POOL + (UNICODE_POOL if unicode else [])
    out = []
    for _ in range(count):
        parts = []
        for _ in range(rng.randint(0, 30)):
            if rng.random() < 0.6:
                parts.append("".join(rng.choice("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789") for _ in range(rng.randint(1, 20))))
            else:
                parts.append("".join(rng.choice(pool) for _ in range(rng.randint(1, 3))))
        out.append("".join(parts))
    return out


def _encoded(words: list[str]) -> list[bytes]:
    return [w.encode("utf-8") for w in words]


def test_the_ascii_translate_is_exactly_normalise_words() -> None:
    for text in _texts(0, 300, unicode=False):
        assert text.encode().translate(WORD_TABLE).split() == _encoded(normalise_words(text)), repr(text)
        assert normalised_bytes(text).split() == _encoded(normalise_words(text))
    assert b"A_b\nC".translate(LINE_TABLE) == b"a b\nc" and b"A_b\nC".translate(WORD_TABLE) == b"a b c"


def test_a_chunk_gives_every_documents_words_and_units_on_ascii_and_unicode() -> None:
    for seed, unicode in [(1, False), (2, True), (3, True)]:
        texts = _texts(seed, 200, unicode)
        chunk = WordChunk.of(documents_buffer(texts))
        edges = [*chunk.bounds.tolist(), len(chunk.units)]
        assert len(chunk.bounds) == len(texts)
        for d, text in enumerate(texts):
            words = normalise_words(text)
            first, stop = edges[d], edges[d + 1]
            assert chunk.words(first, stop - first) == _encoded(words), repr(text)
            assert chunk.units[first:stop].tolist() == word_units(words).tolist()  # eval side and training side agree


def test_lines_of_a_text_file_mixed_ascii_and_not() -> None:
    lines = [t.encode("utf-8") for t in _texts(4, 200, unicode=True)]
    lines = [line.replace(b"\n", b" ") for line in lines]
    chunk = WordChunk.of(lines_buffer(lines))
    edges = [*chunk.bounds.tolist(), len(chunk.units)]
    for k, line in enumerate(lines):
        assert chunk.words(edges[k], edges[k + 1] - edges[k]) == _encoded(normalise_words(line.decode("utf-8")))


def test_word_hashes_depend_on_the_word_only() -> None:
    words = ["a", "ab", "abcdefgh", "abcdefghi", "abcdefghabcdefgh", "abcdefghabcdefghx", "x" * 40, "été", "中文"]
    alone = [int(word_units([w])[0]) for w in words]
    assert len(set(alone)) == len(words)
    buffer = ("  ".join(words) + " zz").encode()
    chunk = WordChunk.of(buffer)
    assert chunk.units[: len(words)].tolist() == alone  # neighbours and offsets change nothing
    assert word_hashes(b"ab", np.array([0]), np.array([1]))[0] == word_units(["a"])[0]  # only the word's own bytes
    rng = random.Random(0)
    units = word_units([f"w{rng.randrange(5000)}" for _ in range(4096 + 12)])
    for n in (4, 13):  # the bitmap prefilter reads the top bits of window hashes: they look random
        top = window_hashes(units, n)[:4096] >> np.uint64(52)
        assert len(set(top.tolist())) > 2450  # 4096 throws into 4096 bins fill about 2589


def test_windows_never_span_two_documents() -> None:
    rng = np.random.default_rng(0)
    example = rng.integers(0, 1 << 40, 20).astype(np.uint64)
    index = NgramIndex.build([EvalExample("e", "x", None, [example])], n=5, template_min_examples=0)
    documents = [rng.integers(0, 1 << 40, 30).astype(np.uint64) for _ in range(4)]
    documents[1][-3:] = example[:3]  # an example's window cut by a document boundary ...
    documents[2][:2] = example[3:5]
    documents[3][10:17] = example[5:12]  # ... and one inside a document: 3 windows
    units = np.concatenate(documents)
    bounds = np.array([0, 30, 60, 90])
    hits = index.query_segments(units, bounds)
    assert [(h.row, h.position, h.offset) for h in hits] == [(3, 10, 5), (3, 11, 6), (3, 12, 7)]
    per_document = [(d, h.position, h.offset) for d, doc in enumerate(documents) for h in index.query(doc)]
    assert per_document == [(h.row, h.position, h.offset) for h in hits]


def test_eval_examples_hashed_in_one_chunk_equal_one_by_one() -> None:
    from harness.lib.overlap import FrontEnd

    texts = _texts(5, 100, unicode=True)
    front = FrontEnd(None)
    many = front.eval_variants_many(texts)
    assert [[v.tolist() for v in variants] for variants in many] == [[v.tolist() for v in front.eval_variants(t)] for t in texts]
    assert [front.document(t)[0].tolist() for t in texts] == [variants[0].tolist() for variants in many]


def test_the_index_holds_every_window_but_the_templates_by_brute_force() -> None:
    """``NgramIndex.build`` (all examples hashed in one pass, templates found by sorting) against a plain loop."""
    rng = np.random.default_rng(11)
    template = rng.integers(0, 1 << 40, 9).astype(np.uint64)  # a prompt shared by 12 examples: left out at limit 10
    examples = []
    for k in range(40):
        variants = []
        for _ in range(int(rng.integers(1, 3))):
            units = rng.integers(0, 1 << 40, int(rng.integers(0, 30))).astype(np.uint64)
            if k < 12:
                units = np.concatenate([template, units])
            variants.append(units)
        examples.append(EvalExample("e", f"x{k}", None, variants))
    n, limit = 6, 10
    index = NgramIndex.build(examples, n=n, template_min_examples=limit, min_length=2)
    windows: dict[int, list[tuple[int, int, int, int]]] = {}  # length -> (hash, example, variant, offset)
    for e, example in enumerate(examples):
        for v, units in enumerate(example.variants):
            if len(units) >= 2:
                length = min(n, len(units))
                windows.setdefault(length, []).extend((int(h), e, v, o) for o, h in enumerate(window_hashes(units, length)))
    dropped = 0
    for length, rows in windows.items():
        owners: dict[int, set[int]] = {}
        for h, e, _, _ in rows:
            owners.setdefault(h, set()).add(e)
        kept = sorted(r for r in rows if len(owners[r[0]]) < limit)
        dropped += len(rows) - len(kept)
        table = index.tables[length]
        got = sorted(zip(table.hashes.tolist(), table.examples.tolist(), table.variants.tolist(), table.offsets.tolist()))
        assert got == kept
    assert set(index.tables) == set(windows) and index.templates_dropped == dropped > 0
