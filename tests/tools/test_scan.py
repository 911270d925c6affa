"""`harness scan` on planted contamination: 10,000+ training documents, every planted copy found, clean stays clean."""
from __future__ import annotations

import json
import random
import re
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd
import pytest

from conftest import harness_cli
from harness.lib.ngrams import BASE, EvalExample, NgramIndex, normalise_words, window_hashes
from harness.tools.scan import FrontEnd, ScanError, ScanOptions, scan, write_outputs

N = 13
VERBATIM, RESTYLED, HALF, SHORT_PLANTED, SHORT_CLEAN = range(0, 20), range(20, 30), range(30, 40), range(40, 45), range(45, 50)


def _words(rng: random.Random, vocabulary: list[str], count: int) -> list[str]:
    return [rng.choice(vocabulary) for _ in range(count)]


def _restyle(text: str, rng: random.Random) -> str:
    """The same words with other case, punctuation and whitespace."""
    out = []
    for word in text.split():
        word = word.upper() if rng.random() < 0.5 else word.capitalize()
        out.append(word + rng.choice(["", ",", ";", " -", "!"]))
    return "  \t".join(out) + "?"


@pytest.fixture(scope="module")
def corpus(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    rng = random.Random(0)
    vocabulary = [f"w{i}x" for i in range(3000)]
    evals = []
    for i in range(200):
        length = rng.randint(6, 10) if i in SHORT_PLANTED or i in SHORT_CLEAN else rng.randint(40, 60) if i in HALF else rng.randint(24, 40)
        evals.append({"id": f"q{i}", "question": " ".join(_words(rng, vocabulary, length))})
    docs = [" ".join(_words(rng, vocabulary, rng.randint(30, 80))) for _ in range(10_500)]
    planted: dict[int, int] = {}
    for i in [*VERBATIM, *RESTYLED, *HALF, *SHORT_PLANTED]:
        text = evals[i]["question"]
        if i in RESTYLED:
            text = _restyle(text, rng)
        if i in HALF:
            words = text.split()
            text = " ".join(words[: len(words) // 2])
        d = rng.randrange(len(docs))
        while d in planted.values():
            d = rng.randrange(len(docs))
        words = docs[d].split()
        cut = rng.randint(5, len(words) - 5)
        docs[d] = " ".join(words[:cut]) + " " + text + " " + " ".join(words[cut:])
        planted[i] = d
    root = tmp_path_factory.mktemp("scan")
    (root / "train").mkdir()
    third = len(docs) // 3
    with open(root / "train" / "a.jsonl", "w") as handle:
        for d, text in enumerate(docs[:third]):
            handle.write(json.dumps({"id": f"doc{d}", "text": text}) + "\n")
    (root / "train" / "b.txt").write_text("\n".join(docs[third : 2 * third]) + "\n")
    pd.DataFrame({"text": docs[2 * third :]}).to_parquet(root / "train" / "c.parquet")
    with open(root / "eval.jsonl", "w") as handle:
        for example in evals:
            handle.write(json.dumps(example) + "\n")
    return {"root": root, "evals": evals, "docs": docs, "planted": planted}


def test_window_hashes_are_the_polynomial_and_stable() -> None:
    units = np.array([5, 0, 7, 7, 1, 9], dtype=np.int64)
    hashes = window_hashes(units, 3)
    assert len(hashes) == 4 and len(set(hashes.tolist())) == 4
    assert window_hashes(units[1:4], 3)[0] == hashes[1]  # a window hashes alike wherever it sits
    assert window_hashes(units, 7).size == 0
    rng = np.random.default_rng(0)
    small = rng.integers(0, 50, 40)
    naive = []
    for i in range(len(small) - 4):
        h = 0
        for j in range(5):
            h = (h * int(BASE) + int(small[i + j]) + 1) % (1 << 64)
        naive.append(h)
    assert window_hashes(small, 5).tolist() == naive  # sum((u+1) * BASE^(n-1-j)) mod 2^64, whatever the chunking
    long = rng.integers(0, 9, (1 << 20) + 500)
    halves = np.concatenate([window_hashes(long[:600_000], 7), window_hashes(long[600_000 - 6 :], 7)])
    assert np.array_equal(window_hashes(long, 7), halves)
    assert normalise_words("Ｈello,  WORLD!\tIt's") == ["hello", "world", "it", "s"]


def test_a_hash_collision_never_becomes_a_match() -> None:
    example = EvalExample("e", "x", None, [np.arange(20, dtype=np.int64)])
    index = NgramIndex.build([example], n=5, template_min_examples=0)
    table = index.tables[5]
    table.hashes[:] = window_hashes(np.arange(100, 120, dtype=np.int64), 5)[: len(table.hashes)]  # force "colliding" hashes
    order = np.argsort(table.hashes)
    table.hashes[:] = table.hashes[order]
    index._bitmap[:] = 0xFF  # every slot "maybe"
    assert index.query(np.arange(100, 120, dtype=np.int64)) == []  # equal hashes, different units: no hit


def test_planted_contamination_text_front_end(corpus: dict[str, Any], tmp_path: Path) -> None:
    root = corpus["root"]
    options = ScanOptions(n=N)
    result = scan([str(root / "train")], [str(root / "eval.jsonl")], eval_field="question", workers=2, options=options, progress=False)
    assert result.documents == len(corpus["docs"]) >= 10_000
    rows = {r["id"]: r for r in result.rows}
    for i in [*VERBATIM, *RESTYLED, *SHORT_PLANTED]:  # every verbatim copy (normalised) is found whole
        row = rows[f"q{i}"]
        assert row["status"] == "dirty" and row["matched_fraction"] == 1.0 and row["documents_hit"] == 1, row
        assert row["longest_span"] == row["units"] and row["coverage"] == 1.0
    for i in HALF:
        row = rows[f"q{i}"]
        expected = "dirty" if row["matched_fraction"] >= options.dirty_fraction else "partial"
        assert 0 < row["matched_fraction"] < 1 and row["status"] == expected
        assert row["longest_span"] == len(corpus["evals"][i]["question"].split()) // 2
    planted = {f"q{i}" for i in corpus["planted"]}
    assert all(r["status"] == "clean" and r["documents_hit"] == 0 for r in result.rows if r["id"] not in planted)  # no false positive
    location = rows["q0"]["locations"][0]
    assert " ".join(normalise_words(corpus["evals"][0]["question"]))[:50] in location["snippet"] or location["snippet"] in " ".join(normalise_words(corpus["evals"][0]["question"]))
    paths = write_outputs(result, tmp_path / "out")
    dirty = set(paths["dirty"].read_text().split())
    assert {f"q{i}" for i in [*VERBATIM, *RESTYLED, *SHORT_PLANTED]} <= dirty
    assert len(paths["clean"].read_text().split()) == 200 - len(corpus["planted"])
    assert len(pd.read_parquet(paths["parquet"])) == 200 and "# Contamination scan" in paths["markdown"].read_text()


def test_planted_contamination_token_front_end(tokenizer: Any, tmp_path: Path) -> None:
    """Token ids of the run's tokenizer: the eval text is also indexed as it tokenises after a space, mid-document."""
    from harness.lib.tiny import corpus_lines

    train = corpus_lines()[:400]
    rng = random.Random(1)
    def word() -> str:
        return "".join(rng.choice("abcdefghijklmnopqrstuvwxyz") for _ in range(rng.randint(4, 9)))

    evals = [" ".join(word() for _ in range(30)) for _ in range(10)]  # made-up words: no n-gram occurs by chance
    planted = {}
    for i in range(5):
        d = rng.randrange(len(train))
        train[d] = train[d] + " " + evals[i] + " and then it went on."
        planted[i] = d
    (tmp_path / "train.txt").write_text("\n".join(train) + "\n")
    (tmp_path / "eval.txt").write_text("\n".join(evals) + "\n")
    result = scan([str(tmp_path / "train.txt")], [str(tmp_path / "eval.txt")], tokenizer=tokenizer, options=ScanOptions(n=N), progress=False)
    assert result.front_end == "tokens"
    statuses = [r["status"] for r in result.rows]
    assert statuses[:5] == ["dirty"] * 5 and statuses[5:] == ["clean"] * 5
    assert all(r["matched_fraction"] == 1.0 for r in result.rows[:5])
    variants = FrontEnd(tokenizer).eval_variants(evals[0])
    assert len(variants) == 2  # a mid-document copy tokenises differently at its first word


def test_templates_shared_by_many_eval_examples_are_left_out() -> None:
    template = list(range(1000, 1015))
    examples = [EvalExample("e", str(i), None, [np.array(template + [5000 + i * 100 + k for k in range(20)], dtype=np.int64)]) for i in range(12)]
    index = NgramIndex.build(examples, n=N, template_min_examples=10)
    assert index.templates_dropped == 12 * (len(template) - N + 1)
    assert index.query(np.array(template, dtype=np.int64)) == []
    assert len(index.query(examples[3].variants[0])) == index.windows_of(3, 0) - (len(template) - N + 1)


def test_bad_input_names_the_file_and_the_field(corpus: dict[str, Any], tmp_path: Path) -> None:
    root = corpus["root"]
    with pytest.raises(ScanError, match="does not exist"):
        scan([str(tmp_path / "nope")], [str(root / "eval.jsonl")], eval_field="question", progress=False)
    with pytest.raises(ScanError, match=r"eval.jsonl line 1 has no field 'prompt'.*question.*--eval-field"):
        scan([str(root / "train")], [str(root / "eval.jsonl")], eval_field="prompt", progress=False)
    with pytest.raises(ScanError, match=r"a.jsonl line 1 has no field 'body'.*text.*--field"):
        scan([str(root / "train")], [str(root / "eval.jsonl")], field="body", eval_field="question", progress=False)
    (tmp_path / "listed.jsonl").write_text(json.dumps({"question": "a b c"}) + "\n" + json.dumps({"question": ["a", "list"]}) + "\n")
    with pytest.raises(ScanError, match=r"listed.jsonl line 2: field 'question' holds a list .*, not text"):
        scan([str(root / "train")], [str(tmp_path / "listed.jsonl")], eval_field="question", progress=False)
    (tmp_path / "empty.jsonl").write_text(json.dumps({"question": "   "}) + "\n")
    with pytest.raises(ScanError, match=r"empty.jsonl has no example with text in field 'question'"):
        scan([str(root / "train")], [str(tmp_path / "empty.jsonl")], eval_field="question", progress=False)
    cli = harness_cli("scan", "--train", str(root / "train" / "a.jsonl"), "--eval", str(root / "eval.jsonl"), "--eval-field", "prompt")
    assert cli.returncode == 2 and "has no field 'prompt'" in cli.stderr and "Traceback" not in cli.stderr


def test_cli_writes_the_report_and_exits_1_on_dirty_examples(corpus: dict[str, Any], tmp_path: Path) -> None:
    root = corpus["root"]
    cli = harness_cli("scan", "--train", str(root / "train" / "a.jsonl"), "--eval", str(root / "eval.jsonl"), "--eval-field", "question",
                      "--out", str(tmp_path / "report"), "--workers", "2")
    assert cli.returncode in (0, 1), cli.stderr[-2000:]
    in_first_third = [i for i, d in corpus["planted"].items() if d < len(corpus["docs"]) // 3]
    assert cli.returncode == (1 if in_first_third else 0)
    assert (tmp_path / "report" / "report.csv").exists() and "clean" in cli.stdout


def test_near_duplicates_of_lightly_edited_eval_items(tmp_path: Path) -> None:
    """A training document that is an eval item with a few words changed has no long verbatim run, but is a near duplicate."""
    rng = random.Random(3)
    vocabulary = [f"v{i}y" for i in range(5000)]
    evals = [" ".join(_words(rng, vocabulary, 60)) for _ in range(30)]
    docs = [" ".join(_words(rng, vocabulary, 60)) for _ in range(2000)]
    edited = evals[4].split()
    for k in range(6, 60, 12):  # a word changed every 12 words: no 13-word run survives
        edited[k] = "changed"
    docs[77] = " ".join(edited)
    (tmp_path / "train.txt").write_text("\n".join(docs) + "\n")
    (tmp_path / "eval.txt").write_text("\n".join(evals) + "\n")
    plain = scan([str(tmp_path / "train.txt")], [str(tmp_path / "eval.txt")], options=ScanOptions(n=N), progress=False)
    assert plain.rows[4]["status"] == "clean"  # the n-gram pass alone cannot see it
    options = ScanOptions(n=N, near_dup=True, near_dup_threshold=0.5, shingle=3)
    result = scan([str(tmp_path / "train.txt")], [str(tmp_path / "eval.txt")], options=options, progress=False, workers=2)
    row = result.rows[4]
    assert row["status"] == "dirty" and row["near_duplicates"] == 1 and row["near_duplicate_documents"][0]["document"] == "train.txt:78"
    assert 0.5 <= row["near_duplicate_jaccard"] < 1
    assert [r["status"] for i, r in enumerate(result.rows) if i != 4] == ["clean"] * 29


def test_datasets_folders_read_like_jsonl(corpus: dict[str, Any], tmp_path: Path) -> None:
    from datasets import Dataset

    root = corpus["root"]
    Dataset.from_list(corpus["evals"]).save_to_disk(str(tmp_path / "eval_ds"))
    from_folder = scan([str(root / "train" / "a.jsonl")], [str(tmp_path / "eval_ds")], eval_field="question", progress=False)
    from_jsonl = scan([str(root / "train" / "a.jsonl")], [str(root / "eval.jsonl")], eval_field="question", progress=False)
    assert [r["status"] for r in from_folder.rows] == [r["status"] for r in from_jsonl.rows]
    assert [r["id"] for r in from_folder.rows] == [r["id"] for r in from_jsonl.rows]  # the id field is read


EVAL_TEXT = " ".join(f"alpha{i}beta" for i in range(20))


@pytest.mark.parametrize("case", ["upper_case_jsonl", "csv", "bin", "empty_training_side", "non_utf8_line"])
def test_scan_refuses_unreadable_training_input(case: str, tmp_path: Path) -> None:
    """Training input scan cannot read must not make every eval example clean (exit 0): exit 2 with a message."""
    (tmp_path / "eval.jsonl").write_text(json.dumps({"id": "e1", "text": EVAL_TEXT}) + "\n", encoding="utf-8")
    document = json.dumps({"id": "d1", "text": f"some words before {EVAL_TEXT} and after"}) + "\n"
    names = {"upper_case_jsonl": "data.JSONL", "csv": "data.csv", "bin": "data.bin", "empty_training_side": "data.jsonl",
             "non_utf8_line": "data.jsonl"}
    train = tmp_path / names[case]
    if case == "csv":
        train.write_text(f"id,text\nd1,{EVAL_TEXT}\n", encoding="utf-8")
    elif case == "empty_training_side":
        train.write_text("\n" + json.dumps({"id": "d1", "text": "   "}) + "\n", encoding="utf-8")
    elif case == "non_utf8_line":
        train.write_bytes(document.encode() + b'{"id": "d2", "text": "caf\xe9 au lait"}\n')
    else:
        train.write_text(document, encoding="utf-8")
    cli = harness_cli("scan", "--train", str(train), "--eval", str(tmp_path / "eval.jsonl"), "--out", str(tmp_path / "out"), "--workers", "1")
    assert "Traceback" not in cli.stderr, cli.stderr[-3000:]
    if case == "upper_case_jsonl":  # the extension is matched whatever its case: read, and the planted copy found
        assert cli.returncode == 1, cli.stderr[-2000:]
        assert "1 training documents" in (tmp_path / "out" / "report.md").read_text()
        assert (tmp_path / "out" / "dirty_ids.txt").read_text() == "e1\n"
        return
    assert cli.returncode == 2, (cli.returncode, cli.stdout[-2000:], cli.stderr[-2000:])
    message = " ".join(cli.stderr.split())  # rich-free stderr, but be safe about wrapping
    assert str(train) in message and "Fix:" in message
    if case in ("csv", "bin"):
        assert f"unsupported extension '.{case}'" in message and ".jsonl" in message
    elif case == "empty_training_side":
        assert "0 documents" in message and "'text'" in message
    else:
        assert "line 2 is not valid UTF-8" in message
    assert not (tmp_path / "out" / "report.csv").exists()  # nothing written that could pass for a clean result


# -- bad options and outputs: exit 2 with the fix, before any work (exit 1 means "dirty") -------------------------------

@pytest.mark.parametrize(("extra", "said"), [
    (["-n", "0"], "-n 0 is under 1"),
    (["--workers", "0"], "--workers 0 is under 1"),
    (["--dirty-fraction", "2"], "--dirty-fraction 2.0 is not a fraction"),
    (["--dirty-fraction", "0.3", "--partial-fraction", "0.6"], "--partial-fraction 0.6 is not below --dirty-fraction 0.3"),
    (["--near-dup", "--near-dup-threshold", "1.5"], "--near-dup-threshold 1.5 is not a fraction"),
    (["--template-min-examples", "-1"], "--template-min-examples -1 is negative"),
])
def test_an_option_out_of_range_exits_2_and_says_the_fix(tmp_path: Path, capsys: Any, extra: list[str], said: str) -> None:
    from harness.cli import main as harness_main

    (tmp_path / "t.txt").write_text("one two three four five\n", encoding="utf-8")
    (tmp_path / "e.jsonl").write_text(json.dumps({"text": "one two three four five"}) + "\n", encoding="utf-8")
    code = harness_main(["scan", "--train", str(tmp_path / "t.txt"), "--eval", str(tmp_path / "e.jsonl"), "--out",
                         str(tmp_path / "out"), *extra])
    err = capsys.readouterr().err
    assert code == 2 and said in err and "Fix:" in err, err
    assert not (tmp_path / "out").exists()  # refused before any work


@pytest.mark.parametrize("case", ["out_is_a_file", "out_under_a_file", "not_a_tokenizer"])
def test_an_unusable_out_or_tokenizer_exits_2_and_says_the_fix(tmp_path: Path, capsys: Any, case: str) -> None:
    from harness.cli import main as harness_main

    (tmp_path / "t.txt").write_text("one two three four five\n", encoding="utf-8")
    (tmp_path / "e.jsonl").write_text(json.dumps({"text": "one two three four five"}) + "\n", encoding="utf-8")
    args = ["scan", "--train", str(tmp_path / "t.txt"), "--eval", str(tmp_path / "e.jsonl")]
    if case == "not_a_tokenizer":
        (tmp_path / "tok").mkdir()
        (tmp_path / "tok" / "notes.txt").write_text("no tokenizer here", encoding="utf-8")
        args += ["--out", str(tmp_path / "out"), "--tokenizer", str(tmp_path / "tok")]
        expected = f"--tokenizer {tmp_path / 'tok'} holds no tokenizer that loads"
    else:
        args += ["--out", str(tmp_path / "t.txt") if case == "out_is_a_file" else str(tmp_path / "t.txt" / "out")]
        expected = "is a file, not a folder" if case == "out_is_a_file" else "cannot be made"
    code = harness_main(args)
    err = capsys.readouterr().err
    assert code == 2 and expected in err and "Fix:" in err, err


def test_two_eval_sets_with_one_file_name_stay_apart(tmp_path: Path) -> None:
    """e1/eval.jsonl and e2/eval.jsonl: two sets (eval, eval-2) in the report, as --write-clean names their files."""
    words = [f"w{i}" for i in range(40)]
    (tmp_path / "train.txt").write_text(" ".join(words[:20]) + "\n" + "unrelated words only here\n", encoding="utf-8")
    for folder, text in (("e1", " ".join(words[:20])), ("e2", " ".join(words[20:]))):
        (tmp_path / folder).mkdir()
        (tmp_path / folder / "eval.jsonl").write_text(json.dumps({"id": "q0", "text": text}) + "\n", encoding="utf-8")
    result = scan([str(tmp_path / "train.txt")], [str(tmp_path / "e1" / "eval.jsonl"), str(tmp_path / "e2" / "eval.jsonl")],
                  progress=False)
    statuses = {(r["eval_set"], r["id"]): r["status"] for r in result.rows}
    assert statuses == {("eval", "q0"): "dirty", ("eval-2", "q0"): "clean"}, statuses


def test_a_hard_wrapped_text_file_gets_a_note(tmp_path: Path, capsys: Any) -> None:
    """An eval example wrapped over short lines is not matched by a .txt scan (a line is a document): the scan says so."""
    from harness.cli import main as harness_main

    words = [f"w{i}x" for i in range(300)]
    wrapped = "\n".join(" ".join(words[i : i + 8]) for i in range(0, 120, 8)) + "\n\n" + "\n".join(
        " ".join(words[i : i + 8]) for i in range(120, 240, 8)) + "\n"
    (tmp_path / "wrapped.txt").write_text(wrapped, encoding="utf-8")
    (tmp_path / "lines.txt").write_text("".join(" ".join(words[i : i + 40]) + "\n" for i in range(0, 240, 40)), encoding="utf-8")
    (tmp_path / "e.jsonl").write_text(json.dumps({"text": " ".join(words[:30])}) + "\n", encoding="utf-8")
    harness_main(["scan", "--train", str(tmp_path / "wrapped.txt"), str(tmp_path / "lines.txt"), "--eval",
                  str(tmp_path / "e.jsonl"), "--out", str(tmp_path / "out"), "--workers", "1"])
    out = " ".join(capsys.readouterr().out.split())
    assert "wrapped.txt looks hard-wrapped (median 8 words a line, under -n 13)" in out, out
    assert "lines.txt looks" not in out


@pytest.mark.parametrize("case", ["array", "pretty", "bom"])
def test_a_json_file_that_is_not_json_lines_says_how_to_convert_it(tmp_path: Path, case: str) -> None:
    records = [{"text": f"one two three four five six {i}"} for i in range(3)]
    body = {"array": json.dumps(records), "pretty": json.dumps(records[0], indent=2),
            "bom": "\ufeff" + "".join(json.dumps(r) + "\n" for r in records)}[case]
    path = tmp_path / ("data.json" if case != "bom" else "data.jsonl")
    path.write_text(body, encoding="utf-8")
    (tmp_path / "e.jsonl").write_text(json.dumps({"text": "a b c d e f"}) + "\n", encoding="utf-8")
    expected = {"array": "holds a JSON array; a .json file is read as JSON lines", "pretty": "jq -c",
                "bom": "starts with a UTF-8 byte-order mark. Fix: save it without one"}[case]
    with pytest.raises(ScanError, match=re.escape(expected)):
        scan([str(path)], [str(tmp_path / "e.jsonl")], progress=False)


def _templated(rng: random.Random, count: int) -> list[str]:
    """Sentences of one small grammar, two to a line: short phrases ("saw four owls in the morning") recur everywhere."""
    names, verbs = ["Nadia", "Yusuf", "Dev", "Mara", "Ole", "Ines"], ["saw", "fed", "drew", "counted", "found"]
    counts, things = ["two", "three", "four", "five"], ["owls", "boats", "kites", "lamps", "goats"]
    times = ["in the morning", "at noon", "after the rain", "before supper"]

    def sentence() -> str:
        return f"{rng.choice(names)} {rng.choice(verbs)} {rng.choice(counts)} {rng.choice(things)} {rng.choice(times)}."

    return [f"{sentence()} {sentence()}" for _ in range(count)]


def test_a_small_vocabulary_counts_n_grams_in_text_not_in_a_few_words(tokenizer: Any, tmp_path: Path) -> None:
    """With 256 tokens, 13 of them are three or four words: lines of one grammar share them by the dozen, and about
    half of each unrelated eval line matched training. Scaled to the text a usual tokenizer's 13 tokens hold, only the
    lines copied into training are dirty; counted as given (--no-scale-to-text), unrelated lines were dirty too."""
    rng = random.Random(5)
    train, evals = _templated(rng, 1500), _templated(rng, 60)
    copied = set(range(0, 60, 10))
    train += [evals[i] for i in sorted(copied)]
    (tmp_path / "train.txt").write_text("\n".join(train) + "\n")
    (tmp_path / "eval.txt").write_text("\n".join(evals) + "\n")
    paths = [str(tmp_path / "train.txt")], [str(tmp_path / "eval.txt")]
    result = scan(*paths, tokenizer=tokenizer, options=ScanOptions(n=N), progress=False)
    assert result.scale_note is not None and f"instead of {N}" in result.scale_note and result.options.n > N
    assert {i for i, r in enumerate(result.rows) if r["status"] == "dirty"} == copied
    as_given = scan(*paths, tokenizer=tokenizer, options=ScanOptions(n=N, scale_to_text=False), progress=False)
    assert as_given.scale_note is None and as_given.options.n == N
    assert len([r for r in as_given.rows if r["status"] == "dirty"]) > len(copied)  # the trap the scaling avoids
    words = scan(*paths, options=ScanOptions(n=N), progress=False)  # words are counted as given
    assert words.scale_note is None and words.options.n == N
