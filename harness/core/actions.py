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

    # plain attributes of each member, set below: read on the training thread every step, where an enum property (and the
    # enum's Python-level hash behind a dict lookup) costs microseconds
    level: int  # the order ranks agree by (the strongest wins)
    stops_training: bool  # rollback, save_and_stop, stop

    @classmethod
    def from_level(cls, level: int) -> "Action":
        return _BY_LEVEL[level]


_BY_LEVEL = dict(enumerate(Action))  # declaration order is the level order
for _level, _action in _BY_LEVEL.items():
    _action.level = _level
for _action in Action:
    _action.stops_training = _action.level >= Action.ROLLBACK.level
del _level, _action


def strongest(*actions: Action) -> Action:
    """The action that changes training the most; ranks agree on it with an all-reduce MAX."""
    return max(actions, key=lambda a: a.level, default=Action.CONTINUE)


class HarnessStop(Exception):
    """Raised by a plugin that must stop training now; the only exception isolation lets through."""
