"""HarnessStopped carries the stop's facts and survives the pickling that process pools and launchers do."""
from __future__ import annotations

import pickle

from harness.core.errors import HarnessError, HarnessStopped


def test_harness_stopped_round_trips_through_pickle_with_its_fields() -> None:
    stopped = HarnessStopped(11, "/runs/x", ("RESUME_DATA_POSITION",), attempt=2, action="stop")
    again = pickle.loads(pickle.dumps(stopped))
    assert isinstance(again, HarnessStopped) and isinstance(again, HarnessError)
    assert (again.step, again.output_dir, again.codes, again.code, again.attempt, again.action) == (
        11, "/runs/x", ("RESUME_DATA_POSITION",), "RESUME_DATA_POSITION", 2, "stop")
    assert str(again) == str(stopped) and "harness explain /runs/x" in str(again)
