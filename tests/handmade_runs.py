"""Run directories written by hand, as the harness writes them: for tests of what reads them (report, explain, wrap's
summary) without a training run."""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any


def finding_record(**over: Any) -> dict[str, Any]:
    """One findings.jsonl record (a NONFINITE_LOSS at step 2 on rank 0), with ``over`` changed."""
    record = {"code": "NONFINITE_LOSS", "severity": "error", "plugin": "nan_guard", "message": "loss was nan at step 2",
              "step": 2, "rank": 0, "evidence": {}, "playbook": "numeric-health#nonfinite_loss", "action": "skip_step",
              "time": 1_700_000_000.0, "id": "good0001"}
    record.update(over)
    return record


def make_run(output_dir: Path, plugins: list[str] | None = None, run_json: dict[str, Any] | None = None,
             findings: list[Any] | None = None) -> Path:
    """A run directory by hand, as this harness writes it (marker, resolved config, findings, step records)."""
    run_dir = output_dir / "harness"
    run_dir.mkdir(parents=True)
    config = {"plugins": plugins if plugins is not None else ["metrics_log"], "disable": [], "severity": {}, "policy": {},
              "output_dir": None, "max_plugin_errors": 10, "report": True, "report_plots": False, "recent_batches": 4}
    (run_dir / "config.yaml").write_text(json.dumps(config), encoding="utf-8")  # JSON is YAML
    info = {"format": "train-harness-run/1", "stage": "causal-lm", "trainer": "Trainer", "world_size": 1,
            "attempts": [{"started": 1_700_000_000.0, "resumed_from": None, "start_step": 0, "status": "completed",
                          "ended": 1_700_000_100.0, "end_step": 4}]}
    info.update(run_json or {})
    (run_dir / "run.json").write_text(json.dumps(info), encoding="utf-8")
    lines = [json.dumps(f) if isinstance(f, dict) else f for f in (findings if findings is not None else [finding_record()])]
    (run_dir / "findings.jsonl").write_text("".join(line + "\n" for line in lines), encoding="utf-8")
    steps = [{"step": s, "loss": 5.0 - s / 2, "grad_norm": 1.0, "lr": 1e-3, "tokens": 128 * s} for s in range(1, 5)]
    (run_dir / "steps.jsonl").write_text("".join(json.dumps(r) + "\n" for r in steps), encoding="utf-8")
    return run_dir
