"""contamination: a planted eval example is found at the step whose batch holds it, through attach and through wrap."""
from __future__ import annotations

import json
import random
from pathlib import Path
from typing import Any

import pytest

import harness
from conftest import findings_of, wrapped_example, write_yaml
from harness.lib.hashing import hash_token_rows, hex64
from harness.lib.ledger import read_ledger
from harness.lib.tiny import build_tiny_llama, corpus_lines, lm_dataset, train_tokenizer

CODES = ("CONTAMINATION", "CONTAMINATION_SUMMARY", "EVAL_SPLIT_OVERLAP", "CONTAMINATION_UNCHECKED")


def _made_up(count: int, seed: int = 0) -> list[str]:
    rng = random.Random(seed)
    return [" ".join("".join(rng.choice("abcdefghijklmnopqrstuvwxyz") for _ in range(rng.randint(4, 9))) for _ in range(25)) for _ in range(count)]


def _eval_file(path: Path, texts: list[str]) -> Path:
    path.write_text("".join(json.dumps({"id": f"ex{i}", "question": t}) + "\n" for i, t in enumerate(texts)), encoding="utf-8")
    return path


def _steps_of(output_dir: Path, row: list[int]) -> list[int]:
    """The steps at which the ledger (data_hash) saw this exact row."""
    ledger = read_ledger(output_dir)
    return sorted(ledger[ledger["sample_hash"] == hex64(hash_token_rows([row])[0])]["step"].unique().tolist())


def test_planted_eval_example_is_found_at_its_step_and_the_split_overlap(make_trainer: Any, tokenizer: Any, lm_rows: Any, tmp_path: Path) -> None:
    planted = lm_rows[7]["input_ids"]
    texts = _made_up(6) + [tokenizer.decode(planted)]
    trainer = make_trainer(max_steps=24, eval_dataset=lm_rows.select([40]), processing_class=tokenizer)
    config = {"contamination": {"eval_sets": [{"path": str(_eval_file(tmp_path / "eval.jsonl", texts)), "field": "question", "name": "quiz"}]}}
    harness.attach(trainer, config=config)
    trainer.train()
    out = Path(trainer.args.output_dir)
    found = findings_of(out, "CONTAMINATION")
    quiz = [f for f in found if f["evidence"]["eval_set"] == "quiz"]
    assert [f["evidence"]["example_id"] for f in quiz] == ["ex6"]  # the made-up examples stay clean
    assert quiz[0]["step"] == _steps_of(out, planted)[0] and quiz[0]["evidence"]["matched_ngrams"] > 0
    # one sighting per training row, although the example's tokenisations (variants) each match that row
    rows = [(s["step"], s["rank"], s["micro_batch"], s["row"]) for s in quiz[0]["evidence"]["sightings"]]
    assert len(rows) == len(set(rows)), rows
    more = len(rows) - 1
    assert (f"and {more} more training row(s)" in quiz[0]["message"]) is (more > 0), quiz[0]["message"]
    # the Trainer's own eval row 40 is a training row too: found where it was trained, and before training as a split overlap
    own = [f for f in found if f["evidence"]["eval_set"] == "eval_dataset"]
    assert own and own[0]["step"] == _steps_of(out, lm_rows[40]["input_ids"])[0]
    (overlap,) = findings_of(out, "EVAL_SPLIT_OVERLAP")
    assert overlap["evidence"]["shared_rows"] == 1 and overlap["step"] == 0
    summary = json.loads((out / "harness" / "contamination" / "summary.rank-0.json").read_text())
    assert summary["eval_sets"]["quiz"]["clean"] == 6 and summary["checked_tokens"] == 24 * 4 * 32
    dirty = (out / "harness" / "contamination" / "dirty_ids.rank-0.txt").read_text().splitlines()
    assert "quiz\tex6" in dirty and not any(line.startswith("quiz\tex0") for line in dirty)


