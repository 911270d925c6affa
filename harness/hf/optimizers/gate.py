"""What an optimizer adapter asks of the step guard (:class:`~harness.hf.guard.StepGuard` implements it)."""
from __future__ import annotations

from typing import Any, Protocol

from harness.core.actions import Action


class StepGate(Protocol):
    """What an optimizer adapter needs from the step guard."""

    def guard(self, model: Any, optimizer: Any) -> Action:
        """Run the guard; the update happens only when this is ``Action.CONTINUE``."""
        ...

    def note_optimizer_skip(self, skipped: bool) -> None:
        """The optimizer itself skipped an update the harness let through (fp16 overflow)."""
        ...

    def skip_not_applied(self, detail: str) -> None:
        """A skip the harness asked for did not hold: the update was applied."""
        ...
