"""Which rank stalled first, and where: read from RANK_HANG findings alone (the spill files of a job that may have been killed).

Every rank's watchdog writes its own RANK_HANG. In a job where one rank stops,
the others stop soon after, waiting for it in a collective, and their
watchdogs fire too. The rank that stopped first is the one that made the
least progress (``evidence.progress``: steps ended, then micro-batches of the
next step received); at equal progress a rank that is not waiting in a
collective comes first (the others wait for it there), then the earlier
``evidence.stalled_since_unix``.

A rank's watchdog that fires while it waits in a collective reads the other
ranks' spill files (:func:`wait_for_peer_hangs`: read-only, a bounded wait,
never a collective: the other rank is hung) and names the rank that stalled
first (:func:`stalled_first`) in its own finding, which rank 0's console
prints. Stack files are shown relative to the run directory being read
(:func:`stack_display`): a copied or moved run directory still resolves them.
"""
from __future__ import annotations

import json
import time
from pathlib import Path, PurePath
from types import SimpleNamespace
from typing import Any, Callable, Iterable

RANK_HANG_CODE = "RANK_HANG"
PEER_WAIT_S = 2.0  # how long a rank waiting in a collective waits for the other ranks' RANK_HANG to appear
PEER_POLL_S = 0.1


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


def stack_display(value: Any, run: Any = None) -> str | None:
    """A finding's ``evidence.stack_file`` as a path relative to the run directory (``hangs/rank-1-step-10.txt``).

    The evidence holds the path the rank wrote (absolute, or relative to the job's working directory): in a copied
    or moved run directory it points at the original. With ``run`` (a :class:`~harness.report.record.RunRecord`)
    the file is resolved in the run directory being read; else (or when it is not there) the path is shown from its
    ``hangs`` folder on, which is where every stack file lives in a run directory. None for no path.
    """
    if not isinstance(value, str) or not value or "\n" in value or "\0" in value or len(value) > 4096:
        return None
    if run is not None:
        try:
            found = run.evidence_path(value)
            if found is not None:
                return found.relative_to(Path(run.run_dir).resolve()).as_posix()
        except (AttributeError, OSError, ValueError):
            pass
    parts = PurePath(value.replace("\\", "/")).parts
    if "hangs" in parts:
        index = len(parts) - 1 - parts[::-1].index("hangs")
        return "/".join(parts[index:])
    return parts[-1] if parts else None


def hang_summary(findings: Iterable[Any], run: Any = None) -> str | None:
    """One sentence: which rank stalled first, where, and where the other ranks waited; None without RANK_HANG.

    ``run``: the run directory being read (its stack files are resolved there), else stack paths are shown from
    their ``hangs`` folder on."""
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
    stack = stack_display(evidence.get("stack_file"), run)
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


def brief_where(words: str) -> str:
    """``where`` without its parenthesised details: ``in backward (the autograd engine, ...) in the training step``
    is ``in backward in the training step`` (a console line has room for one short clause per rank)."""
    text, depth, out = str(words), 0, []
    for char in text:
        if char == "(":
            depth += 1
        elif char == ")" and depth:
            depth -= 1
        elif not depth:
            out.append(char)
    return " ".join("".join(out).split()) or text


class PeerHangs:
    """The other ranks' RANK_HANG findings, read from their spill files (``ranks/findings.rank-<r>.jsonl``) as they
    grow: read-only, each file from where the last read stopped, a torn last line left for the next read."""

    def __init__(self, run_dir: Path, rank: int, since_unix: float) -> None:
        self.run_dir, self.rank, self.since_unix = Path(run_dir), rank, since_unix
        self._offsets: dict[Path, int] = {}
        self.found: dict[str, Any] = {}

    def read(self) -> list[Any]:
        from harness.core.findings import Finding

        try:
            spills = sorted((self.run_dir / "ranks").glob("findings.rank-*.jsonl"))
        except OSError:
            spills = []
        for spill in spills:
            if spill.name == f"findings.rank-{self.rank}.jsonl":
                continue
            offset = self._offsets.get(spill, 0)
            try:
                with open(spill, "rb") as handle:
                    handle.seek(offset)
                    data = handle.read(64 << 20)
            except OSError:
                continue
            end = data.rfind(b"\n") + 1
            self._offsets[spill] = offset + end
            for line in data[:end].splitlines():
                if RANK_HANG_CODE.encode() not in line:
                    continue
                try:
                    finding = Finding.from_dict(json.loads(line))
                except (RecursionError, UnicodeDecodeError, KeyError, TypeError, ValueError):
                    continue
                # a RANK_HANG written before this rank's last progress is an older hang that recovered, not this one
                if finding.code == RANK_HANG_CODE and finding.rank != self.rank and finding.time >= self.since_unix:
                    self.found[finding.id] = finding
        return list(self.found.values())


def wait_for_peer_hangs(run_dir: Path, rank: int, since_unix: float, world_size: int, wait_s: float = PEER_WAIT_S,
                        sleep: Callable[[float], Any] | None = None, poll_s: float = PEER_POLL_S) -> list[Any]:
    """The other ranks' RANK_HANG findings of this hang, waiting up to ``wait_s`` for them to appear (their watchdogs
    fire at about the same time): until a rank that is not waiting in a collective is among them (the one that
    stalled), or every other rank's is there. ``sleep`` returns True to stop early (the watchdog was stopped)."""
    peers = PeerHangs(run_dir, rank, since_unix)
    deadline = time.monotonic() + max(0.0, wait_s)
    while True:
        found = peers.read()
        waiting_only = all(_evidence(f).get("where_kind") == "collective" for f in found)
        if (found and not waiting_only) or len({f.rank for f in found}) >= world_size - 1 or time.monotonic() >= deadline:
            return found
        if (sleep or time.sleep)(poll_s):
            return peers.read()


def stalled_first(rank: int, step: int, evidence: dict[str, Any], peers: Iterable[Any]) -> Any | None:
    """The other rank's RANK_HANG that stalled before this rank's (whose evidence is ``evidence``); None when this
    rank comes first (or no other rank fired)."""
    own = SimpleNamespace(code=RANK_HANG_CODE, rank=rank, step=step, evidence=evidence,
                          time=evidence.get("stalled_since_unix") or time.time())
    ordered = stall_order([own, *peers])
    return None if not ordered or ordered[0] is own else ordered[0]


def _evidence(finding: Any) -> dict[str, Any]:
    return finding.evidence if isinstance(getattr(finding, "evidence", None), dict) else {}


__all__ = ["PEER_WAIT_S", "RANK_HANG_CODE", "PeerHangs", "brief_where", "hang_summary", "stack_display", "stall_order",
           "stalled_first", "wait_for_peer_hangs"]
