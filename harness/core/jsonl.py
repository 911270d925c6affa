"""Reading JSONL files that a kill, a full disk or another tool may have damaged: one bad line costs that line only."""
from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any


def read_jsonl(path: Path, skipped: dict[str, int] | None = None, require_step: bool = False) -> Iterator[dict[str, Any]]:
    """Records of a JSONL file; torn, foreign or damaged lines (not UTF-8, not JSON, not an object) are skipped.

    ``skipped`` counts them under the file's name; ``require_step``: a record
    without an integer ``step`` is damaged too (every step record has one).
    """
    path = Path(path)
    try:
        handle = open(path, "rb")  # bytes: one non-UTF-8 byte costs its line, not the file
    except OSError:
        return
    with handle:
        for raw in handle:
            if not raw.strip():
                continue
            try:
                record = json.loads(raw.decode("utf-8"))
            except (UnicodeDecodeError, RecursionError, ValueError):
                record = None
            if isinstance(record, dict) and (not require_step or _is_int(record.get("step"))):
                yield record
            elif skipped is not None:
                skipped[path.name] = skipped.get(path.name, 0) + 1


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)
