"""Everything a report is built from, read from the run directory alone.

Every reader tolerates what a ``kill -9`` leaves behind: a torn last line, a
file that was never written, an attempt still marked ``running``.
"""
from __future__ import annotations

import json
import math
import os
import stat
from collections import Counter, deque
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterator

import yaml

from harness.core.findings import Finding, findings_path, iter_findings
from harness.core.jsonl import REPORT_SAMPLE_BYTES, read_jsonl  # noqa: F401 - re-exported: plugins read their own JSONL files with it
from harness.core.strictjson import as_float  # re-exported: a number from a record field ("nan"/"inf" strings included)
from harness.core.received import RefusedFile, read_received_bytes
from harness.core.safe_yaml import MAX_YAML_BYTES, UnsafeYaml, load_yaml, short_repr
from harness.lib.rank_markers import ENDED, RankEnd, read_markers, short_error
from harness.lib.rundir import LockHolder, read_holder
from harness.lib.runinfo import INTERRUPTED, read_run_info, status_of


@dataclass
class RunRecord:
    """The run directory (``<output_dir>/harness``) as data."""

    run_dir: Path
    info: dict[str, Any]
    findings: list[Finding]
    steps: list[dict[str, Any]]
    logs: list[dict[str, Any]]
    config: dict[str, Any] = field(default_factory=dict)
    unreadable: dict[str, int] = field(default_factory=dict)  # file name -> lines (or 1: the whole file) skipped
    problems: list[str] = field(default_factory=list)  # what else could not be read, one sentence each
    findings_unknown: str | None = None  # why findings.jsonl was not read (missing, not a file, a link, unreadable); None: read
    left_out: dict[tuple[str, Any], int] = field(default_factory=dict)  # (code, severity) -> findings counted, not held
    _cache: dict[str, Any] = field(default_factory=dict, repr=False, compare=False)  # what is read on demand, once

    @property
    def findings_known(self) -> bool:
        """Whether ``findings.jsonl`` was read: when not, "no finding" means nothing (they may all be lost)."""
        return self.findings_unknown is None

    @classmethod
    def load(cls, run_dir: Path) -> "RunRecord":
        run_dir = Path(run_dir)
        unreadable: dict[str, int] = {}
        config, problems = read_run_config(run_dir)
        sample = FindingSample()
        findings, findings_unknown = read_findings_of(run_dir, unreadable, problems, sample)
        return cls(
            run_dir=run_dir,
            info=read_run_info(run_dir, problems),
            findings=sorted(findings, key=lambda f: (f.step if f.step is not None else -1, f.time)),
            steps=list(read_jsonl(run_dir / "steps.jsonl", unreadable, require_step=True, problems=problems,
                                  sample_bytes=CURVE_READ_BYTES)),
            logs=list(read_jsonl(run_dir / "metrics.jsonl", unreadable, problems=problems, sample_bytes=CURVE_READ_BYTES)),
            config=config,
            unreadable=unreadable,
            problems=problems,
            findings_unknown=findings_unknown,
            left_out=dict(sample.left_out),
        )

    def damage_notes(self) -> list[str]:
        """What could not be read, in sentences for the report (empty for an intact run)."""
        notes = []
        for name, count in sorted(self.unreadable.items()):
            lines = "1 line" if count == 1 else f"{count} lines"
            notes.append(f"{lines} of {name} could not be read and {'was' if count == 1 else 'were'} skipped "
                         "(a torn last line after a kill, or a damaged/edited file).")
        end = self.lock_end()
        if end is not None:
            notes.append(f"run.json could not be updated at the end of the last train() call; how it ended ({end['status']}"
                         f"{' at step ' + str(end['end_step']) if _is_int(end.get('end_step')) else ''}) is taken from the "
                         "run lock (.lock).")
        return notes + self.problems

    def lock_end(self) -> dict[str, Any] | None:
        """How the last train() call ended, from the run lock, when run.json still says it runs but the process that held
        the lock has let it go after recording its end there (run.json could not be replaced: ``rundir.record_end``)."""
        attempts = self.attempts
        if not attempts or attempt_status(attempts[-1]) != "running":
            return None
        holder = self.lock_holder()
        if holder is None or holder.alive or holder.end is None:
            return None
        started, ended = as_float(attempts[-1].get("started")), as_float(holder.end.get("ended"))
        if started is not None and (ended is None or ended < started):
            return None  # an earlier call's end
        return holder.end

    @property
    def output_dir(self) -> Path:
        return self.run_dir.parent

    @property
    def attempts(self) -> list[dict[str, Any]]:
        """The ``train()`` calls; one that never recorded its end is ``killed`` (or still running). The one list, read
        once (a copy per use made a run.json of 200,000 attempts quadratic); callers do not change it."""
        if "attempts" not in self._cache:
            self._cache["attempts"] = list(self.info.get("attempts", []))
        return self._cache["attempts"]

    @property
    def last_status(self) -> str:
        """How the last ``train()`` call ended; ``killed`` when it never recorded its end."""
        if not self.attempts:
            return "unknown"
        status = attempt_status(self.attempts[-1])
        if status != "running":
            return status
        end = self.lock_end()  # run.json could not record the end, the lock did: not killed
        return str(end["status"]) if end is not None else "killed"

    def lock_holder(self) -> LockHolder | None:
        """Who the run lock (``.lock``) names and whether that process holds it on this host now (read once: a process
        that holds it is training in this run directory); None without a readable lock file (a link is not followed)."""
        if "lock" not in self._cache:
            self._cache["lock"] = read_holder(self.run_dir)
        return self._cache["lock"]

    def rank_ends(self, index: int) -> list[RankEnd]:
        """How the ranks of attempt ``index`` that did not complete ended, by rank (several processes only).

        From run.json's copy (``attempts[i].ranks``, written by rank 0 at the
        end of the call) and, for the last attempt, from the ranks' markers
        (``ranks/attempt.rank-<r>``), which a rank that ended after rank 0
        wrote run.json still updated; a marker older than the attempt's start,
        or one without an end status (an older version's), is left out.
        """
        attempts = self.attempts
        if not -len(attempts) <= index < len(attempts):
            return []
        attempt = attempts[index]
        recorded = attempt.get("ranks")
        ends = {e.rank: e for e in map(RankEnd.from_dict, recorded if isinstance(recorded, list) else []) if e is not None}
        if index % len(attempts) == len(attempts) - 1:
            started = as_float(attempt.get("started"))
            for marker in read_markers(self.run_dir):
                if marker.state != ENDED or marker.status is None:
                    continue
                if started is not None and (marker.ended is None or marker.ended < started):
                    continue  # an earlier call's marker
                ends[marker.rank] = marker
        error = error_text(attempt.get("error"))
        if ends and 0 not in ends and attempt.get("status") == "crashed" and error:  # rank 0's own, from run.json
            ended = as_float(attempt.get("ended"))
            ends[0] = RankEnd(rank=0, state=ENDED, status="crashed", error=short_error(error), ended=ended,
                              step=attempt.get("end_step") if _is_int(attempt.get("end_step")) else None)
        return [ends[rank] for rank in sorted(ends)]

    def attempt_findings(self, index: int) -> list[Finding]:
        """The findings made during attempt ``index`` (by time: from its start to the next attempt's start)."""
        start, end = self._window(index)
        return [f for f in self.findings if (start is None or f.time >= start) and (end is None or f.time < end)]

    def attempt_end_step(self, index: int) -> int | None:
        """The step attempt ``index`` ended at: its recorded ``end_step``, else (killed) the last step it recorded.

        Not the highest step of the run: a resumed attempt that stopped at
        step 11 ends at 11, even when the attempt it resumed reached 14.
        """
        attempts = self.attempts
        if not -len(attempts) <= index < len(attempts):
            return self.last_step
        recorded = attempts[index].get("end_step")
        if _is_int(recorded):
            return recorded
        end = self.lock_end() if index % len(attempts) == len(attempts) - 1 else None
        if end is not None and _is_int(end.get("end_step")):
            return int(end["end_step"])
        start, end = self._window(index)
        inside = [r["step"] for r in self.steps if _is_int(r.get("step")) and _within(as_float(r.get("time")), start, end)]
        inside += [f.step for f in self.attempt_findings(index) if _is_int(f.step)]
        return max(inside) if inside else None

    def last_known_step(self, index: int = -1) -> int | None:
        """The last step attempt ``index`` is known to have reached, from every record of it: its recorded ``end_step``;
        for one that never recorded its end, the highest of :meth:`attempt_end_step` (steps.jsonl, written in batches,
        and the findings) and, for the last attempt, the last step of ``metrics.jsonl`` and of each rank's data ledger
        (written at every step), read from their tails only and only when written since the attempt started.

        A lower bound for a killed attempt: the step in flight, or steps no file kept, may have gone further.
        """
        attempts = self.attempts
        known = self.attempt_end_step(index)
        if not attempts or not -len(attempts) <= index < len(attempts) or index % len(attempts) != len(attempts) - 1:
            return known
        attempt = attempts[-1]
        if _is_int(attempt.get("end_step")):
            return known
        started = as_float(attempt.get("started"))
        if started is None:  # which attempt wrote a file's last line cannot be told
            return known
        start_step = attempt.get("start_step") if _is_int(attempt.get("start_step")) else None
        steps = [known] if known is not None else []
        for path, ledger in [(self.run_dir / "metrics.jsonl", False), *((p, True) for p in _ledger_files(self.run_dir))]:
            step = _last_step_since(path, started, ledger)
            if step is not None and (start_step is None or step >= start_step):
                steps.append(step)
        return max(steps) if steps else None

    def attempt_stop(self, index: int) -> tuple[int | None, list[str]]:
        """Where and why the harness stopped attempt ``index``: (step, cause codes, the deciding one last).

        From its ``ACTION_TAKEN`` finding of a stopping action (whose
        ``evidence.cause`` names the finding that decided), else from the
        findings whose action stopped training; (None, []) when neither exists.
        """
        found = self.attempt_findings(index)
        by_id = {f.id: f for f in self.findings}
        taken = [f for f in found if f.code == "ACTION_TAKEN" and f.evidence.get("action") in ("stop", "save_and_stop", "rollback")]
        stoppers = [f for f in found if f.action in ("stop", "save_and_stop", "rollback") or f.code == "PLUGIN_STOP"]
        codes = list(dict.fromkeys(f.code for f in stoppers))
        if taken:
            cause = by_id.get(str(taken[-1].evidence.get("cause")))
            if cause is not None:
                codes = [c for c in codes if c != cause.code] + [cause.code]
            return taken[-1].step, codes
        return (stoppers[-1].step, codes) if stoppers else (None, [])

    def _window(self, index: int) -> tuple[float | None, float | None]:
        attempts = self.attempts
        index = index % len(attempts) if attempts else 0
        start = as_float(attempts[index].get("started")) if attempts else None
        end = as_float(attempts[index + 1].get("started")) if index + 1 < len(attempts) else None
        return start, end

    @property
    def last_step(self) -> int | None:
        """The highest step anything recorded (the extent of the run; for the last attempt's step see :meth:`attempt_end_step`)."""
        candidates = [r["step"] for r in self.steps if isinstance(r.get("step"), int)]
        candidates += [a["end_step"] for a in self.attempts if isinstance(a.get("end_step"), int)]
        candidates += [f.step for f in self.findings if isinstance(f.step, int)]
        return max(candidates) if candidates else None

    def series(self, key: str) -> tuple[list[int], list[float]]:
        """``(steps, values)`` of a per-step field, finite values only, in file order."""
        xs, ys = [], []
        for record in self.steps:
            value = as_float(record.get(key))
            if value is not None and math.isfinite(value) and _is_int(record.get("step")):
                xs.append(record["step"])
                ys.append(value)
        return xs, ys

    def tokens_at(self, step: int | None) -> float | None:
        """Tokens processed when ``step`` ended (its last record: a replayed step counts once, as last run)."""
        found = None
        for record in self.steps:
            if record.get("step") == step:
                found = as_float(record.get("tokens"))
        return found

    def evidence_path(self, value: Any) -> Path | None:
        """An evidence value as an existing path (absolute, or relative to the run or output directory).

        Only a path that lands inside the run's output directory (the run
        directory included), symlinks resolved, counts: a received run's
        ``findings.jsonl`` is data, and a planted ``/etc/passwd`` or
        ``../../secret`` must not become a link in its report.
        """
        if not isinstance(value, str) or not value or "\n" in value or "\0" in value or len(value) > 4096:
            return None
        candidate = Path(value)
        options = []
        inside = [i for i, part in enumerate(candidate.parts) if part == self.run_dir.name]
        if inside:  # a path into a run directory: this one's copy first (the run may have moved, or be read from elsewhere)
            options.append(self.run_dir.joinpath(*candidate.parts[inside[-1] + 1:]))
        options += [candidate] if candidate.is_absolute() else [self.run_dir / candidate, self.output_dir / candidate]
        try:
            allowed = self.output_dir.resolve()
        except OSError:
            return None
        for option in options:
            try:
                if option.exists():
                    resolved = option.resolve()
                    if resolved.is_relative_to(allowed):
                        return resolved
            except OSError:
                continue
        return None


