"""`harness scan` over byte ranges: the same rows whatever the ranges and the workers; ids, positions, errors as before."""
from __future__ import annotations

import json
import random
from pathlib import Path
from typing import Any

import pytest

from harness.lib.ngrams import normalise_words
from harness.lib.text_ranges import byte_ranges
from harness.tools.scan import ScanError, ScanOptions, scan

N = 13


@pytest.fixture(scope="module")
def corpus(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    rng = random.Random(7)
    vocabulary = [f"{rng.choice('bcdfg')}{i}{rng.choice('aeiou')}" for i in range(4000)] + ["Ｈello", "café", "straße", "naïve"]

    def words(count: int) -> list[str]:
        return [rng.choice(vocabulary) for _ in range(count)]

    evals = [" ".join(words(rng.randint(20, 30))) for _ in range(20)]
    lines = [" ".join(words(rng.randint(30, 80))) + rng.choice(["", ".", "!?"]) for _ in range(600)]
    lines[437] = " ".join(lines[437].split()[:20]) + " " + evals[0].upper().replace(" ", ", ") + " " + lines[437]  # line 438
    evals[3] = " ".join(words(22))
    half = evals[3].split()
    lines[100] = lines[100] + " " + " ".join(half[:11])  # an example cut in two by a line break: no 13 words on one line
    lines[101] = " ".join(half[11:]) + " " + lines[101]
    lines[50] = ""  # a blank line still counts as a line
    root = tmp_path_factory.mktemp("ranges")
    (root / "train.txt").write_text("\n".join(lines) + "\n", encoding="utf-8")
    records = [{"text": " ".join(words(rng.randint(30, 80)))} for _ in range(400)]
    records[299]["text"] += " " + evals[1] + " end"  # line 300, no id: train.jsonl:300
    for k in range(0, 400, 2):
        records[k]["id"] = f"r{k}"
    records[122]["text"] = "start " + evals[2] + " end"
    with open(root / "train.jsonl", "w", encoding="utf-8") as handle:
        for record in records:
            handle.write(json.dumps(record, ensure_ascii=rng.random() < 0.5) + "\n")
    with open(root / "eval.jsonl", "w", encoding="utf-8") as handle:
        for e, text in enumerate(evals):
            handle.write(json.dumps({"id": f"e{e}", "text": text}) + "\n")
    return {"root": root, "evals": evals, "lines": lines}


def _scan(root: Path, **kwargs: Any) -> Any:
    return scan([str(root / "train.txt"), str(root / "train.jsonl")], [str(root / "eval.jsonl")], options=ScanOptions(n=N),
                progress=False, **kwargs)


def test_ranges_and_workers_give_the_same_rows(corpus: dict[str, Any]) -> None:
    root = corpus["root"]
    one = _scan(root, range_bytes=1 << 30)
    assert len(byte_ranges(root / "train.txt", 2000)) > 20
    many = _scan(root, range_bytes=2000)
    two = _scan(root, range_bytes=2000, workers=2)
    assert one.rows == many.rows == two.rows
    assert one.documents == many.documents == two.documents == 599 + 400 and one.units == two.units
    rows = {r["id"]: r for r in one.rows}
    assert {i for i, r in rows.items() if r["documents_hit"]} == {"e0", "e1", "e2"}
    assert rows["e3"]["status"] == "clean"  # its halves sit on two lines
    expected = " ".join(normalise_words(corpus["evals"][0])[:N])  # the first matched window's words
    assert rows["e0"]["locations"] == [{"document": "train.txt:438", "position": 20, "snippet": expected}]
    assert rows["e0"]["status"] == "dirty" and rows["e0"]["matched_fraction"] == 1.0
    assert rows["e1"]["locations"][0]["document"] == "train.jsonl:300"
    assert rows["e2"]["locations"][0] == {"document": "r122", "position": 1, "snippet": " ".join(normalise_words(corpus["evals"][2])[:N])}


def test_byte_ranges_cover_the_file_at_line_breaks(corpus: dict[str, Any]) -> None:
    path = corpus["root"] / "train.txt"
    data = path.read_bytes()
    ranges = byte_ranges(path, 1500)
    assert ranges[0][0] == 0 and ranges[-1][1] == len(data)
    assert all(a[1] == b[0] for a, b in zip(ranges, ranges[1:]))
    assert all(data[stop - 1 : stop] == b"\n" for _, stop in ranges)


@pytest.mark.parametrize("case", ["utf8", "json", "json_before_utf8", "missing", "not_text"])
def test_a_problem_in_a_later_range_names_its_line(case: str, tmp_path: Path) -> None:
    (tmp_path / "eval.jsonl").write_text(json.dumps({"id": "e", "text": " ".join(f"w{i}" for i in range(20))}) + "\n")
    lines = [json.dumps({"id": f"d{k}", "text": f"some words of document {k}"}).encode() for k in range(400)]
    bad = {"utf8": {250: b'{"text": "caf\xe9"}'}, "json": {260: b'{"text": '}, "missing": {270: b'{"body": "x"}'},
           "json_before_utf8": {262: b"not json", 264: b'{"text": "\xff"}'}, "not_text": {280: b'{"text": 12345}'}}[case]
    for line, content in bad.items():
        lines[line - 1] = content
    (tmp_path / "train.jsonl").write_bytes(b"\n".join(lines) + b"\n")
    expected = {"utf8": "line 250 is not valid UTF-8 (byte 0xe9 at column 14)", "json": "line 260 is not JSON",
                "missing": "line 270 has no field 'text' (it has: body)", "json_before_utf8": "line 262 is not JSON",
                "not_text": "line 280: field 'text' holds a int ('12345'), not text"}[case]
    for workers in (1, 2):
        with pytest.raises(ScanError, match=expected.replace("(", r"\(").replace(")", r"\)")):
            scan([str(tmp_path / "train.jsonl")], [str(tmp_path / "eval.jsonl")], workers=workers, progress=False, range_bytes=700)


def test_token_front_end_batched_over_ranges_and_workers(corpus: dict[str, Any], tokenizer: Any) -> None:
    root = corpus["root"]
    one = _scan(root, tokenizer=tokenizer, range_bytes=1 << 30)
    two = _scan(root, tokenizer=tokenizer, range_bytes=3000, workers=2)
    assert one.front_end == "tokens" and one.rows == two.rows and one.units == two.units
    rows = {r["id"]: r for r in one.rows}
    assert {"e1", "e2"} <= {i for i, r in rows.items() if r["status"] == "dirty"}  # copied verbatim: found as token ids too
    assert rows["e1"]["locations"][0]["document"] == "train.jsonl:300"
    assert one.units == sum(len(tokenizer(t, add_special_tokens=False)["input_ids"]) for t in corpus["lines"] if t.strip()) + sum(
        len(tokenizer(json.loads(line)["text"], add_special_tokens=False)["input_ids"]) for line in (root / "train.jsonl").read_text().splitlines())


def test_equal_word_hashes_of_other_words_are_no_match() -> None:
    """A training window whose word hashes equal an example's but whose words differ (a hash collision) is not a hit."""
    from harness.lib.ngrams import EvalExample, NgramIndex, word_units
    from harness.lib.overlap import FrontEnd
    from harness.tools.scan_work import Scanner, Work

    training = " ".join(f"word{i}" for i in range(30))
    colliding = EvalExample("e", "x", " ".join(f"other{i}" for i in range(20)), [word_units(normalise_words(training))[5:25]])
    work = Work(0, "docs", "docs", documents=[("d1", "lead " + training)])
    found = Scanner(NgramIndex.build([colliding], n=N), FrontEnd(None), "text", "id", 160).run(work)
    assert found.hits == [] and found.units == 31
    textless = EvalExample("e", "x", None, colliding.variants)  # without the words to compare, the units alone decide
    found = Scanner(NgramIndex.build([textless], n=N), FrontEnd(None), "text", "id", 160).run(work)
    assert [(h.position, h.offset) for _, h, _, _ in found.hits] == [(6 + k, k) for k in range(20 - N + 1)]
