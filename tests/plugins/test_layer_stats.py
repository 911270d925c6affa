"""layer_stats: per-block statistics ride in the next step's one read, an LR surge shows in the blocks before the loss spikes.

The fault runs train the tiny Llama on the repetitive corpus at a constant
LR of 5e-3 and measure every 2 steps. From step 40 every update uses 4 times
the LR: the update-to-weight ratio of every block jumps at step 40 itself,
while the loss only spikes some steps later, once the weights have drifted.
"""
from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

import harness
from conftest import FAULTS, REPO, findings_of, read_jsonl
from harness.lib.layer_history import FILE

INTERVAL = 2
OPTIONS = {"interval": INTERVAL, "max_update_ratio": 1.0}  # the tiny model's healthy ratio at this LR is ~0.02, far above 1e-2


def _config(faults: dict[str, Any]) -> dict[str, Any]:
    return {"plugins": ["defaults", "layer_stats", FAULTS], "fault_injector": faults, "layer_stats": OPTIONS,
            "severity": {"DUPLICATE_SAMPLES": "info"}}  # the repetitive corpus is duplicated by design


def _run(make_trainer: Any, rows: Any, tokenizer: Any, faults: dict[str, Any], steps: int = 56, **args: Any) -> Any:
    settings = {"max_steps": steps, "learning_rate": 5e-3, "logging_steps": 10, "lr_scheduler_type": "constant", **args}
    trainer = make_trainer(train_dataset=rows, processing_class=tokenizer, **settings)
    harness.attach(trainer, config=_config(faults))
    trainer.train()
    return trainer


def _rows(output_dir: Any) -> list[dict[str, Any]]:
    return read_jsonl(Path(output_dir) / "harness" / FILE)


def test_every_measured_step_writes_one_row_per_block_without_a_read_of_its_own(make_trainer: Any, tokenizer: Any) -> None:
    sys.path.insert(0, str(REPO / "benchmarks"))
    from syncs import SyncCounter, Window  # the sync benchmark's counter: every host read made from harness code

    counter = SyncCounter()
    trainer = make_trainer(max_steps=3, callbacks=[Window(counter)], gradient_accumulation_steps=2, per_device_train_batch_size=2)
    ctx = harness.attach(trainer, config={"plugins": ["layer_stats"], "layer_stats": {"interval": 1}})  # alone: its reads only
    counter.install()
    try:
        trainer.train()
    finally:
        counter.active = False
        counter.uninstall()
    ours = {where: n for (where, _), n in counter.harness.items() if "layer_" in where}
    assert ours == {} and counter.owner.get("plugins/layer_stats.py", 0) == 0  # measured every step, read never

    rows = _rows(trainer.args.output_dir)
    assert sorted({r["step"] for r in rows}) == [1, 2, 3]  # step 3's stats read at run end
    blocks = [r["block"] for r in rows if r["step"] == 2]
    assert blocks == ["model.embed_tokens", "model.layers.0", "model.layers.1", "model.norm", "lm_head"][: len(blocks)]
    layer = next(r for r in rows if r["step"] == 3 and r["block"] == "model.layers.1")
    assert layer["grad_norm"] > 0 and layer["param_norm"] > 0 and layer["exp_avg_sq_norm"] > 0
    assert layer["update_ratio"] == pytest.approx(layer["update_norm"] / layer["param_norm"], rel=1e-5)
    assert 0 < layer["attn_logit_max"] < 100 and next(r for r in rows if r["block"] == "model.embed_tokens")["attn_logit_max"] is None
    assert ctx.manager.plugin("layer_stats").probe.installed is False

    from harness.plugins.layer_stats import LayerStats
    from harness.report.record import RunRecord

    section = LayerStats().report_sections(RunRecord.load(Path(trainer.args.output_dir) / "harness"))
    assert section is not None and "`model.layers.1`" in section.markdown and "update ratio" in section.markdown
    _assert_layer_plots(Path(trainer.args.output_dir) / "harness")


