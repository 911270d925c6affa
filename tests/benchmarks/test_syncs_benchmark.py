"""benchmarks/syncs.py: the harness's host syncs per ordinary optimizer step stay at the budget of one (DESIGN.md).

A count, not a timing: every read of a tensor's value from harness code on the training thread, with the model's
tensors read as a device run reads them. A second read per step anywhere in the harness fails this test.
"""
from __future__ import annotations

import re
import subprocess
import sys

import pytest

from conftest import REPO

pytestmark = pytest.mark.slow


def test_an_ordinary_step_costs_at_most_one_host_sync() -> None:
    result = subprocess.run([sys.executable, str(REPO / "benchmarks" / "syncs.py"), "--steps", "6"], cwd=REPO,
                            capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    found = re.search(r"ordinary steps \(2\.\.6\): median (\d+), max (\d+)", result.stdout)
    assert found, result.stdout[-3000:]
    assert int(found.group(2)) <= 1, result.stdout[-3000:]
