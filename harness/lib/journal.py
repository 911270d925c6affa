"""A durable outbox: records appended to a JSONL file, delivered from a persisted cursor.

Used where data must leave the process (a tracking server) without ever
being lost or held in unbounded memory: the writer appends, the sender reads
from the cursor, delivers, then commits the new cursor. A kill between
delivery and commit re-delivers a few records, so deliveries must be
idempotent (MLflow merges identical metric rows and identical params).
"""
from __future__ import annotations

import json
import os
import threading
from pathlib import Path
from typing import Any

from harness.core.appendfile import LineAppender
from harness.core.strictjson import dumps


class Journal:
    def __init__(self, path: Path, cursor: str = "cursor", writable: bool = True) -> None:
        """``cursor`` names the reader: several readers may deliver the same journal independently. ``writable``
        False: only delivered from (an earlier process's journal), never appended to."""
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.cursor_path = self.path.with_suffix(f"{self.path.suffix}.{cursor}")
        self._lock = threading.Lock()
        # a full disk holds the records until it can write; training goes on
        self._file = LineAppender(self.path) if writable else None

    def append(self, records: list[dict[str, Any]]) -> None:
        if not records:
            return
        if self._file is None:
            raise ValueError(f"{self.path} is an earlier process's journal: delivered from, never appended to")
        text = "".join(dumps(r, separators=(",", ":")) + "\n" for r in records)  # strict JSON: a NaN metric as "nan"
        with self._lock:
            self._file.write(text)

    @property
    def cursor(self) -> int:
        try:
            return int(self.cursor_path.read_text(encoding="utf-8").strip() or 0)
        except (OSError, ValueError):
            return 0

    def read(self, start: int, max_records: int) -> tuple[list[dict[str, Any]], int]:
        """Up to ``max_records`` complete records from byte ``start``, and the offset after them."""
        records: list[dict[str, Any]] = []
        with open(self.path, "rb") as handle:
            handle.seek(start)
            offset = start
            while len(records) < max_records:
                line = handle.readline()
                if not line or not line.endswith(b"\n"):
                    break  # end, or a line still being written
                offset += len(line)
                try:
                    records.append(json.loads(line))
                except ValueError:
                    continue  # a torn line from a killed writer: skip it
        return records, offset

    def pending(self, max_records: int) -> tuple[list[dict[str, Any]], int]:
        return self.read(self.cursor, max_records)

    def commit(self, offset: int) -> None:
        tmp = self.cursor_path.with_name(self.cursor_path.name + ".tmp")
        tmp.write_text(str(offset), encoding="utf-8")
        os.replace(tmp, self.cursor_path)

    def unsent_bytes(self) -> int:
        return max(0, self.path.stat().st_size - self.cursor)

    def close(self) -> None:
        with self._lock:
            if self._file is not None:
                self._file.close()