PLOT_NAMES = ("grad_norm", "param_norm", "update_ratio", "adam_second_moment", "attn_logit_max")


def _assert_layer_plots(run_dir: Path) -> None:
    """One PNG per statistic under report/plots, linked from report.md, embedded and linked in report.html, drawn by `harness report`."""
    from conftest import broken_report_links
    from harness.cli import main as harness_main

    assert not (run_dir / "report" / "plots" / "layer_stats-grad_norm.png").exists()  # HARNESS_REPORT_PLOTS=0: not even drawn
    assert harness_main(["report", str(run_dir.parent)]) == 0  # from the run directory alone, as on another machine
    markdown, html = (run_dir / "report.md").read_text(), (run_dir / "report.html").read_text()
    for name in PLOT_NAMES:
        png = run_dir / "report" / "plots" / f"layer_stats-{name}.png"
        assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n", png
        assert f"](report/plots/layer_stats-{name}.png)" in markdown
        assert f'id="plot-layer_stats-{name}"' in html and f'href="report/plots/layer_stats-{name}.png"' in html
    assert "`model.layers.1`" in markdown.split("## Layer statistics", 1)[1]  # the sparklines stay as the text fallback
    assert sorted(p.name for p in (run_dir / "report" / "plots").iterdir()) == sorted(f"layer_stats-{n}.png" for n in PLOT_NAMES)
    assert broken_report_links(run_dir) == []


@pytest.mark.slow  # two runs of 56 steps in-process
def test_an_lr_surge_shows_in_the_blocks_an_interval_before_the_loss_spike_and_the_capture_names_them(
    make_trainer: Any, repetitive_rows: Any, tokenizer: Any
) -> None:
    trainer = _run(make_trainer, repetitive_rows, tokenizer, {"lr_scale_from_step": 40, "lr_scale": 4.0})
    out = trainer.args.output_dir
    (spike,) = findings_of(out, "LOSS_SPIKE")
    layer = findings_of(out, "UPDATE_RATIO_HIGH") + findings_of(out, "LAYER_GRAD_SURGE")
    first = min(layer, key=lambda f: f["step"])
    assert first["code"] == "UPDATE_RATIO_HIGH" and first["step"] == 40 and first["severity"] == "warning"
    assert spike["step"] - first["step"] >= INTERVAL  # at least one measuring interval of warning before the loss moved
    named = {b["block"] for b in first["evidence"]["blocks"]}
    assert {"model.layers.0", "model.layers.1"} <= named and all(b["x"] > 3 for b in first["evidence"]["blocks"])
    assert "model.layers" in first["message"] and "step 40" in first["message"]

    surged = spike["evidence"]["layers_surged_first"]
    assert surged and surged[0]["step"] == 40 and surged[0]["steps_before"] == spike["step"] - 40
    assert "layers surged first: model." in spike["message"]
    capture = json.loads(Path(spike["evidence"]["capture"]).read_text())
    assert capture["layers_surged_first"] == surged

    before = [r for r in _rows(out) if r["step"] < 40]
    assert before and not any(r["left_baseline"] for r in before if r["step"] > 20)  # quiet until the fault


@pytest.mark.slow  # 56 steps in-process
def test_a_clean_run_with_an_eval_set_stays_silent(make_trainer: Any, repetitive_rows: Any, tokenizer: Any) -> None:
    from datasets import Dataset

    ids = torch.randint(0, 256, (16, 32), generator=torch.Generator().manual_seed(1))
    evals = Dataset.from_dict({"input_ids": ids.tolist(), "attention_mask": torch.ones_like(ids).tolist(), "labels": ids.tolist()})
    trainer = _run(make_trainer, repetitive_rows, tokenizer, {}, eval_dataset=evals, eval_strategy="steps", eval_steps=28)
    out = trainer.args.output_dir
    assert [(f["code"], f["step"]) for f in findings_of(out) if f["severity"] != "info"] == []
    assert len({r["step"] for r in _rows(out)}) == 56 // INTERVAL
