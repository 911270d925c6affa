"""Reading JSONL files that a kill, a full disk or another tool may have damaged: one bad line costs that line only."""
from __future__ import annotations

import json
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from harness.core.received import JSONL_MAX_BYTES, open_received


LINE_MAX_BYTES = 32 << 20  # a longer line is skipped as damaged (a finding's message of megabytes still fits)
REPORT_SAMPLE_BYTES = 64 << 20  # a report's reader thins a JSONL file past this (``sample_bytes``): seconds, not gigabytes


def read_jsonl(path: Path, skipped: dict[str, int] | None = None, require_step: bool = False,
               problems: list[str] | None = None, read_bytes: int | None = None,
               sample_bytes: int | None = None) -> Iterator[dict[str, Any]]:
    """Records of a JSONL file; torn, foreign or damaged lines (not UTF-8, not JSON, not an object, longer than
    ``LINE_MAX_BYTES``) are skipped.

    ``skipped`` counts them under the file's name; ``require_step``: a record
    without an integer ``step`` is damaged too (every step record has one).
    The file is opened as a received file (``harness.core.received``): a link,
    a FIFO, a device or a file past its cap yields nothing, and ``problems``
    (when given) is told why. ``read_bytes``: a larger file is read at its
    start (three quarters of it) and its end only, so a reader of a file of
    gigabytes returns in seconds; ``problems`` says what was left out.
    ``sample_bytes``: a larger file is thinned evenly instead (a curve of a
    long run keeps its shape): one line in ``size / sample_bytes`` is parsed,
    and every line of its last eighth of ``sample_bytes`` (the run's end exact).
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
        size = os.fstat(handle.fileno()).st_size
        head = size if read_bytes is None or size <= read_bytes else read_bytes * 3 // 4
        if head < size and problems is not None:
            tail = (read_bytes or 0) // 4
            problems.append(f"{path.name} is {_mb(size)}: its first {_mb(head)} and last {_mb(tail)} were read, the "
                            f"{_mb(size - head - tail)} between were not (a healthy run's file is far smaller).")
        every, tail_from = 1, size
        if sample_bytes is not None and size > sample_bytes:
            every, tail_from = -(-size // sample_bytes), size - sample_bytes // 8
            if problems is not None:
                problems.append(f"{path.name} is {_mb(size)}: one record in {every} was read (the last "
                                f"{_mb(sample_bytes // 8)} whole), so curves are thinned, not cut.")
        read, lines = 0, 0
        while True:
            if read >= head and head < size:  # on to the end: from the first whole line of its last quarter
                handle.seek(max(size - (read_bytes or 0) // 4, head))
                handle.readline(LINE_MAX_BYTES + 1)
                head = size
            raw = handle.readline(LINE_MAX_BYTES + 1)
            read += len(raw)
            if not raw:
                return
            lines += 1
            if every > 1 and (lines - 1) % every and read < tail_from and raw.endswith(b"\n"):
                continue  # thinned: not parsed (an overlong line's rest is read below, as always)
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


def _mb(size: int) -> str:
    megabytes = size / 2**20
    return f"{megabytes:,.1f} MB" if megabytes < 10 else f"{megabytes:,.0f} MB"


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)