FINDINGS_FILE = "findings.jsonl"


def attempt_status(attempt: dict[str, Any]) -> str:
    """How an attempt ended, from its run.json entry: ``interrupted`` also for a Ctrl-C that older versions recorded as
    ``crashed`` with a ``KeyboardInterrupt`` error."""
    return status_of(str(attempt.get("status", "unknown")), attempt.get("error"))


def error_text(error: Any) -> str | None:
    """An attempt's recorded error (``Type: message``) as shown: an exception with an empty message is its type alone
    (``RuntimeError``, not ``RuntimeError: ``); None when there is none."""
    if not isinstance(error, str) or not error.strip():
        return None
    text = error.strip()
    return text[:-1].rstrip() if text.endswith(":") else text


def read_findings_of(run_dir: Path, skipped: dict[str, int], problems: list[str],
                     sample: FindingSample | None = None) -> tuple[list[Finding], str | None]:
    """All findings of a run (``findings.jsonl`` plus what only the ranks' spill files hold); (findings, why
    ``findings.jsonl`` was not read, or None).

    Unlike :func:`harness.core.findings.read_run_findings`, a file that is
    missing, not a regular file, a symbolic link (never read through: a
    received run directory is data) or that cannot be opened is said in
    ``problems``, so that a report does not read "no finding" for findings it
    never saw.
    """
    run_dir = Path(run_dir)
    main_path = findings_path(run_dir, 0)
    unknown = _unreadable_file(main_path, FINDINGS_FILE)
    if unknown is not None:
        problems.append(f"{unknown}: the run's findings are not known (any finding it made may be missing from this report).")
    sample = sample if sample is not None else FindingSample()
    if unknown is None:
        sample.add_all(iter_findings(main_path, skipped, problems, read_bytes=FINDINGS_READ_BYTES))
    ranks = run_dir / "ranks"
    if ranks.is_symlink():
        problems.append("ranks/ is a symbolic link: not followed (a received run directory is data); the other ranks' "
                        "unmerged findings are left out.")
        return sample.done(problems), unknown
    for spill in sorted(ranks.glob("findings.rank-*.jsonl")):
        name = f"ranks/{spill.name}"
        why = _unreadable_file(spill, name)
        if why is not None:
            problems.append(f"{why}: its rank's unmerged findings are left out.")
            continue
        sample.add_all(iter_findings(spill, skipped, problems, read_bytes=FINDINGS_READ_BYTES), merged=True)
    return sample.done(problems), unknown