def test_clean_run_is_silent(make_trainer: Any, tokenizer: Any, tmp_path: Path) -> None:
    trainer = make_trainer(max_steps=6, processing_class=tokenizer)
    harness.attach(trainer, config={"contamination": {"eval_sets": [{"path": str(_eval_file(tmp_path / "e.jsonl", _made_up(20))), "field": "question"}]}})
    trainer.train()
    out = Path(trainer.args.output_dir)
    assert [f for f in findings_of(out) if f["code"] in CODES] == []
    summary = json.loads((out / "harness" / "contamination" / "summary.rank-0.json").read_text())
    assert summary["eval_sets"] == {"e": {"clean": 20}} and summary["checked_tokens"] == 6 * 4 * 32
    # the test tokenizer (256 tokens) holds about a character per token: n and dirty_span counted in text, not 13 bytes
    assert summary["n"] > 13 and summary["dirty_span"] > 32


def test_a_bad_eval_set_is_reported_and_training_goes_on(make_trainer: Any, tokenizer: Any, tmp_path: Path) -> None:
    trainer = make_trainer(max_steps=2, processing_class=tokenizer)
    harness.attach(trainer, config={"contamination": {"eval_sets": [
        {"path": str(tmp_path / "missing.jsonl")},
        {"path": str(_eval_file(tmp_path / "e.jsonl", ["a b c"])), "field": "prompt"},
    ]}})
    trainer.train()
    messages = [f["message"] for f in findings_of(trainer.args.output_dir, "CONTAMINATION_UNCHECKED")]
    assert len(messages) == 2 and "missing.jsonl does not exist" in messages[0]
    assert "e.jsonl line 1 has no field 'prompt' (it has: id, question)" in messages[1] and "Fix: set contamination.eval_sets[1].field" in messages[1]


def _questions() -> list[str]:
    """The templated questions of ``examples/clm_data.py`` (train and eval share every template n-gram)."""
    pairs = [(a, b) for a in range(20) for b in range(20)]
    random.Random(0).shuffle(pairs)
    return [f"Question: What is {a} times {b}? Answer: {a * b}." for a, b in pairs]


