"""`harness scan --write-clean DIR`: planted documents dropped (or their spans cut), clean ones kept byte for byte, rescan clean."""
from __future__ import annotations

import json
import random
from pathlib import Path
from typing import Any

import pandas as pd
import pytest

from harness.cli import main
from harness.lib.documents import ScanError, document_files, iter_documents
from harness.lib.records import iter_records, replace_text
from harness.lib.safe_paths import UnsafePathError
from harness.lib.spans import cut_spans, word_char_spans
from harness.tools.decontaminate import CleanOptions, check_clean_dir, write_clean
from harness.tools.scan import ScanOptions, scan

OPTIONS = ScanOptions(n=8)


def _text(rng: random.Random, count: int) -> str:
    return " ".join(f"w{rng.randrange(5000)}z" for _ in range(count))


@pytest.fixture()
def corpus(tmp_path: Path) -> dict[str, Any]:
    """Two training files (txt, jsonl with extra fields); eval q0 planted in a txt line, q1 in a jsonl record, a third of q2
    (partial, not dirty) in another txt line."""
    rng = random.Random(7)
    evals = [{"id": f"q{i}", "text": _text(rng, 30), "answer": i} for i in range(12)]
    lines = [_text(rng, 60) for _ in range(40)]
    lines[5] = _text(rng, 20) + " " + evals[0]["text"].upper() + ". " + _text(rng, 20)  # restyled: still a match
    lines[10] = _text(rng, 20) + " " + " ".join(evals[2]["text"].split()[:10]) + " " + _text(rng, 20)  # q2 partial: kept
    records = [{"id": f"d{i}", "text": _text(rng, 60), "meta": {"k": [1, 2.50, "x"]}, "source": "web"} for i in range(30)]
    before, after = _text(rng, 80), _text(rng, 80)
    records[3]["text"] = f"{before} {evals[1]['text']} {after}"
    root = tmp_path / "data"
    (root / "train").mkdir(parents=True)
    (root / "train" / "a.txt").write_text("\n".join(lines[:20]) + "\n\n" + "\n".join(lines[20:]) + "\n", encoding="utf-8")
    with open(root / "train" / "b.jsonl", "w", encoding="utf-8") as handle:
        for record in records:
            handle.write(json.dumps(record, separators=(",", ":")) + "\n")  # compact: a re-dump would change the bytes
    with open(root / "eval.jsonl", "w", encoding="utf-8") as handle:
        for example in evals:
            handle.write(json.dumps(example) + "\n")
    return {"root": root, "evals": evals, "lines": lines, "records": records, "before": before, "after": after}


def _clean(corpus: dict[str, Any], out: Path, every_document: bool = False, **options: Any) -> Any:
    root = corpus["root"]
    train, evals = [str(root / "train")], [str(root / "eval.jsonl")]
    result = scan(train, evals, options=OPTIONS, progress=False)
    assert [(r["id"], r["status"]) for r in result.rows if r["status"] != "clean"] == [("q0", "dirty"), ("q1", "dirty"), ("q2", "partial")]
    return write_clean(result, train, evals, "text", None, "id", None, OPTIONS, CleanOptions(out, **options), progress=False,
                       every_document=every_document)


def _rescan_dirty(out: Path, corpus: dict[str, Any]) -> list[str]:
    """Eval examples the clean copy still matches, but for q2 (partial before, so kept, and partial still)."""
    again = scan([str(out / "train")], [str(corpus["root"] / "eval.jsonl")], options=OPTIONS, progress=False)
    assert again.rows[2]["status"] == "partial" and again.rows[2]["documents_hit"] == 1  # only dirty examples' matches go
    return [r["id"] for r in again.rows if r["status"] != "clean" and r["id"] != "q2"]


