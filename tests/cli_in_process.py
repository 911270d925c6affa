"""`harness <command>` through the CLI's own entry point in the test's process.

A subprocess per call pays a second or more of start-up (more for commands that import torch and transformers,
such as ``replay``) for nothing a test checks: ``python -m harness.cli`` only does ``raise SystemExit(main())``,
and an uncaught exception fails the test here as a traceback would there. The environment variables ``main``
sets (the network opt-outs of :mod:`harness.core.offline`) are put back after the test, so no later test sees them.
"""
from __future__ import annotations

import os
from typing import Any, NamedTuple

import pytest

from harness.core.offline import HUB_OFFLINE, TELEMETRY_OFF


class CliResult(NamedTuple):
    returncode: int
    stdout: str
    stderr: str


def harness_in_process(capsys: Any, monkeypatch: pytest.MonkeyPatch, *args: str) -> CliResult:
    """Run ``harness ARGS`` in this process; its exit status and what it printed (output printed before is dropped)."""
    from harness.cli import main

    for key in (*TELEMETRY_OFF, *HUB_OFFLINE):
        if key in os.environ:
            monkeypatch.setenv(key, os.environ[key])  # restored to this value after the test
        else:
            monkeypatch.setenv(key, "")
            monkeypatch.delenv(key)  # absent again after the test, whatever main() sets
    capsys.readouterr()
    code = main(list(args))
    printed = capsys.readouterr()
    return CliResult(int(code), printed.out, printed.err)