CURVE_READ_BYTES = REPORT_SAMPLE_BYTES  # steps.jsonl and metrics.jsonl past this are thinned (about 250,000 steps of records)
FINDINGS_READ_BYTES = 64 << 20  # a findings file past this is read at its start and end (findings are rate-limited: KBs)
KEPT_PER_CODE = 200  # findings of one code and severity held whole: the first half and the last half of them


class FindingSample:
    """A run's findings held in bounded memory: every finding of a code up to ``KEPT_PER_CODE``, past that its first
    and last ``KEPT_PER_CODE // 2`` and the count of those between (``left_out``), so that a findings file of
    millions of lines costs neither gigabytes nor minutes in the report and ``explain``."""

    def __init__(self) -> None:
        self._first: dict[tuple[str, Any], list[Finding]] = {}
        self._last: dict[tuple[str, Any], deque[Finding]] = {}
        self.left_out: Counter[tuple[str, Any]] = Counter()
        self._seen: set[str] = set()  # ids of the findings rank 0's file holds (a spill file repeats the merged ones)

    def add_all(self, findings: Iterable[Finding], merged: bool = False) -> None:
        half = KEPT_PER_CODE // 2
        for finding in findings:
            if merged and finding.id in self._seen:
                continue
            if not merged and len(self._seen) < 200_000:  # bounded too: past it, a spill file's repeats may count twice
                self._seen.add(finding.id)
            key = (finding.code, finding.severity)
            first = self._first.setdefault(key, [])
            if len(first) < half:
                first.append(finding)
                continue
            last = self._last.setdefault(key, deque(maxlen=half))
            if len(last) == half:
                self.left_out[key] += 1
            last.append(finding)

    def done(self, problems: list[str]) -> list[Finding]:
        """The findings held; a note in ``problems`` when some were counted but not held."""
        if self.left_out:
            codes = ", ".join(f"{code} {count:,}" for (code, _), count in self.left_out.most_common(5))
            problems.append(f"the run holds more than {KEPT_PER_CODE} findings of some codes ({codes} more); their first "
                            f"and last {KEPT_PER_CODE // 2} are shown, the others counted.")
        return [f for key, first in self._first.items() for f in (*first, *self._last.get(key, ()))]