@pytest.mark.parametrize("every_document", [False, True])
def test_write_clean_drops_the_planted_documents_and_keeps_the_rest_byte_for_byte(corpus: dict[str, Any], tmp_path: Path,
                                                                                   every_document: bool) -> None:
    """The scan located every match (judge those documents only) or not (judge every document): the same copy."""
    out = tmp_path / "clean"
    report = _clean(corpus, out, every_document=every_document)
    root = corpus["root"]
    assert sorted(d["id"] for d in report.dropped) == ["a.txt:6", "d3"]
    original_txt = (root / "train" / "a.txt").read_bytes().splitlines(keepends=True)
    assert (out / "train" / "train" / "a.txt").read_bytes() == b"".join(original_txt[:5] + original_txt[6:])
    original_jsonl = (root / "train" / "b.jsonl").read_bytes().splitlines(keepends=True)
    assert (out / "train" / "train" / "b.jsonl").read_bytes() == b"".join(original_jsonl[:3] + original_jsonl[4:])
    assert _rescan_dirty(out, corpus) == []  # nothing, not even a partial match, is left of the dirty examples
    clean_ids = [json.loads(line)["id"] for line in (out / "eval" / "eval.clean.jsonl").read_text().splitlines()]
    dirty_ids = [json.loads(line)["id"] for line in (out / "eval" / "eval.dirty.jsonl").read_text().splitlines()]
    assert dirty_ids == ["q0", "q1"] and clean_ids == [f"q{i}" for i in range(2, 12)]
    assert (out / "eval" / "eval.dirty.jsonl").read_text().splitlines()[0] == json.dumps(corpus["evals"][0])  # every field kept
    data = json.loads((out / "decontamination.json").read_text())
    assert data["totals"] == {"documents": 70, "kept": 68, "masked": 0, "dropped": 2, "spans_cut": 0,
                              "chars_removed": len(corpus["lines"][5]) + len(corpus["records"][3]["text"])}
    assert [e["to_dirty"] for e in data["eval"]] == [2]
    markdown = (out / "decontamination.md").read_text()
    assert "a.txt:6" in markdown and "d3" in markdown and "68 kept unchanged" in markdown


def _widened(text: str, start: int, end: int) -> tuple[int, int]:
    """The cut the janitor's margin asks for, grown to whole words (words here are separated by single spaces)."""
    while 0 < start < len(text) and text[start - 1] != " " and text[start] != " ":
        start -= 1
    while 0 < end < len(text) and text[end - 1] != " " and text[end] != " ":
        end += 1
    return start, end


def test_mask_spans_cuts_the_match_with_its_margin_and_keeps_the_rest(corpus: dict[str, Any], tmp_path: Path) -> None:
    out = tmp_path / "masked"
    report = _clean(corpus, out, mask_spans=True, margin=30)
    original = corpus["records"][3]
    full, planted = original["text"], corpus["evals"][1]["text"]
    match = len(corpus["before"]) + 1
    start, end = _widened(full, match - 30, match + len(planted) + 30)
    expected = full[:start].rstrip() + " " + full[end:].lstrip()
    raw = (out / "train" / "train" / "b.jsonl").read_bytes().splitlines(keepends=True)
    original_raw = (corpus["root"] / "train" / "b.jsonl").read_bytes().splitlines(keepends=True)
    assert raw[3] == original_raw[3].replace(full.encode(), expected.encode())  # only the text changed, every other byte kept
    assert raw[:3] + raw[4:] == original_raw[:3] + original_raw[4:]
    masked = {m["id"]: m for m in report.masked}
    assert set(masked) == {"a.txt:6", "d3"} and masked["d3"] == {"id": "d3", "file": str(corpus["root"] / "train" / "b.jsonl"),
                                                                "spans": 1, "chars_removed": len(full) - len(expected)}
    line = (out / "train" / "train" / "a.txt").read_text().splitlines()[5]
    assert corpus["lines"][5].startswith(line.split(" ")[0]) and corpus["evals"][0]["text"].split()[5].upper() not in line
    assert report.dropped == [] and _rescan_dirty(out, corpus) == []


def test_mask_spans_drops_a_document_with_too_many_cuts(corpus: dict[str, Any], tmp_path: Path) -> None:
    rng = random.Random(1)
    planted = corpus["evals"][1]["text"]
    corpus["records"][3]["text"] = " ".join(f"{_text(rng, 40)} {planted}" for _ in range(3)) + " " + _text(rng, 40)
    with open(corpus["root"] / "train" / "b.jsonl", "w", encoding="utf-8") as handle:
        for record in corpus["records"]:
            handle.write(json.dumps(record) + "\n")
    report = _clean(corpus, tmp_path / "out", mask_spans=True, margin=10, max_spans=2)
    assert {d["id"]: d["reason"] for d in report.dropped} == {"d3": "too_many_spans"}
    assert _rescan_dirty(tmp_path / "out", corpus) == []


