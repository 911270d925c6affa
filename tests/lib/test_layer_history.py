"""The reader of layer_stats.jsonl: which blocks left their baseline before a step, earliest first; and the per-block rows."""
from __future__ import annotations

import json
import math
from pathlib import Path

from harness.lib.layer_baseline import LayerBaselines
from harness.lib.layer_history import FILE, describe, surged_before, tail_rows
from harness.lib.layer_rows import judge_step
from harness.lib.layer_sparks import layer_table, sparkline


def _write(run_dir: Path, rows: list[dict[str, object]], torn: str = "") -> None:
    (run_dir / FILE).write_text("".join(json.dumps(r) + "\n" for r in rows) + torn, encoding="utf-8")


def test_the_earliest_block_to_leave_its_baseline_comes_first_with_its_gap(tmp_path: Path) -> None:
    rows = [
        {"step": 10, "block": "model.layers.0", "left_baseline": [], "x": {"grad_norm": 1.0}},
        {"step": 20, "block": "model.layers.1", "left_baseline": ["grad_norm"], "x": {"grad_norm": 8.3}},
        {"step": 30, "block": "model.layers.0", "left_baseline": ["update_ratio"], "x": {"update_ratio": 4.0}},
        {"step": 30, "block": "model.layers.1", "left_baseline": ["grad_norm"], "x": {"grad_norm": 9.0}},
        {"step": 40, "block": "lm_head", "left_baseline": ["grad_norm"], "x": {"grad_norm": 5.0}},  # at the step itself: not before
    ]
    _write(tmp_path, rows, torn='{"step": 35, "block": "model.la')  # a kill mid-line costs that line only
    surges = surged_before(tmp_path, 40)
    assert [(s.block, s.step, s.gap) for s in surges] == [("model.layers.1", 20, 20), ("model.layers.0", 30, 10)]
    assert describe(surges) == "model.layers.1 (grad norm x8.3, 20 steps before); model.layers.0 (update ratio x4.0, 10 steps before)"
    recent = surged_before(tmp_path, 40, within=15)  # older surges are out of the window; at one step the strongest first
    assert [(s.block, s.step) for s in recent] == [("model.layers.1", 30), ("model.layers.0", 30)]
    assert surged_before(tmp_path / "nowhere", 40) == [] and describe([]) == ""


def test_a_long_file_is_read_from_its_tail_only(tmp_path: Path) -> None:
    rows = [{"step": s, "block": "b", "left_baseline": []} for s in range(2000)]
    _write(tmp_path, rows)
    tail = tail_rows(tmp_path / FILE, size=4096)
    assert 0 < len(tail) < 200 and tail[-1]["step"] == 1999 and all(isinstance(r["step"], int) for r in tail)


def test_rows_judge_each_block_against_its_own_baseline_and_flag_limits() -> None:
    baselines = LayerBaselines(window=20, min_history=5, level_steps=5, z=6.0, min_ratio=3.0, patience=5)
    names = ["model.layers.0", "model.layers.1"]
    limits = {"update_ratio": 0.5, "attn_logit_max": 100.0}
    for step in range(1, 8):
        noise = 0.01 * (step % 3)
        judged = judge_step(step, names, [[1.0 + noise, 10.0, 0.1, 0.01, 1e-6, 2.0], [2.0 + noise, 10, 0.1, 0.01, 1e-6, math.nan]],
                            baselines, limits)
        assert not any(judged.flags.values())
    judged = judge_step(8, names, [[9.0, 10.0, 1.0, 0.9, 1e-6, 2.0], [2.0, 10, 0.1, 0.01, 1e-6, math.nan]], baselines, limits)
    first, second = judged.rows
    assert first["left_baseline"] == ["grad_norm", "update_ratio"] and first["x"]["grad_norm"] > 8
    assert second["left_baseline"] == [] and second["attn_logit_max"] is None
    assert [f.block for f in judged.flags["grad_norm"]] == ["model.layers.0"]
    assert judged.flags["update_ratio"][0].over_limit and judged.flags["attn_logit_max"] == []


def test_the_report_table_draws_one_sparkline_per_block_and_statistic(tmp_path: Path) -> None:
    assert sparkline([1.0, 10.0, 100.0, None]) == "▁▅█ "
    rows = [{"step": s, "block": b, "grad_norm": float(s), "update_ratio": 0.01, "attn_logit_max": None}
            for s in (2, 4, 6) for b in ("model.layers.0", "lm_head")]
    _write(tmp_path, rows)
    table = layer_table(tmp_path)
    assert table is not None and "Measured at 3 steps (2..6)" in table
    assert table.count("| `model.layers.0` |") == 2 and "max attention logit" not in table  # nothing measured: no line
    assert layer_table(tmp_path / "none") is None
