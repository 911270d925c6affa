"""Actions a finding may ask for, ordered so that ranks can agree by taking the maximum."""
from __future__ import annotations

import enum


class Action(str, enum.Enum):
    """What training should do after a finding.

    ``skip_step``: the optimizer step does not happen (parameters, optimizer
    state and LR schedule unchanged; gradients are discarded).
    ``rollback``: restart from the last good checkpoint (stage runners only;
    under plain ``attach`` it becomes ``save_and_stop``).
    ``save_and_stop``: write a checkpoint at this step, then stop.
    ``stop``: stop at the end of this step without saving.
    """

    CONTINUE = "continue"
    SKIP_STEP = "skip_step"
    ROLLBACK = "rollback"
    SAVE_AND_STOP = "save_and_stop"
    STOP = "stop"

    @property
    def level(self) -> int:
        return _LEVEL[self]

    @classmethod
    def from_level(cls, level: int) -> "Action":
        return _BY_LEVEL[level]

    @property
    def stops_training(self) -> bool:
        return self.level >= Action.ROLLBACK.level


_LEVEL = {
    Action.CONTINUE: 0,
    Action.SKIP_STEP: 1,
    Action.ROLLBACK: 2,
    Action.SAVE_AND_STOP: 3,
    Action.STOP: 4,
}
_BY_LEVEL = {level: action for action, level in _LEVEL.items()}


def strongest(*actions: Action) -> Action:
    """The action that changes training the most; ranks agree on it with an all-reduce MAX."""
    return max(actions, key=lambda a: a.level, default=Action.CONTINUE)


class HarnessStop(Exception):
    """Raised by a plugin that must stop training now; the only exception isolation lets through."""
