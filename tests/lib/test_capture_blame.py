"""Per-sample blame in captures: a poisoned row ranks first by its gradient norm, training is not disturbed, replay prints it.

The runs train the tiny Llama on the repetitive corpus at a high learning
rate (as tests/plugins/test_spike_capture.py does): after a dozen steps the
loss sits far below ln(vocab), so random tokens in one row spike it.
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

import harness
from cli_in_process import harness_in_process
from conftest import FAULTS, findings_of
from harness.lib.capture_summary import CaptureResult, markdown, rank_suspects

STEP = 14  # the poisoned step; spike_capture's baseline is ready by then with min_history 5


def _run(make_trainer: Any, rows: Any, tokenizer: Any, spike: dict[str, Any] | None = None, **args: Any) -> Any:
    settings = {"max_steps": STEP + 1, "learning_rate": 5e-3, "lr_scheduler_type": "constant", "logging_steps": 5, **args}
    trainer = make_trainer(train_dataset=rows, processing_class=tokenizer, **settings)
    config = {
        "plugins": ["spike_capture", FAULTS],
        "fault_injector": {"corrupt_at_steps": [STEP], "corrupt_rows": [2]},
        "spike_capture": {"min_history": 5, **(spike or {})},
    }
    harness.attach(trainer, config=config)
    trainer.train()
    return trainer


def _sample(**values: Any) -> dict[str, Any]:
    return {"nonprintable_ratio": 0.0, "replacement_ratio": 0.0, "labelled_tokens": 8, **values}


def test_suspects_rank_non_finite_first_then_by_how_far_they_stand_out_in_grad_norm_or_loss() -> None:
    samples = {
        "big grad": _sample(grad_norm=9.0, loss=1.0),  # 9x the median grad norm
        "nan grad": _sample(grad_norm="nan", loss=2.0),
        "high loss, ordinary grad": _sample(grad_norm=1.2, loss=7.0),  # 3.5x the median loss: random characters look so
        "ordinary": _sample(grad_norm=1.0, loss=2.0),
        "inf loss": _sample(grad_norm=None, loss="inf"),
        "no labels": _sample(grad_norm=None, loss=None, labelled_tokens=0),
    }
    named = {id(s): k for k, s in samples.items()}
    order = [named[id(s)] for s in rank_suspects(list(samples.values()))]
    assert order == ["nan grad", "inf loss", "big grad", "high loss, ordinary grad", "ordinary", "no labels"]
    assert samples["big grad"]["suspicion_by"] == "grad_norm" and samples["high loss, ordinary grad"]["suspicion_by"] == "loss"
    # the client's case (examples/run_clm.py, a poisoned line): the poison has the higher loss, the other row the higher grad
    client = {"poison": _sample(grad_norm=1.41, loss=4.48), "clean": _sample(grad_norm=1.69, loss=2.58)}
    assert rank_suspects(list(client.values()))[0] is client["poison"]
    without = {k: _sample(loss=v) for k, v in {"a": 1.0, "b": 3.0, "c": 2.0}.items()}  # no grad norms: by loss, as before
    assert [k for s in rank_suspects(list(without.values())) for k, v in without.items() if v is s] == ["b", "c", "a"]


def test_the_description_and_the_table_show_the_grad_norm() -> None:
    suspect = {"micro_batch": 0, "row": 2, "sample_id": 7, "sample_id_source": "dataset index", "dataset_index": 7,
               "grad_norm": 12.345, "loss": 5.5, "repetition": 0.1}
    text = CaptureResult(Path("."), Path("x.json"), [suspect, {**suspect, "row": 1, "grad_norm": "nan"}]).describe()
    assert text == ("micro-batch 0 row 2 (dataset index 7, grad norm 12.3, loss 5.500, repetition 0.10); "
                    "micro-batch 0 row 1 (dataset index 7, grad norm nan, loss 5.500, repetition 0.10)")
    meta = {"code": "LOSS_SPIKE", "step": 3, "rank": 0, "reason": "r", "per_sample_loss": "recomputed", "directory": "d",
            "blame": {"method": "vmap", "seconds": 0.012, "why": None}}
    table = markdown(meta, [{**suspect, "text": "t", "nonprintable_ratio": 0.0, "replacement_ratio": 0.0, "length_tokens": 4}])
    assert "| grad norm | loss |" in table and "| 12.35 | 5.5000 |" in table and "Per-sample gradient norm: vmap, 0.012 s" in table


def test_the_poisoned_row_ranks_first_by_its_grad_norm(make_trainer: Any, repetitive_rows: Any, tokenizer: Any) -> None:
    trainer = _run(make_trainer, repetitive_rows, tokenizer)
    (spike,) = findings_of(trainer.args.output_dir, "LOSS_SPIKE")
    assert [(f["code"], f["step"]) for f in findings_of(trainer.args.output_dir) if f["severity"] != "info"] == [("LOSS_SPIKE", STEP)]
    capture = json.loads(Path(spike["evidence"]["capture"]).read_text())
    samples = capture["samples"]
    assert all(isinstance(s["grad_norm"], float) for s in samples) and len(samples) == 4
    first, rest = samples[0], samples[1:]
    assert (first["micro_batch"], first["row"]) == (0, 2)
    assert first["grad_norm"] > 2 * max(s["grad_norm"] for s in rest)
    assert [s["grad_norm"] for s in samples] == sorted((s["grad_norm"] for s in samples), reverse=True)
    assert capture["blame"]["method"] == "vmap" and capture["blame"]["vmap_error"] is None and 0 < capture["blame"]["seconds"] < 30
    assert spike["evidence"]["suspects"][0]["grad_norm"] == first["grad_norm"]
    assert f"micro-batch 0 row 2 (dataset index {first['dataset_index']}, grad norm " in spike["message"]
    assert "| grad norm |" in (Path(spike["evidence"]["capture"]).parent / "summary.rank-0.md").read_text()


@pytest.mark.slow  # two runs and a replay through the CLI: CI runs it, the quick subset does not
def test_blame_leaves_training_as_it_was_and_replay_prints_the_grad_norms(
    make_trainer: Any, repetitive_rows: Any, tokenizer: Any, tmp_path: Path, capsys: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    steps = STEP + 4  # the steps after the capture show any change to p.grad, the RNG or the modes
    blamed = _run(make_trainer, repetitive_rows, tokenizer, output_dir=tmp_path / "blamed", max_steps=steps,
                  save_strategy="steps", save_steps=STEP - 1, logging_steps=1)
    plain = _run(make_trainer, repetitive_rows, tokenizer, {"recompute_loss": False}, output_dir=tmp_path / "plain", max_steps=steps,
                 logging_steps=1)
    losses = [[h["loss"] for h in t.state.log_history if "loss" in h] for t in (blamed, plain)]
    assert len(losses[0]) == steps and losses[0] == losses[1]  # bit for bit: the capture took nothing from training
    (off,) = findings_of(plain.args.output_dir, "LOSS_SPIKE")
    off_capture = json.loads(Path(off["evidence"]["capture"]).read_text())
    assert off_capture["blame"]["method"] == "unavailable" and "recompute_loss is off" in off_capture["blame"]["why"]
    assert all(s["grad_norm"] is None for s in off_capture["samples"])

    capture_dir = tmp_path / "blamed" / "harness" / "captures" / f"step-{STEP}"
    captured = {(s["micro_batch"], s["row"]): s["grad_norm"] for s in json.loads((capture_dir / "capture.rank-0.json").read_text())["samples"]}
    monkeypatch.setenv("COLUMNS", "200")  # wide enough for every column on one line
    result = harness_in_process(capsys, monkeypatch, "replay", str(capture_dir))
    assert result.returncode == 0 and "reproduced" in result.stdout, result.stdout + result.stderr[-3000:]
    assert "grad norm" in result.stdout and "per-sample gradient norms: vmap" in result.stdout
    table = [[c.strip() for c in line.split("│")[1:-1]] for line in result.stdout.splitlines() if line.startswith("│")]
    header = next(line for line in result.stdout.splitlines() if line.startswith("┃"))
    assert [c.strip() for c in header.split("┃")[1:-1]][7:9] == ["captured grad norm", "replayed grad norm"]
    ranked = [cells for cells in table if cells[0]]  # a long text wraps onto lines with an empty suspect cell
    assert [c[2] for c in ranked][0] == "2" and len(ranked) == 4  # the poisoned row first
    assert [c[7] for c in ranked] == [f"{captured[(0, int(c[2]))]:.4g}" for c in ranked]  # the captured column
    assert [c[8] for c in ranked] == [f"{captured[(0, int(c[2]))]:.4g}" for c in ranked]  # recomputed on the checkpoint: as captured
