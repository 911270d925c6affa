"""User-facing errors: one paragraph each, naming what, where and how to fix."""
from __future__ import annotations

import difflib
from typing import Any, Iterable


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


class RunDirLinkedError(RunDirError):
    """The run directory holds a link (symbolic or hard) where the harness writes: its writes would land elsewhere."""


class RunDirLockedError(RunDirError):
    """Another live process holds the run directory's lock: two runs would write the same files."""


class NoCompleteCheckpointError(HarnessError):
    """``resume_from_checkpoint=True`` found checkpoints, but none complete enough to resume from."""


class HarnessStopped(HarnessError):
    """Raised from ``trainer.train()`` after the harness stopped training and the Trainer returned (core option ``on_stop: raise``).

    Without it a stopped ``train()`` returns like a finished one and the script
    goes on as if training had completed. Not to be confused with
    :class:`harness.HarnessStop`, which a plugin raises to ask for a stop.
    ``code`` is the finding that decided the stop (``codes``: every cause),
    ``attempt`` the ``train()`` call's number in the report (1-based).
    """

    def __init__(self, step: int, output_dir: str, codes: tuple[str, ...] = (), attempt: int | None = None, action: str = "stop") -> None:
        self.step, self.output_dir, self.codes, self.attempt, self.action = step, str(output_dir), tuple(codes), attempt, action
        self.code = self.codes[-1] if self.codes else None
        where = f"step {step}" + (f" (attempt {attempt})" if attempt is not None else "")
        because = f" after {', '.join(self.codes)}" if self.codes else ""
        super().__init__(
            f"the harness stopped training at {where}{because} ({action}); trainer.train() returned early and raised "
            f"HarnessStopped because the config says `on_stop: raise`. Fix: run `harness explain {self.output_dir}` for "
            "what happened and what to do; `on_stop: return` makes train() return normally after a stop."
        )

    def __reduce__(self) -> tuple[Any, ...]:
        """Rebuilt from its fields, so it crosses process pools and launchers that pickle a worker's exception."""
        return (type(self), (self.step, self.output_dir, self.codes, self.attempt, self.action))


def did_you_mean(word: str, choices: Iterable[str]) -> str:
    """' Did you mean 'x'?' when a close match exists, else ''."""
    matches = difflib.get_close_matches(str(word), [str(c) for c in choices], n=1, cutoff=0.6)
    return f" Did you mean '{matches[0]}'?" if matches else ""