def _unreadable_file(path: Path, name: str) -> str | None:
    """Why the run directory's file ``path`` (called ``name``) is not read, or None when it can be: missing, a symbolic
    link (not followed), not a regular file, or not readable (permissions, I/O)."""
    try:
        info = os.lstat(path)
    except FileNotFoundError:
        return f"{name} is missing"
    except OSError as exc:
        return f"{name} could not be read ({type(exc).__name__})"
    if stat.S_ISLNK(info.st_mode):
        return f"{name} is a symbolic link: not followed (a received run directory is data)"
    if not stat.S_ISREG(info.st_mode):
        kind = "a directory" if stat.S_ISDIR(info.st_mode) else "not a regular file"
        return f"{name} could not be read (it is {kind})"
    try:
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0))
    except OSError as exc:
        return f"{name} could not be read ({type(exc).__name__})"
    os.close(fd)
    return None


def read_run_config(run_dir: Path) -> tuple[dict[str, Any], list[str]]:
    """The run's resolved ``config.yaml`` as a mapping, its ``plugins`` a list of names; (config, problems found).

    A damaged file (not UTF-8, not YAML, not a mapping, ``plugins: 5``) costs
    what is damaged, said in ``problems``; the report is built without it.
    """
    path = Path(run_dir) / "config.yaml"
    if not path.is_file() and not path.is_symlink():
        return {}, []
    try:
        data = load_yaml(read_received_bytes(path, MAX_YAML_BYTES + 1).decode("utf-8"))
    except RefusedFile as exc:
        return {}, [f"{exc}: the run's plugins and options are left out."]
    except (OSError, UnicodeDecodeError, yaml.YAMLError, RecursionError, ValueError) as exc:
        why = f": {exc.problem}" if isinstance(exc, UnsafeYaml) else ""
        return {}, [f"config.yaml could not be read ({type(exc).__name__}{why}): the run's plugins and options are left out."]
    if data is None:
        return {}, []
    if not isinstance(data, dict):
        return {}, [f"config.yaml holds a {type(data).__name__}, not a mapping of options: the run's plugins and options are left out."]
    data = {str(k): v for k, v in data.items()}
    problems = []
    plugins = data.get("plugins")
    if plugins is not None and not (isinstance(plugins, list) and all(isinstance(p, str) for p in plugins)):
        kept = [p for p in plugins if isinstance(p, str)] if isinstance(plugins, list) else []
        problems.append(f"config.yaml: 'plugins' is not a list of names (got {short_repr(plugins)}): "
                        + (f"only {', '.join(kept)} kept." if kept else "the run's plugins are left out."))
        data["plugins"] = kept
    return data, problems


