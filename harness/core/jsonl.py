"""Reading JSONL files that a kill, a full disk or another tool may have damaged: one bad line costs that line only."""
from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from harness.core.received import JSONL_MAX_BYTES, open_received


LINE_MAX_BYTES = 32 << 20  # a longer line is skipped as damaged (a finding's message of megabytes still fits)


def read_jsonl(path: Path, skipped: dict[str, int] | None = None, require_step: bool = False,
               problems: list[str] | None = None) -> Iterator[dict[str, Any]]:
    """Records of a JSONL file; torn, foreign or damaged lines (not UTF-8, not JSON, not an object, longer than
    ``LINE_MAX_BYTES``) are skipped.

    ``skipped`` counts them under the file's name; ``require_step``: a record
    without an integer ``step`` is damaged too (every step record has one).
    The file is opened as a received file (``harness.core.received``): a link,
    a FIFO, a device or a file past its cap yields nothing, and ``problems``
    (when given) is told why.
    """
    path = Path(path)
    try:
        handle = open_received(path, JSONL_MAX_BYTES)  # bytes: one non-UTF-8 byte costs its line, not the file
    except FileNotFoundError:
        return
    except OSError as exc:
        if problems is not None:
            problems.append(f"{exc}: its records are left out.")
        return
    with handle:
        while True:
            raw = handle.readline(LINE_MAX_BYTES + 1)
            if not raw:
                return
            if len(raw) > LINE_MAX_BYTES and not raw.endswith(b"\n"):
                while raw and not raw.endswith(b"\n"):  # the rest of an overlong line, a piece at a time
                    raw = handle.readline(1 << 20)
                record = None
            elif not raw.strip():
                continue
            else:
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
