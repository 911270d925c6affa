"""Findings: what a plugin found, and the append-only file that keeps them.

A finding is written and flushed the moment it is made, so a run killed with
``kill -9`` one instruction later still has it on disk.
"""
from __future__ import annotations

import enum
import itertools
import math
import threading
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterable, Iterator

from harness.core.appendfile import LineAppender
from harness.core.jsonl import read_jsonl
from harness.core.strictjson import dumps


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
        try:  # strict JSON (any parser reads the line): a non-finite number in the evidence is written "nan", "inf", "-inf"
            return dumps(data, default=_json_default, sort_keys=True)
        except (TypeError, ValueError):  # mixed-type keys or a cycle in the evidence: keep the finding
            data["evidence"] = {str(k): repr(v) for k, v in self.evidence.items()}
            return dumps(data, default=_json_default, sort_keys=True)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> "Finding":
        """A finding from its JSON record; ``ValueError`` when a field is missing or of the wrong type.

        Records come from files that may be damaged or hand-edited (a received
        run directory is data): what every reader relies on is checked here,
        once, so that one bad line costs that line and not the report.
        """
        if not isinstance(data, dict):
            raise ValueError(f"a finding is a JSON object, got {type(data).__name__}")
        data = {k: v for k, v in data.items() if k in cls.__dataclass_fields__}
        for key in ("code", "severity", "plugin", "message"):
            if not isinstance(data.get(key), str):
                raise ValueError(f"finding field '{key}' must be a string, got {type(data.get(key)).__name__}")
        data["severity"] = Severity(data["severity"])
        for key, optional in (("step", True), ("rank", False)):
            if isinstance(data.get(key), float) and data[key].is_integer():
                data[key] = int(data[key])  # 3.0 is step 3 (a plugin that passed a float); "7" is damage
            if key in data and not (_is_int(data[key]) or (optional and data[key] is None)):
                raise ValueError(f"finding field '{key}' must be an integer, got {data[key]!r:.40}")
        if "evidence" in data and not isinstance(data["evidence"], dict):
            raise ValueError(f"finding field 'evidence' must be an object, got {type(data['evidence']).__name__}")
        for key in ("playbook", "action"):
            if data.get(key) is not None and not isinstance(data[key], str):
                raise ValueError(f"finding field '{key}' must be a string or null, got {type(data[key]).__name__}")
        if "time" in data and not (isinstance(data["time"], (int, float)) and not isinstance(data["time"], bool) and math.isfinite(data["time"])):
            raise ValueError(f"finding field 'time' must be a number, got {data['time']!r:.40}")
        if "id" in data and not isinstance(data["id"], str):
            raise ValueError(f"finding field 'id' must be a string, got {type(data['id']).__name__}")
        return cls(**data)


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


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
        self._lock = threading.Lock()
        self._seen: set[str] = {f.id for f in read_findings(self.path)} if self.path.exists() else set()
        self._file = LineAppender(self.path, fsync=True)  # never raises: a full disk holds the line until it can write

    def append(self, finding: Finding) -> bool:
        """Write ``finding`` (or hold it, while the folder cannot be written) unless the file already has its id."""
        with self._lock:
            if finding.id in self._seen:
                return False
            self._file.write(finding.to_json() + "\n")
            self._seen.add(finding.id)
            return True

    def write_again(self, findings: list[Finding]) -> None:
        """The file was removed and made anew (a run directory deleted mid-run): write ``findings`` into it again."""
        with self._lock:
            self._seen = set()
        for finding in findings:
            self.append(finding)

    def close(self) -> None:
        with self._lock:
            self._file.close()


def read_findings(path: Path, skipped: dict[str, int] | None = None) -> list[Finding]:
    """Read a findings file, ignoring a torn last line left by a kill (and any other line that cannot be read)."""
    return list(iter_findings(path, skipped))


def iter_findings(path: Path, skipped: dict[str, int] | None = None, problems: list[str] | None = None,
                  read_bytes: int | None = None) -> Iterator[Finding]:
    """The findings of a JSONL file; a line that is not valid UTF-8, not JSON or not a finding is skipped.

    ``skipped``, when given, counts the skipped lines under the file's name
    (the report says how many lines could not be read).
    """
    path = Path(path)
    for record in read_jsonl(path, skipped, problems=problems, read_bytes=read_bytes):
        try:
            finding = Finding.from_dict(record)
        except (RecursionError, KeyError, TypeError, ValueError):
            if skipped is not None:
                skipped[path.name] = skipped.get(path.name, 0) + 1
            continue
        yield finding


def findings_path(run_dir: Path, rank: int) -> Path:
    """The file a rank's findings are written to as they are made: ``findings.jsonl`` on rank 0, its spill file elsewhere."""
    run_dir = Path(run_dir)
    return run_dir / "findings.jsonl" if rank == 0 else run_dir / "ranks" / f"findings.rank-{rank}.jsonl"


def read_run_findings(run_dir: Path, skipped: dict[str, int] | None = None) -> list[Finding]:
    """All findings of a run: rank 0's file plus any not yet merged from other ranks' spill files."""
    run_dir = Path(run_dir)
    main = read_findings(findings_path(run_dir, 0), skipped)
    seen = {f.id for f in main}
    extra = [
        f
        for spill in sorted((run_dir / "ranks").glob("findings.rank-*.jsonl"))
        for f in iter_findings(spill, skipped)
        if f.id not in seen
    ]
    return main + extra


def worst(findings: Iterable[Finding]) -> Severity | None:
    """The highest severity among ``findings``, or None when there are none."""
    return max((f.severity for f in findings), key=lambda s: s.rank, default=None)