def test_cut_spans_and_word_char_spans() -> None:
    text = "Alpha beta, gamma delta epsilon zeta eta theta"
    spans = word_char_spans(text)
    assert spans is not None and [text[a:b] for a, b in spans] == text.replace(",", "").split()
    cut = cut_spans(text, [(12, 23)], margin=3, max_spans=10, min_words=1)  # "gamma delta", widened into beta and epsilon
    assert cut.text == "Alpha zeta eta theta" and cut.ranges == [(6, 31)]
    assert cut_spans(text, [(0, len(text))], 0, 10, 1).reason == "too_little_left"
    assert word_char_spans("caf\u00e9 ok") == [(0, 4), (5, 7)]
    assert word_char_spans("cafe\u0301 ok") is None  # NFKC joins the combining accent: no exact mapping, the caller drops
    line = b'{"a": 1.50, "text": "old", "x": {"text": "n"}}\r\n'  # the nested "text" and 1.50 stay as they are
    assert replace_text(line, "text", "new") == b'{"a": 1.50, "text": "new", "x": {"text": "n"}}\r\n'


def test_records_agree_with_iter_documents(corpus: dict[str, Any], tmp_path: Path) -> None:
    """The record readers see the documents (ids and texts, in order) the scan saw, in every format."""
    from datasets import Dataset

    root = corpus["root"]
    pd.DataFrame({"text": ["one two", "", "three"], "n": [1, 2, 3]}).to_parquet(root / "c.parquet")
    Dataset.from_list(corpus["evals"]).save_to_disk(str(tmp_path / "ds"))
    for path in [root / "train", root / "c.parquet", tmp_path / "ds"]:
        documents = [(r.id, r.text) for f in document_files(path) for r in iter_records(f, "text", "id") if r.text is not None]
        assert documents == list(iter_documents(path, "text", "id"))


def test_parquet_and_datasets_inputs_keep_their_schema(corpus: dict[str, Any], tmp_path: Path) -> None:
    import pyarrow.parquet as pq
    from datasets import Dataset

    root = corpus["root"]
    rows = [{"text": r["text"], "n": i, "score": 0.5} for i, r in enumerate(corpus["records"])]
    pd.DataFrame(rows).to_parquet(root / "p.parquet")
    Dataset.from_list(rows[:10]).save_to_disk(str(root / "ds"))
    train, evals = [str(root / "p.parquet"), str(root / "ds")], [str(root / "eval.jsonl")]
    result = scan(train, evals, options=OPTIONS, progress=False)
    out = tmp_path / "out"
    report = write_clean(result, train, evals, "text", None, "id", None, OPTIONS, CleanOptions(out), progress=False)
    assert sorted(d["id"] for d in report.dropped) == ["ds:4", "p.parquet:4"]
    written = pq.read_table(out / "train" / "p.parquet")
    assert written.schema == pq.read_schema(root / "p.parquet") and written.num_rows == 29
    lines = (out / "train" / "ds.jsonl").read_text().splitlines()
    assert len(lines) == 9 and json.loads(lines[3]) == rows[4]
    assert any("JSON lines" in note for note in report.notes)


def test_refuses_a_non_empty_dir_a_dir_inside_an_input_and_symlinks(corpus: dict[str, Any], tmp_path: Path) -> None:
    root = corpus["root"]
    inputs = [str(root / "train"), str(root / "eval.jsonl")]
    full = tmp_path / "full"
    full.mkdir()
    (full / "keep.txt").write_text("x")
    with pytest.raises(ScanError, match=r"full is not empty.*--force"):
        check_clean_dir(CleanOptions(full), inputs)
    check_clean_dir(CleanOptions(full, force=True), inputs)
    with pytest.raises(ScanError, match=r"is inside the input .*train"):
        check_clean_dir(CleanOptions(root / "train" / "clean"), inputs)
    with pytest.raises(ScanError, match=r"lies inside --write-clean"):
        check_clean_dir(CleanOptions(root), inputs)
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "precious.txt").write_text("keep me")
    linked = tmp_path / "linked"
    linked.mkdir()
    (linked / "train").symlink_to(outside)
    with pytest.raises(UnsafePathError, match=r"linked/train is a symlink.*Fix"):
        _clean(corpus, linked, force=True)
    with pytest.raises(UnsafePathError, match=r"symlink"):  # the write itself checks too (a link planted after the check)
        write_clean(scan([str(root / "train")], inputs[1:], options=OPTIONS, progress=False), inputs[:1], inputs[1:], "text", None,
                    "id", None, OPTIONS, CleanOptions(linked, force=True), progress=False, checked=True)
    assert [p.name for p in outside.iterdir()] == ["precious.txt"] and (outside / "precious.txt").read_text() == "keep me"
    (tmp_path / "dirlink").symlink_to(outside, target_is_directory=True)
    with pytest.raises(UnsafePathError, match="symlink"):
        check_clean_dir(CleanOptions(tmp_path / "dirlink", force=True), inputs)


