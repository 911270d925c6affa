"""How a capture ranks its samples and says so: the suspect order, the one-line description, the markdown table.

Rows with a non-finite gradient norm or loss come first. The others are
ranked by how far each stands out of its own capture, in per-sample
gradient norm (the row that drove the update) or in recomputed loss,
whichever ratio to the capture's median is larger (``suspicion``, with
``suspicion_by`` naming the measure). Either measure alone misleads: a row
of random characters can have the highest loss and an ordinary gradient
(its rare tokens touch few weights), and a row the model is confidently
wrong on can have a large gradient and a loss close to the others. Rows
without labelled tokens come last.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any


@dataclass
class CaptureResult:
    """Where a capture went and what it found most suspect."""

    directory: Path
    json_path: Path
    suspects: list[dict[str, Any]] = field(default_factory=list)
    recomputed: bool = False

    def describe(self, top: int = 3) -> str:
        """A one-line summary of the top suspects, for finding messages."""
        parts = []
        for s in self.suspects[:top]:
            sid = f"sample id {s['sample_id']}, " if s.get("sample_id") is not None and s.get("sample_id_source") == "column" else ""
            sid += f"dataset index {s['dataset_index']}, " if s.get("dataset_index") is not None else ""
            norm = f"grad norm {_fmt(s['grad_norm'], '.3g')}, " if s.get("grad_norm") is not None else ""
            loss = f"loss {_fmt(s['loss'], '.3f')}" if s.get("loss") is not None else "loss n/a"
            parts.append(f"micro-batch {s['micro_batch']} row {s['row']} ({sid}{norm}{loss}, repetition {s['repetition']:.2f})")
        return "; ".join(parts) if parts else "no samples"


def _fmt(value: Any, spec: str) -> str:
    """A number as ``spec``; a non-finite one as written in the JSON ("nan", "inf")."""
    return value if isinstance(value, str) else format(value, spec)


def _finite(value: Any) -> float | None:
    """A finite float, None for a missing value; a non-finite one ("nan"/"inf" strings too) raises ValueError."""
    if value is None:
        return None
    number = float(value)
    if not math.isfinite(number):
        raise ValueError(value)
    return number


def rank_suspects(samples: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The samples, most suspect first, each given ``suspicion`` (its larger ratio to the median) and ``suspicion_by``."""
    norms = [v for v in (_safe(s.get("grad_norm")) for s in samples if s.get("labelled_tokens") != 0) if v is not None]
    losses = [v for v in (_safe(s.get("loss")) for s in samples if s.get("labelled_tokens") != 0) if v is not None]
    medians = {"grad_norm": _median(norms), "loss": _median(losses)}
    for sample in samples:
        ratios = {}
        for key, median in medians.items():
            value = _safe(sample.get(key))
            if value is not None and median:
                ratios[key] = value / median
        by = max(ratios, key=lambda k: ratios[k]) if ratios else None
        sample["suspicion"] = round(ratios[by], 4) if by else None
        sample["suspicion_by"] = by
    return sorted(samples, key=suspicion_key)


def suspicion_key(sample: dict[str, Any]) -> tuple[int, float, float]:
    """Sort key, most suspect first: non-finite grad norm or loss, then the larger ratio to the median (``rank_suspects``)."""
    broken_text = sample["nonprintable_ratio"] + sample["replacement_ratio"]
    if sample.get("labelled_tokens") == 0:
        return (2, 0.0, -broken_text)  # nothing to learn from: not what spiked the loss
    try:
        _finite(sample.get("grad_norm")), _finite(sample.get("loss"))
    except ValueError:
        return (0, 0.0, -broken_text)  # a non-finite gradient or loss is the strongest suspect
    return (1, -(sample.get("suspicion") or 0.0), -broken_text)


def _safe(value: Any) -> float | None:
    """A finite float or None (missing or non-finite values take no part in the medians)."""
    try:
        return _finite(value)
    except (TypeError, ValueError):
        return None


def _median(values: list[float]) -> float | None:
    if not values:
        return None
    ordered = sorted(values)
    middle = len(ordered) // 2
    return ordered[middle] if len(ordered) % 2 else (ordered[middle - 1] + ordered[middle]) / 2


def markdown(meta: dict[str, Any], samples: list[dict[str, Any]]) -> str:
    """``summary.rank-<r>.md``: the ranked samples as a table (training text escaped, never live markdown/HTML)."""
    from harness.lib.textsafe import md_cell, md_code, md_escape

    blame = meta.get("blame") or {}
    method = f"{blame.get('method')}, {blame.get('seconds', 0):.3g} s" + (f"; {blame['why']}" if blame.get("why") else "")
    lines = [
        f"# Capture: {md_escape(meta['code'])} at step {meta['step']} (rank {meta['rank']})",
        "",
        md_escape(meta["reason"]),
        "",
        f"Per-sample loss: {md_escape(meta['per_sample_loss'])}. "
        + (f"Per-sample gradient norm: {md_escape(method)}. " if blame else "")
        + f"Replay: {md_code('harness replay ' + str(meta['directory']))}.",
        "",
        "| suspect | micro-batch | row | sample id | grad norm | loss | repetition | non-printable | length | text |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for i, s in enumerate(samples, 1):
        text = md_cell((s["text"] or "")[:60])
        norm = "-" if s.get("grad_norm") is None else _fmt(s["grad_norm"], ".4g")
        loss = "-" if s.get("loss") is None else _fmt(s["loss"], ".4f")
        lines.append(
            f"| {i} | {s['micro_batch']} | {s['row']} | {md_cell(s['sample_id'], 80)} | {norm} | {loss} | {s['repetition']:.2f} | "
            f"{s['nonprintable_ratio'] + s['replacement_ratio']:.3f} | {s['length_tokens']} | {text} |"
        )
    return "\n".join(lines) + "\n"
