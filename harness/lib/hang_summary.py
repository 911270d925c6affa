"""Which rank stalled first, and where: read from RANK_HANG findings alone (the spill files of a job that may have been killed).

Every rank's watchdog writes its own RANK_HANG. In a job where one rank stops,
the others stop soon after, waiting for it in a collective, and their
watchdogs fire too. The rank that stopped first is the one that made the
least progress (``evidence.progress``: steps ended, then micro-batches of the
next step received); at equal progress a rank that is not waiting in a
collective comes first (the others wait for it there), then the earlier
``evidence.stalled_since_unix``.
"""
from __future__ import annotations

from typing import Any, Iterable

RANK_HANG_CODE = "RANK_HANG"


def _key(finding: Any) -> tuple[Any, ...]:
    evidence = finding.evidence if isinstance(getattr(finding, "evidence", None), dict) else {}
    progress = evidence.get("progress")
    if not (isinstance(progress, list) and len(progress) == 2 and all(isinstance(v, int) for v in progress)):
        progress = [finding.step if isinstance(finding.step, int) else 0, 0]
    since = evidence.get("stalled_since_unix")
    waiting = 1 if evidence.get("where_kind") == "collective" else 0  # a rank in a collective waits for another one
    return (progress[0], progress[1], waiting, since if isinstance(since, (int, float)) else finding.time, finding.rank)


def stall_order(findings: Iterable[Any]) -> list[Any]:
    """The RANK_HANG findings, the rank that stopped first at the front."""
    return sorted((f for f in findings if getattr(f, "code", None) == RANK_HANG_CODE), key=_key)


def hang_summary(findings: Iterable[Any]) -> str | None:
    """One sentence: which rank stalled first, where, and where the other ranks waited; None without RANK_HANG."""
    ordered = stall_order(findings)
    if not ordered:
        return None
    first = ordered[0]
    evidence = first.evidence if isinstance(first.evidence, dict) else {}
    where = evidence.get("where", "at an unknown place")
    last = evidence.get("last_progress")
    text = f"rank {first.rank} stalled first, at step {first.step}: {where}"
    if last:
        text += f" (its last progress: {last})"
    stack = evidence.get("stack_file")
    if stack:
        text += f"; stacks in {stack}"
    others = [f for f in ordered[1:] if f.rank != first.rank]
    seen: set[int] = set()
    waits = []
    for other in others:
        if other.rank in seen:
            continue
        seen.add(other.rank)
        other_where = other.evidence.get("where", "?") if isinstance(other.evidence, dict) else "?"
        waits.append(f"rank {other.rank} {other_where} (step {other.step})")
    if waits:
        text += "; then " + "; ".join(waits)
    return text + "."


__all__ = ["RANK_HANG_CODE", "hang_summary", "stall_order"]
