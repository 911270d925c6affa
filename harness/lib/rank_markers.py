"""Rank attempt markers (``ranks/attempt.rank-<r>``): each rank's state in the current ``train()`` call, and how it ended.

The file's first line is the state, ``running`` (written when the call starts)
or ``ended`` (written after the rank's ``on_run_end``). A rank that did not
complete adds a second line, one JSON object, with how it ended::

    ended
    {"status": "crashed", "error": "ValueError: injected crash on rank 1 at step 10", "ended": 1700000000.0, "step": 9}

``ended`` is the time the rank's ``train()`` call failed (not the time the
marker was written), so that the rank that failed first can be told from the
ones that failed because it was gone. A completed rank writes ``ended`` alone,
as older versions did for every rank: a marker without the JSON line still
reads (its status is then not known).
"""
from __future__ import annotations

import json
import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from harness.core.strictjson import dumps as strict_dumps

RUNNING, ENDED = "running", "ended"
MAX_MARKER_BYTES = 64 * 1024  # a received run directory is data: a huge "marker" is not read
MAX_ERROR_CHARS = 300

# the messages of a collective that failed because another rank was gone (gloo, NCCL, the c10d store), or timed out
COMMUNICATION_ERRORS = re.compile(
    r"connection closed by peer|connection reset|connection refused|broken pipe|socket timeout|timed out|timeout"
    r"|nccl (?:error|communicator was aborted)|ncclremoteerror|ncclsystemerror|watchdog caught collective operation"
    r"|process group .*(?:abort|destroy)|remote worker|gloo/transport|DistBackendError|DistNetworkError|DistStoreError",
    re.IGNORECASE,
)
_SOURCE_PREFIX = re.compile(r"\[[^\]\s]*(?:/|\\)[^\]\s]*:\d+\]\s*")  # "[/__w/pytorch/.../pair.cc:553] "


@dataclass(frozen=True)
class RankEnd:
    """How one rank's ``train()`` call ended, from its marker (or from run.json's copy of it)."""

    rank: int
    state: str  # running / ended
    status: str | None = None  # completed / stopped / crashed / interrupted; None: not recorded (an older marker)
    error: str | None = None  # "Type: message", short
    ended: float | None = None  # when the rank's call failed or ended (time.time())
    step: int | None = None  # the rank's global_step then

    @property
    def failed(self) -> bool:
        return self.status == "crashed" and bool(self.error)

    @property
    def communication(self) -> bool:
        """Whether its error is a failed collective (another rank gone, a timeout): secondary when another rank has a real error."""
        return is_communication_error(self.error)

    def as_dict(self) -> dict[str, Any]:
        return {"rank": self.rank, "status": self.status, "error": self.error, "ended": self.ended, "step": self.step}

    @classmethod
    def from_dict(cls, data: Any) -> "RankEnd | None":
        """run.json's record of a rank end (``as_dict``); None for something else."""
        if not isinstance(data, dict) or not _is_int(data.get("rank")):
            return None
        return cls(rank=data["rank"], state=ENDED, status=_str(data.get("status")), error=_str(data.get("error")),
                   ended=_number(data.get("ended")), step=data.get("step") if _is_int(data.get("step")) else None)


def marker_path(run_dir: Path, rank: int) -> Path:
    return Path(run_dir) / "ranks" / f"attempt.rank-{rank}"


def short_error(error: BaseException | str | None) -> str | None:
    """An exception as ``Type: message``, short: the first line, without a C++ source location (``[.../pair.cc:553]``),
    and without the advice torch appends after the first sentence (``. This is typically caused by ...``)."""
    if error is None:
        return None
    if isinstance(error, BaseException):
        message = str(error)
        text = f"{type(error).__name__}: {message}" if message.strip() else type(error).__name__
    else:
        text = str(error)
    text = text.strip()
    first = next((line.strip() for line in text.splitlines() if line.strip()), "")
    first = _SOURCE_PREFIX.sub("", first)
    sentence = re.search(r"\.\s+(?=[A-Z])", first)
    if sentence and ": " in first[: sentence.start()]:
        first = first[: sentence.start()]
    first = first.rstrip(" :")
    return (first[: MAX_ERROR_CHARS - 3] + "...") if len(first) > MAX_ERROR_CHARS else (first or None)


