"""CUDA allocator history and snapshots, summarised to JSON (never the pickle of ``_dump_snapshot``).

``torch.cuda.memory._record_memory_history`` makes the caching allocator
keep a Python stack for every allocation (cost: a few microseconds per
allocation while on, so the harness keeps it on for the first steps only).
``torch.cuda.memory._snapshot()`` returns the allocator's state as a dict:
segments (one per cudaMalloc) holding blocks (one per allocation), each
block with the stack that allocated it when history was on, and the trace
of recent allocator actions (the ``oom`` entry says how much was asked for
and how much the device still had). :func:`summarise_snapshot` keeps what a
person reads: totals, the largest live blocks with their frames, the OOM
entry. Received run directories hold no pickle, so the raw snapshot is
never written.
"""
from __future__ import annotations

import logging
from typing import Any

import torch

log = logging.getLogger("harness.oom")

FRAMES_KEPT = 8


def start_history(max_entries: int) -> bool:
    """Turn the CUDA allocator history on (Python stacks only); False when CUDA is not in use or it fails."""
    if not (torch.cuda.is_available() and torch.cuda.is_initialized()):
        return False
    try:
        torch.cuda.memory._record_memory_history(enabled="all", context="all", stacks="python", max_entries=max_entries)
        return True
    except Exception as exc:  # noqa: BLE001 - an old driver or allocator backend without history
        log.warning("harness oom: CUDA memory history could not be turned on (%s: %s)", type(exc).__name__, exc)
        return False


def stop_history() -> None:
    try:
        torch.cuda.memory._record_memory_history(enabled=None)
    except Exception:  # noqa: BLE001
        pass


def take_snapshot() -> dict[str, Any] | None:
    """The allocator's snapshot as a dict (None without CUDA or when it fails)."""
    if not (torch.cuda.is_available() and torch.cuda.is_initialized()):
        return None
    try:
        return torch.cuda.memory._snapshot()
    except Exception as exc:  # noqa: BLE001
        log.warning("harness oom: no CUDA memory snapshot (%s: %s)", type(exc).__name__, exc)
        return None


def _frames(frames: list[dict[str, Any]] | None) -> list[str]:
    """``file:line name`` of the innermost frames, torch's own and the harness's bookkeeping left out where others remain."""
    lines = [f"{f.get('filename', '?')}:{f.get('line', '?')} {f.get('name', '?')}" for f in frames or []]
    outside = [line for line in lines if "/torch/" not in line.replace("\\", "/")]
    return (outside or lines)[:FRAMES_KEPT]


def summarise_snapshot(snapshot: dict[str, Any], device: int | None = None, top: int = 20) -> dict[str, Any]:
    """Totals, the ``top`` largest live blocks with their allocating frames, and the allocator's OOM entry.

    ``device`` selects one CUDA device's segments and trace (all when None).
    """
    segments = [s for s in snapshot.get("segments", []) if device is None or s.get("device", device) == device]
    blocks = [b for s in segments for b in s.get("blocks", [])]
    live = [b for b in blocks if b.get("state") == "active_allocated"]
    live.sort(key=lambda b: -int(b.get("size", 0)))
    reserved = sum(int(s.get("total_size", 0)) for s in segments)
    allocated = sum(int(s.get("allocated_size", 0)) for s in segments)
    largest_free = max((int(b.get("size", 0)) for b in blocks if b.get("state") == "inactive"), default=0)
    traces = snapshot.get("device_traces", [])
    chosen = traces if device is None else traces[device : device + 1]
    oom = [e for trace in chosen for e in trace or [] if e.get("action") == "oom"]
    with_frames = sum(1 for b in live if b.get("frames"))
    return {
        "segments": len(segments),
        "reserved_bytes": reserved,
        "allocated_bytes": allocated,
        "reserved_unallocated_bytes": reserved - allocated,
        "largest_free_block_bytes": largest_free,
        "live_blocks": len(live),
        "live_blocks_with_frames": with_frames,
        "segments_by_type": {kind: sum(int(s.get("total_size", 0)) for s in segments if s.get("segment_type") == kind)
                             for kind in ("large", "small")},
        "top_allocations": [
            {"bytes": int(b.get("size", 0)), "requested_bytes": int(b.get("requested_size", b.get("size", 0))),
             "frames": _frames(b.get("frames"))}
            for b in live[:top]
        ],
        "oom": [{"requested_bytes": int(e.get("size", 0)), "device_free_bytes": e.get("device_free"),
                 "frames": _frames(e.get("frames"))} for e in oom[-3:]],
        "history": "frames recorded (torch.cuda.memory._record_memory_history was on)" if with_frames
        else "no frames: the allocator history was off at the OOM (raise oom.history_steps to cover the failing step)",
    }


__all__ = ["start_history", "stop_history", "summarise_snapshot", "take_snapshot"]
