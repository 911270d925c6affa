"""harness.lib.signals: names checked, the handler only notes the signal and chains, restore leaves others' handlers alone."""
from __future__ import annotations

import os
import signal
import threading
from typing import Any

import pytest

from harness.lib.signals import SignalFlag, signal_name, signal_number


@pytest.mark.parametrize("name", ["SIGUSR1", "usr1", "USR1", str(int(signal.SIGUSR1))])
def test_signal_names_in_every_spelling(name: str) -> None:
    assert signal_number(name) == signal.SIGUSR1 and signal_name(signal_number(name)) == "SIGUSR1"


def test_uncatchable_and_unknown_names_are_refused_with_the_reason() -> None:
    with pytest.raises(ValueError, match="cannot be caught"):
        signal_number("KILL")
    with pytest.raises(ValueError, match="valid names: .*SIGTERM"):
        signal_number("SIGTREM")


def test_the_handler_notes_the_first_signal_chains_and_restore_puts_the_old_handler_back() -> None:
    calls: list[int] = []

    def own(signum: int, frame: Any) -> None:
        calls.append(signum)

    before = signal.signal(signal.SIGUSR2, own)
    try:
        flag = SignalFlag(step=lambda: 7)
        assert flag.install([signal.SIGUSR2]) is None and flag.installed == [signal.SIGUSR2]
        os.kill(os.getpid(), signal.SIGUSR2)
        os.kill(os.getpid(), signal.SIGUSR2)
        assert flag.received is not None and flag.received.signum == signal.SIGUSR2
        assert flag.received.step == 7 and flag.received.count == 2 and calls == [signal.SIGUSR2] * 2
        flag.restore()
        assert signal.getsignal(signal.SIGUSR2) is own and flag.installed == []
    finally:
        signal.signal(signal.SIGUSR2, before)


def test_restore_keeps_a_handler_installed_after_ours() -> None:
    before = signal.getsignal(signal.SIGUSR2)
    try:
        flag = SignalFlag()
        flag.install([signal.SIGUSR2])
        later = signal.signal(signal.SIGUSR2, signal.SIG_IGN)  # someone replaced ours during the run
        assert later == flag._handle
        flag.restore()
        assert signal.getsignal(signal.SIGUSR2) == signal.SIG_IGN
    finally:
        signal.signal(signal.SIGUSR2, before)


def test_off_the_main_thread_nothing_is_installed_and_the_reason_is_given() -> None:
    answer: list[str | None] = []
    flag = SignalFlag()
    worker = threading.Thread(target=lambda: answer.append(flag.install([signal.SIGUSR2])))
    worker.start()
    worker.join()
    assert answer[0] is not None and "main thread" in answer[0] and flag.installed == []


def test_a_switched_off_flag_hands_the_signal_back_to_the_previous_handler() -> None:
    """The plugin was disabled (no run end will restore): the next signal goes to the old handler, which is reinstalled."""
    calls: list[int] = []

    def own(signum: int, frame: Any) -> None:
        calls.append(signum)

    before = signal.signal(signal.SIGUSR2, own)
    try:
        active = [True]
        flag = SignalFlag(active=lambda: active[0])
        flag.install([signal.SIGUSR2])
        active[0] = False
        os.kill(os.getpid(), signal.SIGUSR2)
        assert flag.received is None and calls == [signal.SIGUSR2] and signal.getsignal(signal.SIGUSR2) is own
    finally:
        signal.signal(signal.SIGUSR2, before)