def is_communication_error(error: str | None) -> bool:
    return bool(error) and COMMUNICATION_ERRORS.search(str(error)) is not None


def write_marker(run_dir: Path, rank: int, state: str, *, status: str | None = None, error: BaseException | str | None = None,
                 ended: float | None = None, step: int | None = None) -> None:
    """Write ``rank``'s marker atomically (rank 0 may read it at any moment); the JSON line only for a rank that did not
    complete, so that a completed rank's marker stays ``ended`` as before."""
    path = marker_path(run_dir, rank)
    path.parent.mkdir(parents=True, exist_ok=True)
    text = state
    if state == ENDED and status is not None and status != "completed":
        fields = {"status": status, "error": short_error(error), "ended": ended, "step": step}
        text += "\n" + strict_dumps(fields, default=str)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(text, encoding="utf-8")
    os.replace(tmp, path)


def read_marker(path: Path, rank: int | None = None) -> RankEnd | None:
    """A marker as a ``RankEnd`` (an older one, ``running`` or ``ended`` alone, included); None when it cannot be read.

    Never follows a symbolic link (a received run directory is data)."""
    path = Path(path)
    if rank is None:
        try:
            rank = int(path.name.rsplit("-", 1)[-1])
        except ValueError:
            return None
    try:
        if path.is_symlink() or not path.is_file() or path.stat().st_size > MAX_MARKER_BYTES:
            return None
        text = path.read_text(encoding="utf-8", errors="replace")
    except OSError:
        return None
    lines = text.strip().splitlines()
    if not lines:
        return None
    state = lines[0].strip()
    fields: dict[str, Any] = {}
    if len(lines) > 1:
        try:
            loaded = json.loads(lines[1])
            fields = loaded if isinstance(loaded, dict) else {}
        except ValueError:
            fields = {}
    step = fields.get("step")
    return RankEnd(rank=rank, state=state, status=_str(fields.get("status")), error=short_error(_str(fields.get("error"))),
                   ended=_number(fields.get("ended")), step=step if _is_int(step) else None)


def read_markers(run_dir: Path) -> list[RankEnd]:
    """Every rank's marker in ``run_dir/ranks`` (none when ``ranks/`` is a symbolic link), by rank."""
    ranks = Path(run_dir) / "ranks"
    if ranks.is_symlink() or not ranks.is_dir():
        return []
    found = []
    for path in ranks.glob("attempt.rank-*"):
        end = read_marker(path)
        if end is not None:
            found.append(end)
    return sorted(found, key=lambda e: e.rank)


def first_failure(ends: list[RankEnd]) -> tuple[RankEnd | None, list[RankEnd]]:
    """(the rank that failed first, the ranks that failed after it), from the ranks that crashed with an error.

    A rank whose error is a communication error is secondary when another rank
    has an error of its own; among the rest, the earliest end time wins (a rank
    without one comes last, lowest rank first)."""
    failed = [e for e in ends if e.failed]
    if not failed:
        return None, []
    own = [e for e in failed if not e.communication]
    pool = own or failed
    first = min(pool, key=lambda e: (e.ended is None, e.ended if e.ended is not None else 0.0, e.rank))
    rest = sorted((e for e in failed if e is not first), key=lambda e: e.rank)
    return first, rest


def _str(value: Any) -> str | None:
    return value if isinstance(value, str) and value.strip() else None


def _number(value: Any) -> float | None:
    return float(value) if isinstance(value, (int, float)) and not isinstance(value, bool) else None


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)
