"""The one ``TrainerCallback`` the harness adds: Trainer events, forwarded to the bridge."""
from __future__ import annotations

from typing import Any, Protocol

from transformers import TrainerCallback


class TrainerEvents(Protocol):
    """What the callback forwards to (the :class:`~harness.hf.bridge.Bridge`)."""

    def train_begin(self) -> None: ...
    def step_begin(self) -> None: ...
    def step_end(self, state: Any, control: Any) -> Any: ...
    def log(self, state: Any, logs: dict[str, float]) -> None: ...
    def evaluate(self, state: Any, metrics: dict[str, float]) -> None: ...
    def save(self, state: Any) -> None: ...
    def train_end(self) -> None: ...


class HarnessCallback(TrainerCallback):
    """Forwards Trainer events to the bridge; the only way back is ``control`` (save, stop)."""

    def __init__(self, bridge: TrainerEvents) -> None:
        self.bridge = bridge

    def on_train_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> Any:
        self.bridge.train_begin()
        return control

    def on_step_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> Any:
        self.bridge.step_begin()
        return control

    def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> Any:
        return self.bridge.step_end(state, control)

    def on_log(self, args: Any, state: Any, control: Any, logs: dict[str, float] | None = None, **kwargs: Any) -> Any:
        self.bridge.log(state, logs or {})
        return control

    def on_evaluate(self, args: Any, state: Any, control: Any, metrics: dict[str, float] | None = None, **kwargs: Any) -> Any:
        self.bridge.evaluate(state, metrics or {})
        return control

    def on_save(self, args: Any, state: Any, control: Any, **kwargs: Any) -> Any:
        self.bridge.save(state)
        return control

    def on_train_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> Any:
        self.bridge.train_end()
        return control
