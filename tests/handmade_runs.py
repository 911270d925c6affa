"""Run directories written by hand, as the harness writes them: for tests of what reads them (report, explain, wrap's
summary) without a training run."""
from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from harness.lib.proven import FORMAT, MARKER, file_manifest


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


# -- checkpoints and the attempts of run.json (resume-point, rollback) ------------------------------------------------

T1, T2 = 1_700_000_000.0, 1_700_003_600.0  # attempt 1 started, attempt 2 started an hour later


def proven_checkpoint(folder: Path, step: int) -> Path:
    """A checkpoint the Trainer can resume from, with a valid proof marker whose manifest matches its files."""
    folder.mkdir(parents=True)
    (folder / "model.safetensors").write_bytes(b"w" * 16)
    (folder / "optimizer.pt").write_bytes(b"o" * 8)
    (folder / "trainer_state.json").write_text(json.dumps({"global_step": step}), encoding="utf-8")
    record = {"format": FORMAT, "step": step, "checks": ["complete"], "files": file_manifest(folder)}
    (folder / MARKER).write_text(json.dumps(record), encoding="utf-8")
    return folder


def saved_at(checkpoint: Path, when: float) -> Path:
    """The Trainer's save of ``checkpoint`` ended at ``when`` (``trainer_state.json`` is the last file it writes)."""
    os.utime(checkpoint / "trainer_state.json", (when, when))
    return checkpoint


def write_run_json(run: Path, attempts: list[dict[str, Any]]) -> Path:
    (run / "harness").mkdir(parents=True, exist_ok=True)
    path = run / "harness" / "run.json"
    path.write_text(json.dumps({"format": "train-harness-run/1", "attempts": attempts}), encoding="utf-8")
    return path


def rolled_back_run(tmp_path: Path) -> Path:
    run = tmp_path / "run"
    for step in (30, 40, 50):  # attempt 1
        saved_at(proven_checkpoint(run / f"checkpoint-{step}", step), T1 + step * 10)
    saved_at(run / "checkpoint-40", T2 + 100)  # saved again by attempt 2 (same folder name, new trainer_state.json)
    write_run_json(run, [
        {"started": T1, "resumed_from": None, "start_step": 0, "status": "running"},  # killed at 57
        {"started": T2, "resumed_from": str(run / "checkpoint-30"), "start_step": 30, "status": "running"},  # killed at 45
    ])
    return run
