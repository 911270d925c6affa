"""Everything a report is built from, read from the run directory alone.

Every reader tolerates what a ``kill -9`` leaves behind: a torn last line, a
file that was never written, an attempt still marked ``running``.
"""
from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterator

import yaml

from harness.findings import Finding, read_run_findings
from harness.runinfo import read_run_info


@dataclass
class RunRecord:
    """The run directory (``<output_dir>/harness``) as data."""

    run_dir: Path
    info: dict[str, Any]
    findings: list[Finding]
    steps: list[dict[str, Any]]
    logs: list[dict[str, Any]]
    config: dict[str, Any] = field(default_factory=dict)

    @classmethod
    def load(cls, run_dir: Path) -> "RunRecord":
        run_dir = Path(run_dir)
        try:
            config = yaml.safe_load((run_dir / "config.yaml").read_text(encoding="utf-8")) or {}
        except (OSError, yaml.YAMLError):
            config = {}
        return cls(
            run_dir=run_dir,
            info=read_run_info(run_dir),
            findings=sorted(read_run_findings(run_dir), key=lambda f: (f.step if f.step is not None else -1, f.time)),
            steps=list(read_jsonl(run_dir / "steps.jsonl")),
            logs=list(read_jsonl(run_dir / "metrics.jsonl")),
            config=config if isinstance(config, dict) else {},
        )

    @property
    def output_dir(self) -> Path:
        return self.run_dir.parent

    @property
    def attempts(self) -> list[dict[str, Any]]:
        """The ``train()`` calls; one that never recorded its end is ``killed`` (or still running)."""
        return list(self.info.get("attempts", []))

    @property
    def last_status(self) -> str:
        """How the last ``train()`` call ended; ``killed`` when it never recorded its end."""
        if not self.attempts:
            return "unknown"
        status = str(self.attempts[-1].get("status", "unknown"))
        return "killed" if status == "running" else status

    @property
    def last_step(self) -> int | None:
        candidates = [r["step"] for r in self.steps if isinstance(r.get("step"), int)]
        candidates += [a["end_step"] for a in self.attempts if isinstance(a.get("end_step"), int)]
        candidates += [f.step for f in self.findings if isinstance(f.step, int)]
        return max(candidates) if candidates else None

    def series(self, key: str) -> tuple[list[int], list[float]]:
        """``(steps, values)`` of a per-step field, finite values only, in file order."""
        xs, ys = [], []
        for record in self.steps:
            value = as_float(record.get(key))
            if value is not None and math.isfinite(value):
                xs.append(int(record["step"]))
                ys.append(value)
        return xs, ys

    def tokens_at(self, step: int | None) -> float | None:
        """Tokens processed when ``step`` ended (its last record: a replayed step counts once, as last run)."""
        found = None
        for record in self.steps:
            if record.get("step") == step:
                found = as_float(record.get("tokens"))
        return found

    def evidence_path(self, value: Any) -> Path | None:
        """An evidence value as an existing path (absolute, or relative to the run or output directory)."""
        if not isinstance(value, str) or not value or "\n" in value or len(value) > 4096:
            return None
        candidate = Path(value)
        options = []
        inside = [i for i, part in enumerate(candidate.parts) if part == self.run_dir.name]
        if inside:  # a path into a run directory: this one's copy first (the run may have moved, or be read from elsewhere)
            options.append(self.run_dir.joinpath(*candidate.parts[inside[-1] + 1:]))
        options += [candidate] if candidate.is_absolute() else [self.run_dir / candidate, self.output_dir / candidate]
        for option in options:
            try:
                if option.exists():
                    return option.resolve()
            except OSError:
                continue
        return None


def read_jsonl(path: Path) -> Iterator[dict[str, Any]]:
    """Records of a JSONL file; torn or foreign lines are skipped."""
    try:
        handle = open(path, encoding="utf-8")
    except OSError:
        return
    with handle:
        for line in handle:
            try:
                record = json.loads(line)
            except ValueError:
                continue
            if isinstance(record, dict):
                yield record


def as_float(value: Any) -> float | None:
    """A number from a record field ("nan"/"inf" strings included), else None."""
    if isinstance(value, bool) or value is None:
        return None
    if isinstance(value, (int, float)):
        return float(value)
    if isinstance(value, str):
        try:
            return float(value)
        except ValueError:
            return None
    return None
