"""How a harness stop is told outside training: the stderr banner, the stop marker, and ``harness wrap``'s exit status.

A stop ends ``trainer.train()`` early, but the script around it usually goes
on (saves the model, evaluates, exits 0), so nobody would notice. Hence three
signals: a banner on stderr (rank 0, at the moment of the stop); a small JSON
marker per rank in the private directory ``harness wrap`` names in
``HARNESS_STOP_DIR``, so that wrap can exit :data:`EXIT_STOPPED` without
parsing any output; and, with the core option ``on_stop: raise``,
``harness.HarnessStopped`` from ``train()``. Standard library only: the
parent (``harness wrap``) reads markers without importing torch.
"""
from __future__ import annotations

import json
import os
import textwrap
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Iterable, Mapping
from harness.core.strictjson import dumps

STOP_DIR_ENV = "HARNESS_STOP_DIR"
EXIT_STOPPED = 75  # EX_TEMPFAIL (sysexits.h): not 1 (a crash) nor 2 (a harness usage error)
MARKER_FORMAT = "train-harness-stop/1"
MARKER_GLOB = "stop.rank-*.json"
STOPPING_ACTIONS = ("rollback", "save_and_stop", "stop")
RULE = "=" * 78

_DONE = {
    "stop": "stopped training",
    "save_and_stop": "stopped training",
    "rollback": "stopped training to roll back",
}
_HOW = {
    "stop": "action: stop; no checkpoint of this step was saved",
    "save_and_stop": "action: save_and_stop; a checkpoint of this step was saved",
    "rollback": "action: rollback; the stage runner restarts from the last good checkpoint",
}


@dataclass(frozen=True)
class StopNotice:
    """One stop of one ``train()`` call, as one rank saw it (rank 0 knows the causes)."""

    step: int
    action: str  # stop, save_and_stop, or rollback (only when a stage runner takes it over)
    output_dir: str
    codes: tuple[str, ...] = ()  # the causes' finding codes, the one that decided the stop last
    messages: tuple[str, ...] = ()  # the causes' messages, same order (rank 0)
    attempt: int | None = None  # 1-based, as the report numbers train() calls; None off rank 0
    rank: int = 0
    raised: bool = False  # HarnessStopped was raised from train() (config on_stop: raise)
    pid: int = field(default_factory=os.getpid)

    @property
    def ends_training(self) -> bool:
        """False for a rollback a stage runner carries out: training goes on from the last good checkpoint."""
        return self.action != "rollback"

    @property
    def where(self) -> str:
        """``step 11 (attempt 2)``."""
        return f"step {self.step}" + (f" (attempt {self.attempt})" if self.attempt is not None else "")

    @property
    def because(self) -> str:
        return f" after {', '.join(self.codes)}" if self.codes else ""

    def to_json(self) -> str:
        return dumps({"format": MARKER_FORMAT, **asdict(self)}, sort_keys=True)

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> "StopNotice":
        """A notice from a marker's JSON; ``ValueError`` for anything that is not one."""
        if data.get("format") != MARKER_FORMAT or not isinstance(data.get("step"), int) or not isinstance(data.get("action"), str):
            raise ValueError("not a harness stop marker")
        attempt = data.get("attempt")
        return cls(
            step=data["step"],
            action=data["action"],
            output_dir=str(data.get("output_dir", "")),
            codes=tuple(str(c) for c in data.get("codes") or ()),
            messages=tuple(str(m) for m in data.get("messages") or ()),
            attempt=attempt if isinstance(attempt, int) else None,
            rank=int(data.get("rank") or 0),
            raised=bool(data.get("raised")),
            pid=int(data.get("pid") or 0),
        )


def banner(notice: StopNotice) -> str:
    """The block rank 0 prints on stderr when the harness stops training: what, where, why, and what to run next."""
    title = " HARNESS ROLLING BACK " if not notice.ends_training else " HARNESS STOPPED TRAINING "
    lines = [title.center(len(RULE), "="),
             f"The harness {_DONE.get(notice.action, notice.action)} at {notice.where}{notice.because}",
             f"({_HOW.get(notice.action, 'action: ' + notice.action)})."]
    for code, message in list(zip(notice.codes, notice.messages))[-3:]:
        lines += textwrap.wrap(f"{code}: {message}", 76, initial_indent="  ", subsequent_indent="    ", max_lines=3, placeholder=" ...")
    if notice.ends_training:
        lines += ["Training did NOT reach its last step. The script may still save, evaluate and exit",
                  f"normally; under `harness wrap` the job then exits {EXIT_STOPPED}."]
    lines += [f"Next: harness explain {notice.output_dir}", RULE]
    return "\n".join(lines) + "\n"


def write_marker(notice: StopNotice, env: Mapping[str, str] | None = None) -> Path | None:
    """Write this rank's marker into ``$HARNESS_STOP_DIR`` (atomically); None when not under ``harness wrap``.

    The directory is wrap's own: it is never created here (a remote node of a
    multi-node job does not have it, and then there is nothing to tell).
    """
    directory = (os.environ if env is None else env).get(STOP_DIR_ENV)
    if not directory or not Path(directory).is_dir():
        return None
    path = Path(directory) / f"stop.rank-{notice.rank}.pid-{notice.pid}.json"
    tmp = path.with_name(f".{path.name}.tmp")
    try:
        tmp.write_text(notice.to_json(), encoding="utf-8")
        os.replace(tmp, path)
    except OSError:
        return None
    return path


def read_markers(directory: Path | str) -> list[StopNotice]:
    """Every readable marker in ``directory``, rank 0's first; damaged files are skipped."""
    notices = []
    for path in sorted(Path(directory).glob(MARKER_GLOB)):
        try:
            notices.append(StopNotice.from_dict(json.loads(path.read_text(encoding="utf-8"))))
        except (OSError, ValueError, TypeError, AttributeError):
            continue
    return sorted(notices, key=lambda n: (n.rank, -n.step))


def wrapped_exit_status(status: int, notices: Iterable[StopNotice]) -> int:
    """``harness wrap``'s exit status: :data:`EXIT_STOPPED` when the harness stopped training, unless the command failed otherwise.

    - no stop: the command's own status;
    - a stop and the command exited 0 (it ignored the stop): 75;
    - a stop, ``HarnessStopped`` raised (``on_stop: raise``) and the command exited 1 (Python's status for an
      uncaught exception; torchrun and accelerate pass it on): 75;
    - a stop and any other status (a crash with 1 that was not ``HarnessStopped``, 2, 3, a signal's 128+N): the command's own.
    """
    stops = [n for n in notices if n.ends_training]
    if not stops:
        return status
    if status == 0 or (status == 1 and any(n.raised for n in stops)):
        return EXIT_STOPPED
    return status


def wrap_summary(notices: list[StopNotice], status: int, returned: int) -> str:
    """The line ``harness wrap`` prints at the end when the harness stopped training."""
    first = notices[0]
    if returned == EXIT_STOPPED:
        outcome = f"exit status {EXIT_STOPPED} (the command itself exited {status})"
    else:
        outcome = f"the command's own exit status {status} is kept (it failed for another reason too)"
    return (f"harness wrap: the harness stopped training at {first.where}{first.because}; {outcome}. "
            f"See `harness explain {first.output_dir}`.\n")
