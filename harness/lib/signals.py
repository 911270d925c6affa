"""A signal that only sets a flag: what a preemption notice (SIGTERM, SIGUSR1) may safely do inside a training loop.

A Python signal handler runs on the main thread between two bytecodes, in the
middle of whatever the Trainer was doing (a forward pass, an evaluation, a
``torch.save``), so it must not save or raise: it records the signal and
returns, and the step guard acts on it at a point every rank reaches. The
handler chains to a Python handler that was installed before (the user's
own, or HF's JIT checkpoint), and :meth:`SignalFlag.restore` puts the
previous handlers back unless someone replaced ours in the meantime. A flag
nobody will act on any more (its plugin was switched off, so no run end
restores it) hands each signal back to the previous handler, the default
action included: a SIGTERM still ends the process. Standard library only.
"""
from __future__ import annotations

import os
import signal
import threading
import time
from dataclasses import dataclass
from types import FrameType
from typing import Any, Callable, Iterable

UNCATCHABLE = ("SIGKILL", "SIGSTOP")


def signal_number(name: str) -> int:
    """``"SIGTERM"``, ``"TERM"`` or ``"15"`` as a signal number; ``ValueError`` with the valid names otherwise."""
    text = str(name).strip().upper()
    if text.isdigit():
        try:
            text = signal.Signals(int(text)).name
        except ValueError:
            text = f"signal {text}"
    if not text.startswith("SIG"):
        text = "SIG" + text
    catchable = sorted(s.name for s in signal.Signals if s.name not in UNCATCHABLE and not s.name.startswith("SIG_")
                       and s.name not in ("SIGCHLD", "SIGCLD"))
    if text in UNCATCHABLE:
        raise ValueError(f"{name!r} cannot be caught by any process (the kernel acts on it directly); use SIGTERM or SIGUSR1")
    if text not in catchable:
        raise ValueError(f"{name!r} is not a signal this platform can catch; valid names: {', '.join(catchable)}")
    return int(getattr(signal, text))


def signal_name(signum: int) -> str:
    try:
        return signal.Signals(signum).name
    except ValueError:
        return f"signal {signum}"


@dataclass
class Received:
    """The first signal that arrived: which, when (wall clock and monotonic), and at which step."""

    signum: int
    wall_time: float
    monotonic: float
    step: int
    count: int = 1


class SignalFlag:
    """Installs flag-setting handlers for some signals on the main thread; remembers the first arrival."""

    def __init__(self, step: Callable[[], int] = lambda: 0, active: Callable[[], bool] = lambda: True,
                 on_receive: Callable[[], None] = lambda: None) -> None:
        self._step = step
        self._active = active  # False once nobody will act on the flag (the plugin was switched off): hand the signal back
        self._on_receive = on_receive  # called once, at the first arrival (the plugin starts polling the flag then)
        self.received: Received | None = None
        self._previous: dict[int, Any] = {}

    @property
    def installed(self) -> list[int]:
        return sorted(self._previous)

    def install(self, signums: Iterable[int]) -> str | None:
        """Handle ``signums`` from now on; the reason when it cannot (not the main thread), else None."""
        if threading.current_thread() is not threading.main_thread():
            return "not on the main thread (Python delivers signals to the main thread only)"
        for signum in signums:
            if signum in self._previous:
                continue
            self._previous[signum] = signal.signal(signum, self._handle)
        return None

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        """The handler: note the signal, then call the previous Python handler, if there was one."""
        if not self._safe_active():
            self._hand_back(signum)
            return
        if self.received is None:
            self.received = Received(signum, time.time(), time.monotonic(), self._safe_step())
            try:
                self._on_receive()
            except Exception:  # noqa: BLE001 - a handler must never raise into the interrupted frame
                pass
        else:
            self.received.count += 1
        previous = self._previous.get(signum)
        if callable(previous) and previous is not self._handle and previous is not signal.default_int_handler:
            previous(signum, frame)  # not Python's SIGINT default: its KeyboardInterrupt would abort the save

    def _hand_back(self, signum: int) -> None:
        """Nobody acts on the flag any more: put the previous handler back and let it have this signal."""
        previous = self._previous.pop(signum, signal.SIG_DFL)
        signal.signal(signum, previous if previous is not None else signal.SIG_DFL)
        if callable(previous):
            previous(signum, None)
        elif previous == signal.SIG_DFL:
            os.kill(os.getpid(), signum)  # the default action (SIGTERM: end the process), as if we had never been there

    def _safe_active(self) -> bool:
        try:
            return bool(self._active())
        except Exception:  # noqa: BLE001 - a handler must never raise
            return True

    def _safe_step(self) -> int:
        try:
            return int(self._step())
        except Exception:  # noqa: BLE001 - a handler must never raise
            return -1

    def restore(self) -> None:
        """Put back the previous handlers (where ours is still the one installed); a no-op off the main thread."""
        if threading.current_thread() is not threading.main_thread():
            return
        for signum, previous in list(self._previous.items()):
            if signal.getsignal(signum) == self._handle:
                signal.signal(signum, previous if previous is not None else signal.SIG_DFL)
            del self._previous[signum]