def _blocks(tokenizer: Any, lines: list[str]) -> Any:
    """``run_clm.py``'s rows: each line tokenised with its line break, all concatenated, cut into blocks of 64."""
    from datasets import Dataset

    ids = [t for row in tokenizer([line + "\n" for line in lines])["input_ids"] for t in row]
    blocks = [ids[i : i + 64] for i in range(0, len(ids) // 64 * 64, 64)]
    return Dataset.from_dict({"input_ids": blocks, "attention_mask": [[1] * 64 for _ in blocks], "labels": [list(b) for b in blocks]})


def _templated(plant: int = 0) -> tuple[Any, Any, Any, int]:
    """Tokenizer, train and eval rows of ``examples/clm_data.py``'s questions as ``examples/run_clm.py`` builds them.

    ``plant`` eval lines are copied into the middle of train; also returned: how many tokens of the eval stream they
    cover. The tokenizer is trained on the training text, as run_clm's (a question is about 13 tokens).
    """
    qs = _questions()
    evals, train = qs[:80], qs[80:]
    train[len(train) // 2 : len(train) // 2] = evals[:plant]
    tokenizer = train_tokenizer(train)
    planted = sum(len(ids) for ids in tokenizer([line + "\n" for line in evals[:plant]])["input_ids"]) if plant else 0
    return tokenizer, _blocks(tokenizer, train), _blocks(tokenizer, evals), planted


def test_templated_eval_set_is_silent_and_its_line_breaks_hold_no_training_text(make_trainer: Any) -> None:
    """Template n-grams shared by train and eval (what used to be reported) are no finding. Those n-grams all cross a
    line break (``Answer: 0.\nQuestion: What is 8``), so no eval block holds training text: clean, not partial."""
    tokenizer, train, evals, _ = _templated()
    trainer = make_trainer(max_steps=30, train_dataset=train, eval_dataset=evals, processing_class=tokenizer,
                           model=build_tiny_llama(tokenizer, seed=0))
    ctx = harness.attach(trainer)
    trainer.train()
    out = Path(trainer.args.output_dir)
    assert [f for f in findings_of(out) if f["code"] in CODES] == []
    summary = json.loads((out / "harness" / "contamination" / "summary.rank-0.json").read_text())
    assert summary["eval_sets"] == {"eval_dataset": {"clean": len(evals)}} and summary["long_spans"] == {"eval_dataset": 0}
    plugin = ctx.manager.plugin("contamination")
    met = [e for e in range(len(evals)) if plugin.ledger.combined(e)]
    assert met  # template n-grams were met in training (the check is not vacuous) ...
    assert all(plugin._judge(e, plugin.ledger.combined(e))["boundary_matched"] > 0 for e in met)  # ... across line breaks


def _joined_lines(copies: bool) -> tuple[Any, Any, Any, list[float]]:
    """Tokenizer, train and eval rows of run_clm-style blocks of lines of three templated questions (about 37 tokens,
    as in the issue's report), and per eval block the share of its tokens that are copied training lines.

    With ``copies``, 12 of the 40 eval lines are copies of scattered training lines, 4 of them in a row (so one block
    at least is copied whole): no 13-gram across their line breaks was ever trained.
    """
    qs = _questions()
    lines = [" ".join(qs[i : i + 3]) for i in range(0, 399, 3)]
    evals, train = lines[:40], lines[40:]
    copied: list[int] = []
    if copies:
        rng = random.Random(1)
        copied = [10, 11, 12, 13] + sorted(rng.sample([i for i in range(40) if not 9 <= i <= 14], 8))
        for source, i in zip(rng.sample(range(len(train)), len(copied)), copied):
            evals[i] = train[source]
    tokenizer = train_tokenizer(train)
    lengths = [len(ids) for ids in tokenizer([line + "\n" for line in evals])["input_ids"]]
    flags = [i in copied for i, n in enumerate(lengths) for _ in range(n)]
    shares = [sum(flags[64 * b : 64 * b + 64]) / 64 for b in range(len(flags) // 64)]
    return tokenizer, _blocks(tokenizer, train), _blocks(tokenizer, evals), shares


def test_eval_blocks_of_copied_lines_are_judged_by_their_training_spans(make_trainer: Any) -> None:
    """Issue 43 item 6: eval lines copied from training into run_clm blocks. Every block at least 55% copied is
    dirty (today some stayed partial), a block copied whole is judged 100% copied (today 65%: the 13-grams across its
    line breaks never occur in training), no block without copied text is dirty, and one summary finding says how
    many eval rows hold training spans of at least 32 tokens."""
    tokenizer, train, evals, shares = _joined_lines(copies=True)
    trainer = make_trainer(max_steps=-(-len(train) // 4), train_dataset=train, eval_dataset=evals, processing_class=tokenizer,
                           model=build_tiny_llama(tokenizer, seed=0))
    harness.attach(trainer)
    trainer.train()
    out = Path(trainer.args.output_dir)
    summary = json.loads((out / "harness" / "contamination" / "summary.rank-0.json").read_text())
    rows = {e["id"]: e for e in summary["examples"]}
    dirty = {i for i, e in rows.items() if e["status"] == "dirty"}
    assert {str(b) for b, share in enumerate(shares) if share >= 0.55} <= dirty, (shares, rows)
    assert not {str(b) for b, share in enumerate(shares) if share == 0} & dirty
    whole = [str(b) for b, share in enumerate(shares) if share == 1.0]
    assert whole and all(rows[b]["matched_fraction"] >= 0.9 and rows[b]["boundary_ngrams"] > 0 for b in whole), json.dumps([rows[b] for b in whole])
    found = findings_of(out, "CONTAMINATION")
    assert {f["evidence"]["example_id"] for f in found} == dirty
    assert all(f["evidence"]["boundary_ngrams"] > 0 and "cross a line or document boundary" in f["message"] for f in found)
    long_spans = sum(1 for e in rows.values() if e["longest_span"] >= 32)
    (said,) = findings_of(out, "CONTAMINATION_SUMMARY")
    assert long_spans and summary["long_spans"] == {"eval_dataset": long_spans}
    assert f"{long_spans} of {len(evals)} eval rows hold training spans of at least 32 tokens" in said["message"], said["message"]
    assert f"{len(dirty)} of {len(evals)} are dirty" in said["message"] and "contamination.eval_sets" in said["message"]
    assert said["severity"] == "warning" and said["evidence"]["eval_sets"]["eval_dataset"]["dirty"] == len(dirty)


def test_eval_blocks_of_clean_templated_lines_stay_silent(make_trainer: Any) -> None:
    """The same long templated lines without copies: nothing is dirty, nothing is reported."""
    tokenizer, train, evals, _ = _joined_lines(copies=False)
    trainer = make_trainer(max_steps=-(-len(train) // 4), train_dataset=train, eval_dataset=evals, processing_class=tokenizer,
                           model=build_tiny_llama(tokenizer, seed=0))
    harness.attach(trainer)
    trainer.train()
    out = Path(trainer.args.output_dir)
    assert [f for f in findings_of(out) if f["code"] in CODES] == []
    summary = json.loads((out / "harness" / "contamination" / "summary.rank-0.json").read_text())
    assert summary["eval_sets"]["eval_dataset"].get("dirty", 0) == 0 and summary["long_spans"] == {"eval_dataset": 0}


def test_a_planted_eval_row_cut_across_two_training_rows_is_reported_once(make_trainer: Any) -> None:
    """Planted eval lines straddle training rows: no single row holds 60% of an eval block, the run does.

    An eval block holds four whole 13-token lines; the training row that holds the plant's start holds two of them
    (a block judged by its lines is then half copied), the next row the rest: at ``dirty_fraction`` 0.6 only the two
    rows together make a block dirty."""
    tokenizer, train, evals, planted_tokens = _templated(plant=12)
    covered = {str(b) for b in range(len(evals)) if 64 * b + 64 <= planted_tokens}
    assert covered
    steps = 2 * len(train) // 4 + 1  # two epochs: every planted row is trained twice
    trainer = make_trainer(max_steps=steps, train_dataset=train, eval_dataset=evals, processing_class=tokenizer,
                           model=build_tiny_llama(tokenizer, seed=0))
    harness.attach(trainer, config={"contamination": {"dirty_fraction": 0.6}})
    trainer.train()
    out = Path(trainer.args.output_dir)
    found = findings_of(out, "CONTAMINATION")
    ids = [f["evidence"]["example_id"] for f in found]
    assert len(ids) == len(set(ids)) and covered <= set(ids)  # each once, although every epoch trains it again
    dirty = {line.split("\t")[1] for line in (out / "harness" / "contamination" / "dirty_ids.rank-0.txt").read_text().splitlines()}
    assert set(ids) == dirty
    for f in found:
        ev = f["evidence"]
        new = [s["new_ngrams"] for s in ev["sightings"]]
        assert sum(new) == ev["matched_ngrams"] + ev["boundary_matched"] and ev["matched_fraction"] >= 0.6
        assert len(new) >= 2  # no training row alone made it dirty
        assert f["step"] == ev["sightings"][-1]["step"] and f["step"] in ev["steps"]
        assert ev["agreed"] is True  # judged at a step end, not left for run end


@pytest.mark.slow  # the quick subset stays under 5 minutes; CI runs it
def test_planted_eval_examples_through_wrap(tmp_path: Path) -> None:
    """Twenty training rows of the example script become eval examples: each one trained is found by its step.

    The example's corpus repeats some sentences, so an example may be found earlier, in another row with the same text."""
    tokenizer = train_tokenizer(corpus_lines())
    rows = lm_dataset(tokenizer, seq_len=64)["input_ids"]  # the example script's training rows
    planted = rows[:20]
    eval_path = _eval_file(tmp_path / "eval.jsonl", _made_up(4) + [tokenizer.decode(r) for r in planted])
    out = tmp_path / "run"
    config = write_yaml(tmp_path / "h.yaml", {"contamination": {"eval_sets": [{"path": str(eval_path), "field": "question"}]}})
    result = wrapped_example(out, config, steps=30, save_steps=0)
    assert result.returncode == 0, result.stderr[-3000:]
    found = {f["evidence"]["example_id"]: f["step"] for f in findings_of(out, "CONTAMINATION")}
    trained = {f"ex{4 + i}": _steps_of(out, row) for i, row in enumerate(planted)}
    expected = {example: steps[0] for example, steps in trained.items() if steps}
    assert expected and set(expected) <= set(found)  # every planted row that was trained is found ...
    assert all(found[example] <= step for example, step in expected.items())  # ... at its step or at an earlier row sharing its text
    assert not {"ex0", "ex1", "ex2", "ex3"} & set(found)  # the made-up examples never


def test_contamination_worker_failure_does_not_hang(make_trainer: Any, tokenizer: Any, lm_rows: Any, tmp_path: Path, monkeypatch: Any) -> None:
    """The index lookup raises in the background thread: one INTERNAL_PLUGIN_ERROR, and training (104 micro-batches) goes on.

    Before, the dead thread left its queue (64 deep) full, so the 66th micro-batch waited forever."""
    import threading

    from harness.lib.ngrams import NgramIndex

    def broken_query(self: Any, rows: Any) -> Any:
        raise MemoryError("index lookup failed on purpose")

    monkeypatch.setattr(NgramIndex, "query_rows", broken_query)
    texts = _made_up(6)
    trainer = make_trainer(max_steps=26, gradient_accumulation_steps=4, eval_dataset=lm_rows.select([40]), processing_class=tokenizer)
    harness.attach(trainer, config={"contamination": {"eval_sets": [{"path": str(_eval_file(tmp_path / "eval.jsonl", texts)), "field": "question"}]}})
    done: list[Any] = []
    runner = threading.Thread(target=lambda: done.append(trainer.train()), daemon=True)
    runner.start()
    runner.join(timeout=240)
    assert not runner.is_alive(), "training hung behind the dead contamination worker"
    assert done and trainer.state.global_step == 26
    out = Path(trainer.args.output_dir)
    (error,) = [f for f in findings_of(out, "INTERNAL_PLUGIN_ERROR") if f["plugin"] == "contamination"]
    assert error["evidence"]["hook"] == "inspect_batch" and "background checker died (MemoryError" in error["message"]
    assert "index lookup failed on purpose" in error["evidence"]["traceback"]
    summary = json.loads((out / "harness" / "contamination" / "summary.rank-0.json").read_text())
    assert summary["complete"] is False and summary["checked_tokens"] == 0


def test_boundary_tokens_of_a_real_tokenizer() -> None:
    """Line breaks end a line (a gap after the token), special tokens are seams on both sides."""
    import numpy as np

    from harness.plugins.contamination.boundaries import BoundaryTokens

    tokenizer = train_tokenizer(["Question: What is 7 times 3? Answer: 21.", "one two three\nfour five"] * 20)
    ids = tokenizer("one two\nthree four")["input_ids"] + [tokenizer.eos_token_id] + tokenizer("five")["input_ids"]
    row = np.array(ids)
    seams = BoundaryTokens.of(tokenizer, row)
    gaps = seams.gaps(row).tolist()
    newline = next(i for i, t in enumerate(ids) if "\n" in tokenizer.decode([t]))
    eos = ids.index(tokenizer.eos_token_id)
    assert newline + 1 in gaps and eos in gaps and eos + 1 in gaps
    assert len(gaps) == len({newline + 1, eos, eos + 1} & set(range(1, len(ids))))


def test_the_online_verdict_of_a_joined_row_follows_its_training_spans(monkeypatch: Any) -> None:
    """Milliseconds: the step-end test that decides when a row becomes dirty (and is reported) agrees with judge.

    A 2,000-token row of twenty 100-token lines holds one copied line: dirty by its span (5% of its n-grams); matches
    only across its line breaks (template text there) are ruled out without judging."""
    import numpy as np

    from harness.lib.ngrams import EvalExample, NgramIndex
    from harness.lib.overlap_ledger import bits_of
    from harness.plugins.contamination import Contamination

    units = np.concatenate([np.r_[np.arange(1, 100) + 1000 * i, 0] for i in range(20)])
    plugin = Contamination()
    plugin.index = NgramIndex.build([EvalExample("eval_dataset", "0", None, [units], [np.arange(100, 2000, 100)])], 13, 0, 1)
    copied = bits_of(range(700, 788))  # every window inside line 7
    assert plugin._is_dirty(0, {0: copied}) and plugin._judge(0, {0: copied})["dirty_by"] == "span"
    assert not plugin._is_dirty(0, {0: bits_of(range(700, 715))})  # 27 tokens of it: partial
    monkeypatch.setattr(Contamination, "_judge", lambda *a: pytest.fail("judged a row with no window inside a line"))
    assert not plugin._is_dirty(0, {0: bits_of([*range(788, 800), *range(1788, 1800)])})


def test_checkpoint_state_round_trips_the_agreed_windows_and_skips_what_changed() -> None:
    """Milliseconds: what a checkpoint stores restores into a fresh ledger; an example of another length is left out."""
    import numpy as np

    from harness.lib.ngrams import EvalExample, NgramIndex
    from harness.lib.overlap_ledger import ROW_END, MatchLedger, example_keys, lane_of
    from harness.plugins.contamination.state import restore, state_of

    def build(lengths: list[int]) -> tuple[NgramIndex, MatchLedger]:
        examples = [EvalExample("quiz", f"q{i}", None, [np.arange(n, dtype=np.int64) + 100 * i]) for i, n in enumerate(lengths)]
        return NgramIndex.build(examples, 13, 10, 8), MatchLedger(example_keys((e.eval_set, e.example_id) for e in examples))

    index, ledger = build([64, 64, 200])
    ledger.add(0, lane_of(0), [1, 2, 3])
    ledger.add(0, lane_of(0, ROW_END), [3])  # a training row ended at window 3: the row's edge goes on with a resume
    ledger.add(2, lane_of(0), [0, 70, 150])
    ledger.agree([ledger.outgoing(None)], lambda e, bits: False)
    state = json.loads(json.dumps(state_of(index, ledger)))
    fresh_index, fresh = build([64, 64, 100])  # q2 changed: 88 windows, not 188
    assert restore(fresh_index, fresh, state) == 2 and fresh.agreed == {0: {lane_of(0): 0b1110, lane_of(0, ROW_END): 0b1000}}
    assert restore(fresh_index, fresh, {"agreed": [["quiz", "q0", 0, 52, "zz"], ["quiz"], None]}) == 0  # unreadable: skipped
    older = build([64])  # a state written before rows' edges were kept: five fields, matched windows
    assert restore(*older, {"agreed": [["quiz", "q0", 0, 52, "6"]]}) == 1 and older[1].agreed == {0: {lane_of(0): 0b110}}


def test_a_masked_lm_run_finds_a_planted_eval_example_through_its_masks(make_trainer: Any, tokenizer: Any, lm_rows: Any, tmp_path: Path) -> None:
    """A masked-LM collator changes about 13% of the tokens of every row it collates (at 0.3 here, a quarter), so
    few 13-grams of a copied eval example survived in the batch's input_ids: the copy went unseen. The batch's
    samples are now looked up as their text (the labels' originals put back): the planted example is dirty."""
    from copy import deepcopy

    from transformers import DataCollatorForLanguageModeling

    from harness.lib.tiny_zoo import build_tiny_model

    tok = deepcopy(tokenizer)
    tok.add_special_tokens({"mask_token": "<mask>"})
    planted = lm_rows[7]["input_ids"]
    texts = _made_up(6) + [tok.decode(planted)]
    trainer = make_trainer(max_steps=24, model=build_tiny_model("bert", tok, "masked_lm"), processing_class=tok,
                           train_dataset=lm_rows.remove_columns(["labels"]),
                           data_collator=DataCollatorForLanguageModeling(tok, mlm_probability=0.3))
    config = {"contamination": {"eval_sets": [{"path": str(_eval_file(tmp_path / "eval.jsonl", texts)), "field": "question", "name": "quiz"}]}}
    harness.attach(trainer, config=config)
    trainer.train()
    found = findings_of(Path(trainer.args.output_dir), "CONTAMINATION")
    assert [f["evidence"]["example_id"] for f in found] == ["ex6"] and found[0]["evidence"]["matched_fraction"] > 0.9
