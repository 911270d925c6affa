"""Which blocks surged first: the ``layer_stats.jsonl`` rows whose statistics left their baseline before a step.

``layer_stats`` writes one row per block and measured step, with the
metrics that left the block's own baseline (``left_baseline``) and each
metric's multiple of its baseline median (``x``). A spike capture asks
:func:`surged_before` which blocks did so before the spike, earliest first,
and says it in words with :func:`describe`. Reads the run directory alone
(a torn last line, from a kill, is skipped).
"""
from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from harness.core.strictjson import as_float

FILE = "layer_stats.jsonl"
TAIL_BYTES = 4 << 20  # the file's last 4 MiB: thousands of rows, far more than `within` steps of any model
WORDS = {"grad_norm": "grad norm", "update_ratio": "update ratio", "attn_logit_max": "max attention logit"}


@dataclass(frozen=True)
class Surge:
    """A block whose statistics first left their baseline at ``step``, ``gap`` steps before the step asked about."""

    block: str
    step: int
    gap: int
    metrics: dict[str, float] = field(default_factory=dict)  # metric -> multiple of its baseline median (0 when unknown)

    @property
    def strength(self) -> float:
        return max(self.metrics.values(), default=0.0)

    def as_dict(self) -> dict[str, Any]:
        return {"block": self.block, "step": self.step, "steps_before": self.gap, "metrics": dict(self.metrics)}

    def words(self) -> str:
        parts = ", ".join(f"{WORDS.get(m, m)} x{x:.1f}" if x else WORDS.get(m, m) for m, x in self.metrics.items())
        return f"{self.block} ({parts}, {self.gap} step{'s' if self.gap != 1 else ''} before)"


def surged_before(run_dir: Path, step: int, within: int = 500) -> list[Surge]:
    """Blocks that left their baseline in the ``within`` steps before ``step``: earliest first, then the strongest."""
    first: dict[str, Surge] = {}
    for row in tail_rows(Path(run_dir) / FILE):
        at, block, left = row["step"], row.get("block"), row.get("left_baseline") or []
        if not isinstance(block, str) or not isinstance(left, list) or not left or not step - within <= at < step:
            continue
        seen = first.get(block)
        if seen is not None and seen.step <= at:
            continue
        ratios = row.get("x") if isinstance(row.get("x"), dict) else {}
        metrics = {str(m): _number(ratios.get(m)) for m in left}
        first[block] = Surge(block, at, step - at, metrics)
    return sorted(first.values(), key=lambda s: (s.step, -s.strength, s.block))


def tail_rows(path: Path, size: int = TAIL_BYTES) -> list[dict[str, Any]]:
    """The rows in the last ``size`` bytes of ``path`` (a flagged step reads this much, never a long run's whole file)."""
    try:
        with open(path, "rb") as handle:
            handle.seek(0, 2)
            end = handle.tell()
            handle.seek(max(0, end - size))
            data = handle.read()
    except OSError:
        return []
    lines = data.split(b"\n")
    if end > size:
        lines = lines[1:]  # the first line was cut by the seek
    rows = []
    for raw in lines:
        try:
            row = json.loads(raw.decode("utf-8")) if raw.strip() else None
        except (UnicodeDecodeError, ValueError, RecursionError):
            row = None  # a torn last line (a kill) or damage: that line only
        if isinstance(row, dict) and isinstance(row.get("step"), int) and not isinstance(row.get("step"), bool):
            rows.append(row)
    return rows


def describe(surges: list[Surge], limit: int = 3) -> str:
    """``model.layers.1 (grad norm x8.3, 10 steps before); ...`` for the first ``limit`` blocks ('' for none)."""
    if not surges:
        return ""
    shown = "; ".join(s.words() for s in surges[:limit])
    more = len(surges) - limit
    return shown + (f"; and {more} more block{'s' if more != 1 else ''}" if more > 0 else "")


def _number(value: Any) -> float:
    number = as_float(value)  # "nan"/"inf" strings (strict JSON) as the floats they are
    return 0.0 if number is None else number
