"""metrics_log keeps every logged metric in harness/metrics.jsonl, on rank 0 only."""
from __future__ import annotations

from pathlib import Path
from typing import Any

import harness
from conftest import read_jsonl


def test_every_logged_step_is_kept_with_loss_and_lr(make_trainer: Any) -> None:
    trainer = make_trainer(max_steps=4, logging_steps=2)
    harness.attach(trainer)
    trainer.train()
    rows = read_jsonl(Path(trainer.args.output_dir) / "harness" / "metrics.jsonl")
    logged = [r for r in rows if "loss" in r]
    assert [r["step"] for r in logged] == [2, 4]
    assert all(r["loss"] > 0 and "learning_rate" in r and "grad_norm" in r for r in logged)
    assert any("train_runtime" in r for r in rows)


def test_disabled_writes_nothing(make_trainer: Any) -> None:
    trainer = make_trainer(max_steps=2)
    harness.attach(trainer, config={"disable": ["metrics_log"]})
    trainer.train()
    assert not (Path(trainer.args.output_dir) / "harness" / "metrics.jsonl").exists()


def test_step_values_become_json_ready_without_a_read_for_plain_numbers() -> None:
    """steps.jsonl holds numbers as they are, non-finite floats as strings (written so by the strict encoder, not by a
    per-value test), 0-d numpy/torch scalars as numbers, and leaves out what JSON cannot hold."""
    import math

    import numpy as np
    import torch

    from harness.core.strictjson import dumps
    from harness.plugins.metrics_log import _host

    cases = [(1.5, 1.5), (math.nan, "nan"), (-math.inf, "-inf"), (3, 3), (True, True), (None, None), ("x", "x"),
             (np.float32(2.5), 2.5), (np.float64(math.inf), "inf"), (torch.tensor(4), 4), (torch.tensor([1, 2]), None), (object(), None)]
    got = [_host(value) for value, _ in cases]
    assert [type(v) for v in got[:7]] == [float, float, float, int, bool, type(None), str]
    assert got[0] is cases[0][0] and got[3] is cases[3][0]  # plain values pass through untouched
    assert strict_loads(dumps(got)) == [want for _, want in cases]  # all of it JSON-ready, strict


def _refuse(token: str) -> Any:
    raise ValueError(f"not strict JSON: bare {token}")


def strict_loads(text: str) -> Any:
    """``json.loads`` as jq, JSON.parse, Go or serde_json read: NaN / Infinity / -Infinity are errors."""
    import json

    return json.loads(text, parse_constant=_refuse)


def _strict_lines(path: Path) -> list[dict[str, Any]]:
    return [strict_loads(line) for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]


def test_a_nan_loss_is_written_as_strict_json_and_read_back_as_a_nonfinite_number(make_trainer: Any) -> None:
    """A NaN loss (logged unfiltered) in metrics.jsonl and steps.jsonl: every line parses strictly, the loss reads
    "nan", and the readers (the report's record, resume_check's logged losses, the report itself) treat it as NaN."""
    import math

    from harness.plugins.resume_check import _read_logged_losses
    from harness.report.build import build_report
    from harness.report.markdown import render_markdown
    from harness.report.record import RunRecord, as_float

    trainer = make_trainer(max_steps=4, logging_steps=1, logging_nan_inf_filter=False)
    compute_loss = trainer.compute_loss

    def poisoned(*args: Any, **kwargs: Any) -> Any:
        loss = compute_loss(*args, **kwargs)
        return loss * float("nan") if trainer.state.global_step == 2 else loss  # step 3's loss (and, unguarded, all after)

    trainer.compute_loss = poisoned
    harness.attach(trainer, config={"plugins": ["metrics_log"]})
    trainer.train()
    run_dir = Path(trainer.args.output_dir) / "harness"
    logged = {r["step"]: r for r in _strict_lines(run_dir / "metrics.jsonl") if "loss" in r}
    steps = {r["step"]: r for r in _strict_lines(run_dir / "steps.jsonl")}
    assert sorted(logged) == sorted(steps) == [1, 2, 3, 4]
    assert isinstance(logged[2]["loss"], float) and isinstance(steps[2]["loss"], float)
    assert logged[3]["loss"] == "nan" and steps[3]["loss"] == "nan"  # the one spelling of NaN, in both files
    # the readers
    run = RunRecord.load(run_dir)
    assert run.unreadable == {}
    xs, _ = run.series("loss")
    assert 3 not in xs and xs[:2] == [1, 2]  # non-finite values are left out of the curve, as before
    loss_3 = as_float(next(r for r in run.logs if r.get("step") == 3)["loss"])
    assert loss_3 is not None and math.isnan(loss_3)
    earlier = _read_logged_losses(run_dir / "metrics.jsonl")  # what a resume compares its first losses with
    assert math.isnan(earlier[3]) and earlier[2] == logged[2]["loss"]
    report = render_markdown(build_report(run, plots=True))
    assert "training completed at step 4" in report


def test_logged_values_of_any_kind_are_strict_json(tmp_path: Path) -> None:
    """on_log's values (floats, numpy and 0-d torch scalars, NaN/Inf among them) and a step record with a NaN grad norm."""
    import math
    from types import SimpleNamespace

    import numpy as np
    import torch

    from harness.plugins.metrics_log import MetricsLog

    ctx = SimpleNamespace(is_main=True, world_size=1, path=lambda name: tmp_path / name)
    plugin = MetricsLog()
    plugin.on_run_start(ctx)
    plugin.on_step_end(ctx, 1, {"loss": 1.5, "grad_norm": math.nan, "lr": 1e-3, "tokens": 8})
    plugin.on_log(ctx, 1, {"loss": torch.tensor(math.inf), "grad_norm": np.float32(-math.inf), "eval_loss": math.nan, "lr": 1e-3})
    plugin.on_run_end(ctx)
    (log,) = _strict_lines(tmp_path / "metrics.jsonl")
    assert log == {"step": 1, "loss": "inf", "grad_norm": "-inf", "eval_loss": "nan", "lr": 1e-3}
    (step,) = _strict_lines(tmp_path / "steps.jsonl")
    assert step["loss"] == 1.5 and step["grad_norm"] == "nan" and step["tokens"] == 8


def test_no_default_plugin_changes_the_step_metrics_it_keeps_by_reference(make_trainer: Any, monkeypatch: Any) -> None:
    """metrics_log keeps each step's metrics dict until its next write: every default plugin must only read it. With a
    read-only view handed to on_step_end, a plugin that wrote to it would raise (an INTERNAL_PLUGIN_ERROR finding)."""
    from types import MappingProxyType

    from conftest import findings_of
    from harness.hf.step_record import StepRecord

    built = StepRecord.metrics
    monkeypatch.setattr(StepRecord, "metrics", lambda self, step_time: MappingProxyType(built(self, step_time)))
    trainer = make_trainer(max_steps=12, logging_steps=5)
    harness.attach(trainer)
    trainer.train()
    assert findings_of(trainer.args.output_dir, "INTERNAL_PLUGIN_ERROR") == []
    rows = read_jsonl(Path(trainer.args.output_dir) / "harness" / "steps.jsonl")
    assert [r["step"] for r in rows] == list(range(1, 13)) and all(r["loss"] > 0 and r["lr"] is not None for r in rows)
