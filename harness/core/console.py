"""Live console lines: one line on stderr per finding at warning or above, on rank 0, as it is made.

A finding made at step 40 of a three-day run should not wait for someone to
open ``report.html``: the console is where a user of the Trainer already
looks. One short line per finding, rate-limited per code (a detector that
fires every step must not bury the Trainer's own output), naming the
playbook command. Printing never raises: a closed or broken stderr must not
kill training, and an info finding costs one comparison.
"""
from __future__ import annotations

import functools
import os
import sys
import threading
from importlib import resources
from pathlib import Path
from typing import Any, Literal, TextIO

from pydantic import BaseModel, ConfigDict, Field, field_validator

from harness.core.findings import Finding, Severity
from harness.core.terminal_text import terminal_text

QUIET_ENV = "HARNESS_QUIET"
PREFIX = "[harness]"
MESSAGE_CHARS = 200  # a finding's message is cut to about this many characters on its line

ConsoleLevel = Literal["info", "warning", "error", "critical", "off"]


class ConsoleOptions(BaseModel):
    """The ``console:`` section of the core options."""

    model_config = ConfigDict(extra="forbid")

    level: ConsoleLevel = Field(
        "warning",
        description="Rank 0 prints one line on stderr per finding at this severity or above, as it is made "
        "(`[harness] step 40 LOSS_SPIKE warning: ... -> harness playbook LOSS_SPIKE`); 'off' prints none. "
        f"{QUIET_ENV}=1 in the environment (what `harness wrap --quiet` sets) turns the lines off too.",
    )
    @field_validator("level", mode="before")
    @classmethod
    def _unquoted_off(cls, value: Any) -> Any:
        """YAML reads an unquoted ``off`` (and ``no``) as false: ``level: off`` means off, as written."""
        return "off" if value is False else value

    per_code: int = Field(
        3, ge=1,
        description="Lines printed per finding code; after that one line says that further lines of that code are held "
        "back (every finding is still in findings.jsonl and the report).",
    )


def quiet_from_env(env: dict[str, str] | None = None) -> bool:
    """Whether the environment asks for silence (``HARNESS_QUIET`` set to anything but '', '0' or 'false')."""
    value = (os.environ if env is None else env).get(QUIET_ENV, "")
    return value.strip().lower() not in ("", "0", "false", "no")


def shorten(text: str, limit: int = MESSAGE_CHARS) -> str:
    """One line of at most about ``limit`` characters: whitespace runs collapsed, a long text cut at a word."""
    flat = " ".join(str(text).split())
    if len(flat) <= limit:
        return flat
    cut = flat[:limit].rsplit(" ", 1)[0] if " " in flat[limit // 2 : limit] else flat[:limit]
    return cut.rstrip(" ,;:") + " ..."


def finding_line(finding: Finding) -> str:
    """``[harness] step 40 rank 1 LOSS_SPIKE warning: <message> -> harness playbook LOSS_SPIKE``."""
    where = f" step {finding.step}" if finding.step is not None else ""
    rank = f" rank {finding.rank}" if finding.rank else ""
    return (f"{PREFIX}{where}{rank} {finding.code} {finding.severity.value}: {shorten(finding.message)}"
            f" -> {playbook_pointer(finding)}")


def playbook_pointer(finding: Finding) -> str:
    """Where the finding's playbook is: ``harness playbook CODE`` for the playbooks this harness ships; a code of another
    package's plugin points at the playbook its code names (``my-playbook#loss``), which `harness playbook` cannot print."""
    family = (finding.playbook or "").partition("#")[0]
    if not family or _shipped_playbook(family):
        return f"harness playbook {finding.code}"
    return f"playbook {finding.playbook}"


@functools.lru_cache(maxsize=64)
def _shipped_playbook(family: str) -> bool:
    try:
        return (Path(str(resources.files("harness.playbooks"))) / f"{family}.md").is_file()
    except (ImportError, OSError, TypeError, ValueError):  # an odd install: the built-in pointer, as before
        return True


class Console:
    """Prints findings as they are made (rank 0 only), at most ``per_code`` lines per code."""

    def __init__(self, options: ConsoleOptions | None = None, *, is_main: bool = True, stream: TextIO | None = None,
                 env: dict[str, str] | None = None) -> None:
        options = options or ConsoleOptions()
        off = not is_main or options.level == "off" or quiet_from_env(env)
        self.threshold = 99 if off else Severity(options.level).rank  # above every severity: nothing prints
        self.per_code = options.per_code
        self._stream = stream
        self._counts: dict[str, int] = {}
        self._lock = threading.Lock()  # the training thread and a watchdog's thread both show findings

    @property
    def enabled(self) -> bool:
        return self.threshold < 99

    def show(self, finding: Finding) -> None:
        """Print ``finding``'s line if its severity reaches the level and its code is under the limit; never raises."""
        if finding.severity.rank < self.threshold:
            return
        try:
            with self._lock:
                seen = self._counts.get(finding.code, 0) + 1
                self._counts[finding.code] = seen
            if seen <= self.per_code:
                self._write(finding_line(finding))
            elif seen == self.per_code + 1:
                self._write(f"{PREFIX} further {finding.code} lines are held back ({self.per_code} shown; every finding "
                            "is in findings.jsonl and the report)")
        except Exception:  # noqa: BLE001 - a console line is never worth a crash
            pass

    def _write(self, line: str) -> None:
        write_stderr(line, self._stream)


def write_stderr(text: str, stream: TextIO | None = None) -> None:
    """``text`` (one line or several, without the last line break) on stderr, never raises.

    The Trainer's progress bar is on stderr: through tqdm's own ``write`` the
    bar is cleared, the text written and the bar redrawn, so the text never
    starts on the bar's line. ``stream``: another stream, written plainly.
    """
    target = stream if stream is not None else sys.stderr
    if target is None:  # pythonw, or a closed descriptor replaced by None
        return
    text = terminal_text(text)  # a finding's message may carry a received run's or the data's control sequences
    try:
        bars = sys.modules.get("tqdm") if stream is None else None
        if bars is not None:
            bars.tqdm.write(text, file=target)
        else:
            target.write(text + "\n")
        target.flush()
    except (OSError, ValueError, AttributeError):  # closed stream, broken pipe, full disk, an odd tqdm
        pass