TAIL_BYTES = 1 << 16  # read from the end of metrics.jsonl and of a ledger file for the last step (files of GBs)
NUL_TAIL_BYTES = 1 << 22  # at most this much of a killed mapped writer's NUL bytes is looked through (its window is 1 MiB)
LEDGER_FILES = 64  # the ranks' ledger files looked at for the last step (rank 0 first)


def _ledger_files(run_dir: Path) -> list[Path]:
    """The ranks' ledger files (``ledger/rank-<r>.jsonl``), rank 0 first, at most ``LEDGER_FILES``; none when ``ledger``
    is missing or a symbolic link (not followed: a received run directory is data)."""
    folder = Path(run_dir) / "ledger"
    try:
        if not stat.S_ISDIR(os.lstat(folder).st_mode):
            return []
        names = [e.name for e in os.scandir(folder) if e.name.startswith("rank-") and e.name.endswith(".jsonl")]
    except OSError:
        return []
    ranks = sorted((int(n[5:-6]), n) for n in names if n[5:-6].isdigit())
    return [folder / name for _, name in ranks[:LEDGER_FILES]]


def _last_step_since(path: Path, since: float, ledger: bool) -> int | None:
    """The step of the last intact record of ``path`` with one, when the file was last written at or after ``since`` (so
    that its last line is the attempt's that started then, not an earlier attempt's); None otherwise. Only the file's
    last ``TAIL_BYTES`` before any NUL bytes a killed mapped writer left are read; a symbolic link is not followed. In a
    ledger (``ledger``), a last line that starts an attempt means the newest attempt trained no step yet: None."""
    try:
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_CLOEXEC", 0))
    except OSError:
        return None
    try:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode) or info.st_mtime < since:
            return None
        end = _end_before_nuls(fd, info.st_size)
        start = max(0, end - TAIL_BYTES)
        data = os.pread(fd, end - start, start)
    except OSError:
        return None
    finally:
        os.close(fd)
    lines = data.split(b"\n")[:-1]  # the piece after the last newline is a torn line (or empty)
    if start > 0 and lines:
        lines = lines[1:]  # the first piece may be the end of a line that began before the tail
    for raw in reversed(lines):
        try:
            record = json.loads(raw.decode("utf-8"))
        except (UnicodeDecodeError, RecursionError, ValueError):
            continue
        if not isinstance(record, dict):
            continue
        if ledger and record.get("event") == "start":
            return None
        if _is_int(record.get("step")):
            return record["step"]
    return None


def _end_before_nuls(fd: int, size: int) -> int:
    """The length of the file without the NUL bytes at its end (looked through for at most ``NUL_TAIL_BYTES``)."""
    end = size
    while end > 0 and size - end < NUL_TAIL_BYTES:
        start = max(0, end - TAIL_BYTES)
        block = os.pread(fd, end - start, start).rstrip(b"\0")
        if block:
            return start + len(block)
        end = start
    return end


def _within(value: float | None, start: float | None, end: float | None) -> bool:
    """``value`` (a time) inside ``[start, end)``; an unknown time is inside only an unbounded window."""
    if value is None:
        return start is None and end is None
    return (start is None or value >= start) and (end is None or value < end)


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)