def test_cli_write_clean_end_to_end(corpus: dict[str, Any], tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    root = corpus["root"]
    out = tmp_path / "clean"
    argv = ["scan", "--train", str(root / "train" / "b.jsonl"), "--eval", str(root / "eval.jsonl"), "-n", "8", "--workers", "1",
            "--out", str(tmp_path / "report"), "--write-clean", str(out), "--mask-spans", "--mask-margin", "30"]
    assert main(argv) == 1  # the input was dirty; the copy is written all the same
    printed = " ".join(capsys.readouterr().out.split())
    assert "clean copy:" in printed and "1 dirty eval examples split off" in printed and "1 with 1 spans cut" in printed
    assert (out / "train" / "b.jsonl").exists() and (out / "decontamination.md").exists()
    assert main(argv) == 2 and "is not empty" in capsys.readouterr().err  # a second run refuses without --force
    assert main([*argv, "--force"]) == 1
    again = ["scan", "--train", str(out / "train"), "--eval", str(out / "eval" / "eval.clean.jsonl"), str(root / "eval.jsonl"),
             "-n", "8", "--workers", "1", "--out", str(tmp_path / "report2")]
    assert main(again) == 0
    capsys.readouterr()
    lone = ["scan", "--train", str(root / "train" / "b.jsonl"), "--eval", str(root / "eval.jsonl"), "--out", str(tmp_path / "r3")]
    assert main([*lone, "--mask-spans"]) == 2 and "only apply with --write-clean" in capsys.readouterr().err
    assert main([*argv, "--force", "--mask-margin", "-1"]) == 2 and "--mask-margin -1 is negative" in capsys.readouterr().err


def test_a_prompt_template_shared_by_many_examples_does_not_drop_documents(tmp_path: Path) -> None:
    """The index holds every eval example, as the scan's does, so a template the scan ignored is ignored here too."""
    rng = random.Random(5)
    template = "answer the following question about the passage with one word please"
    evals = [f"{template} {_text(rng, 25)}" for _ in range(12)]
    docs = [_text(rng, 50) for _ in range(20)]
    docs[2] = f"{_text(rng, 10)} {evals[0]} {_text(rng, 10)}"
    docs[7] = f"{_text(rng, 10)} {template} {_text(rng, 30)}"  # the template alone: no eval example in it
    (tmp_path / "train.txt").write_text("\n".join(docs) + "\n")
    (tmp_path / "eval.txt").write_text("\n".join(evals) + "\n")
    train, eval_sets = [str(tmp_path / "train.txt")], [str(tmp_path / "eval.txt")]
    result = scan(train, eval_sets, options=OPTIONS, progress=False)
    assert [r["status"] for r in result.rows] == ["dirty"] + ["clean"] * 11
    report = write_clean(result, train, eval_sets, "text", None, "id", None, OPTIONS, CleanOptions(tmp_path / "out"), progress=False)
    assert [d["id"] for d in report.dropped] == ["train.txt:3"]
    assert (tmp_path / "out" / "train" / "train.txt").read_text().splitlines()[6] == docs[7]


def test_mask_spans_on_token_ids_cuts_by_the_tokenizer_offsets(tokenizer: Any, tmp_path: Path) -> None:
    """With --tokenizer the matches are token windows; the fast tokenizer's offsets place the cut in the original text."""
    rng = random.Random(2)
    letters = "abcdefghijklmnopqrstuvwxyz"
    def word() -> str:
        return "".join(rng.choice(letters) for _ in range(rng.randint(4, 8)))

    planted = " ".join(word() for _ in range(25))
    before, after = " ".join(word() for _ in range(40)), " ".join(word() for _ in range(40))
    docs = [" ".join(word() for _ in range(60)) for _ in range(10)]
    docs[4] = f"{before} {planted} {after}"
    (tmp_path / "train.txt").write_text("\n".join(docs) + "\n")
    (tmp_path / "eval.txt").write_text(planted + "\n" + " ".join(word() for _ in range(25)) + "\n")
    train, evals = [str(tmp_path / "train.txt")], [str(tmp_path / "eval.txt")]
    options = ScanOptions(n=13)
    result = scan(train, evals, tokenizer=tokenizer, options=options, progress=False)
    assert [r["status"] for r in result.rows] == ["dirty", "clean"]
    out = tmp_path / "out"
    report = write_clean(result, train, evals, "text", None, "id", tokenizer, options, CleanOptions(out, mask_spans=True, margin=0),
                         progress=False)
    assert [m["id"] for m in report.masked] == ["train.txt:5"] and report.dropped == []
    line = (out / "train" / "train.txt").read_text().splitlines()[4]
    assert line.startswith(before[:-12]) and line.endswith(after[12:]) and planted[8:-8] not in line  # edge tokens may differ
    assert len(line) >= len(before) + len(after) - 30
    again = scan([str(out / "train")], evals, tokenizer=tokenizer, options=options, progress=False)
    assert [r["status"] for r in again.rows] == ["clean", "clean"]


@pytest.mark.parametrize("mask", [False, True])
def test_a_near_duplicate_of_a_dirty_example_is_dropped(mask: bool, tmp_path: Path) -> None:
    """A lightly edited copy (--near-dup) has no verbatim span to cut: it is dropped in both modes, and the rescan is clean."""
    from harness.tools.scan import NearDuplicates

    rng = random.Random(3)
    evals = [_text(rng, 60) for _ in range(10)]
    docs = [_text(rng, 60) for _ in range(50)]
    edited = evals[4].split()
    for k in range(6, 60, 12):  # a word changed every 12 words: no 13-word run survives
        edited[k] = "changed"
    docs[17] = " ".join(edited)
    (tmp_path / "train.txt").write_text("\n".join(docs) + "\n")
    (tmp_path / "eval.txt").write_text("\n".join(evals) + "\n")
    train, eval_sets = [str(tmp_path / "train.txt")], [str(tmp_path / "eval.txt")]
    options = ScanOptions(n=13, near_dup=True, near_dup_threshold=0.5, shingle=3)
    result = scan(train, eval_sets, options=options, progress=False)
    assert [r["status"] for r in result.rows] == ["clean"] * 4 + ["dirty"] + ["clean"] * 5
    report = write_clean(result, train, eval_sets, "text", None, "id", None, options, CleanOptions(tmp_path / "out", mask_spans=mask),
                         near_factory=NearDuplicates, progress=False)
    assert report.dropped == [{"id": "train.txt:18", "file": str(tmp_path / "train.txt"), "reason": "near_duplicate",
                               "chars": len(docs[17])}]
    again = scan([str(tmp_path / "out" / "train")], eval_sets, options=options, progress=False)
    assert {r["status"] for r in again.rows} == {"clean"}


def test_an_example_in_more_documents_than_the_scan_locates_is_removed_from_all(tmp_path: Path) -> None:
    """Six copies, five locations in the row: the scan did not name them all, so every document is judged (here in two
    worker processes), and all six go."""
    from harness.tools.decontaminate import located_documents

    rng = random.Random(4)
    evals = [_text(rng, 30) for _ in range(4)]
    docs = [_text(rng, 40) for _ in range(600)]
    copies = [3, 90, 200, 333, 420, 599]
    for d in copies:
        docs[d] = f"{_text(rng, 10)} {evals[1]} {_text(rng, 10)}"
    (tmp_path / "train.txt").write_text("\n".join(docs) + "\n")
    (tmp_path / "eval.txt").write_text("\n".join(evals) + "\n")
    train, eval_sets = [str(tmp_path / "train.txt")], [str(tmp_path / "eval.txt")]
    result = scan(train, eval_sets, options=OPTIONS, progress=False)
    assert result.rows[1]["documents_hit"] == 6 and len(result.rows[1]["locations"]) == 5
    assert located_documents(result.rows, {1}) is None and located_documents(result.rows, {0}) == set()
    report = write_clean(result, train, eval_sets, "text", None, "id", None, OPTIONS, CleanOptions(tmp_path / "out"),
                         progress=False, workers=2)
    assert sorted(d["id"] for d in report.dropped) == sorted(f"train.txt:{d + 1}" for d in copies)
    assert "every training document was judged again" in report.notes
    kept = (tmp_path / "out" / "train" / "train.txt").read_text().splitlines()
    assert kept == [d for i, d in enumerate(docs) if i not in copies]
