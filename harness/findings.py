"""Findings: what a plugin found, and the append-only file that keeps them.

A finding is written and flushed the moment it is made, so a run killed with
``kill -9`` one instruction later still has it on disk.
"""
from __future__ import annotations

import enum
import itertools
import json
import os
import threading
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterable, Iterator


class Severity(str, enum.Enum):
    """How bad a finding is; ordered info < warning < error < critical."""

    INFO = "info"
    WARNING = "warning"
    ERROR = "error"
    CRITICAL = "critical"

    @property
    def rank(self) -> int:
        return _SEVERITY_ORDER[self]

    def __ge__(self, other: object) -> bool:  # type: ignore[override]
        if not isinstance(other, Severity):
            return NotImplemented
        return self.rank >= other.rank

    def __gt__(self, other: object) -> bool:  # type: ignore[override]
        if not isinstance(other, Severity):
            return NotImplemented
        return self.rank > other.rank

    def __le__(self, other: object) -> bool:  # type: ignore[override]
        if not isinstance(other, Severity):
            return NotImplemented
        return self.rank <= other.rank

    def __lt__(self, other: object) -> bool:  # type: ignore[override]
        if not isinstance(other, Severity):
            return NotImplemented
        return self.rank < other.rank


_SEVERITY_ORDER = {Severity.INFO: 0, Severity.WARNING: 1, Severity.ERROR: 2, Severity.CRITICAL: 3}


@dataclass(frozen=True)
class FindingCode:
    """A finding code declared up front by a plugin (the public contract)."""

    code: str
    severity: Severity
    summary: str
    playbook: str  # "<family>#<anchor>", e.g. "plugin-errors#internal_plugin_error"


@dataclass
class Finding:
    """One thing a plugin found, with the numbers and the evidence."""

    code: str
    severity: Severity
    plugin: str
    message: str
    step: int | None = None
    rank: int = 0
    evidence: dict[str, Any] = field(default_factory=dict)
    playbook: str | None = None
    action: str | None = None
    time: float = field(default_factory=time.time)
    id: str = field(default_factory=lambda: uuid.uuid4().hex[:16])

    def to_json(self) -> str:
        # shallow on purpose: asdict() deep-copies evidence, which fails on tensors and handles
        data = {name: getattr(self, name) for name in self.__dataclass_fields__}
        data["severity"] = self.severity.value
        try:
            return json.dumps(data, default=_json_default, sort_keys=True)
        except (TypeError, ValueError):  # mixed-type keys or a cycle in the evidence: keep the finding
            data["evidence"] = {str(k): repr(v) for k, v in self.evidence.items()}
            return json.dumps(data, default=_json_default, sort_keys=True)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> "Finding":
        data = dict(data)
        data["severity"] = Severity(data["severity"])
        return cls(**{k: v for k, v in data.items() if k in cls.__dataclass_fields__})


def _json_default(value: Any) -> Any:
    """Evidence may hold tensors, numpy scalars or paths: store what they mean."""
    if isinstance(value, Path):
        return str(value)
    if hasattr(value, "tolist"):
        return value.tolist()
    if hasattr(value, "item"):
        return value.item()
    if isinstance(value, (set, frozenset, tuple)):
        return list(value)
    return repr(value)


class FindingsFile:
    """An append-only JSONL file; every write is flushed and fsynced at once."""

    def __init__(self, path: Path) -> None:
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._lock = threading.Lock()
        self._seen: set[str] = {f.id for f in read_findings(self.path)} if self.path.exists() else set()
        self._handle = open(self.path, "a", encoding="utf-8")

    def append(self, finding: Finding) -> bool:
        """Write ``finding`` unless a finding with the same id is already in the file."""
        with self._lock:
            if finding.id in self._seen:
                return False
            self._handle.write(finding.to_json() + "\n")
            self._handle.flush()
            os.fsync(self._handle.fileno())
            self._seen.add(finding.id)
            return True

    def close(self) -> None:
        with self._lock:
            if not self._handle.closed:
                self._handle.close()


def read_findings(path: Path) -> list[Finding]:
    """Read a findings file, ignoring a torn last line left by a kill."""
    return list(iter_findings(path))


def iter_findings(path: Path) -> Iterator[Finding]:
    path = Path(path)
    if not path.exists():
        return
    with open(path, encoding="utf-8") as handle:
        for line in handle:
            line = line.strip()
            if not line:
                continue
            try:
                yield Finding.from_dict(json.loads(line))
            except (json.JSONDecodeError, KeyError, TypeError, ValueError):
                continue


def read_run_findings(run_dir: Path) -> list[Finding]:
    """All findings of a run: rank 0's file plus any not yet merged from other ranks' spill files."""
    run_dir = Path(run_dir)
    main = read_findings(run_dir / "findings.jsonl")
    seen = {f.id for f in main}
    extra = [
        f
        for spill in sorted((run_dir / "ranks").glob("findings.rank-*.jsonl"))
        for f in iter_findings(spill)
        if f.id not in seen
    ]
    return main + extra


def worst(findings: Iterable[Finding]) -> Severity | None:
    """The highest severity among ``findings``, or None when there are none."""
    return max((f.severity for f in findings), key=lambda s: s.rank, default=None)

