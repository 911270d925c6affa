"""User-facing errors: one paragraph each, naming what, where and how to fix."""
from __future__ import annotations

import difflib
from typing import Iterable


class HarnessError(Exception):
    """Base of every error the harness raises on purpose (printed without a traceback by the CLI)."""


class ConfigError(HarnessError):
    """The harness config is invalid; ``problems`` holds one paragraph per problem."""

    def __init__(self, problems: list[str]) -> None:
        self.problems = problems
        super().__init__("\n".join(problems))


class PluginError(HarnessError):
    """A plugin cannot be loaded or declares hooks the harness does not know."""


class RunDirError(HarnessError):
    """The run directory (``<output_dir>/harness``) cannot be used by this run."""


class RunDirNotWritableError(RunDirError):
    """The run directory cannot be created or written (permissions, a file in the path, a read-only mount)."""


class RunDirLockedError(RunDirError):
    """Another live process holds the run directory's lock: two runs would write the same files."""


class NoCompleteCheckpointError(HarnessError):
    """``resume_from_checkpoint=True`` found checkpoints, but none complete enough to resume from."""


def did_you_mean(word: str, choices: Iterable[str]) -> str:
    """' Did you mean 'x'?' when a close match exists, else ''."""
    matches = difflib.get_close_matches(str(word), [str(c) for c in choices], n=1, cutoff=0.6)
    return f" Did you mean '{matches[0]}'?" if matches else ""
