"""Every file the harness writes into a run directory is strict JSON: no writer calls ``json.dumps`` (which writes bare
``NaN``/``Infinity``) but through :func:`harness.core.strictjson.dumps`, except the sites listed here with the reason.

A new ``json.dumps`` in harness/, plugins/ or stages/ fails this test until it goes through ``dumps`` or is listed.
"""
from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

ALLOWED = {  # path -> why its json.dumps is not a run-directory record that can hold a float
    "harness/core/strictjson.py": "the strict encoder itself",
    "harness/hf/checkpoint_state.py": "plugin states beside a checkpoint, read back by the plugins as they were given",
    "harness/tools/decontaminate.py": "the user's own output folder (--write-clean), counts and paths",
    "harness/tools/scan.py": "the scan's hits: ids, counts and strings",
    "harness/lib/records.py": "a text record's encoding (strings)",
    "harness/lib/rerun_exchange.py": "an in-memory manifest sent between ranks, never a file",
    "harness/lib/proven.py": "a checkpoint's proof marker: hashes and ints",
    "harness/lib/rundir.py": "the run lock: pid, host and time",
    "harness/lib/wrapped_runs.py": "the wrap marker: a path, a pid and a wall time",
    "harness/lib/tiny.py": "test data rows (token ids)",
    "harness/lib/checkpoints.py": "a checkpoint's completion marker: ints",
    "harness/launch/wrap.py": "environment variables handed to the child process",
    "plugins/mlflow/writer.py": "MLflow's run id file and parameter strings",
    "stages/demo/run.py": "the demo's generated data rows",
}


def test_no_writer_uses_plain_json_dumps_outside_the_listed_sites() -> None:
    found = {}
    for folder in ("harness", "plugins", "stages"):
        for path in sorted((ROOT / folder).rglob("*.py")):
            text = path.read_text(encoding="utf-8")
            if re.search(r"\bjson\.dumps\(", text):
                found[path.relative_to(ROOT).as_posix()] = True
    unexpected = sorted(set(found) - set(ALLOWED))
    assert not unexpected, (
        f"plain json.dumps in {unexpected}: write run-directory files through harness.core.strictjson.dumps "
        "(non-finite numbers as \"nan\"/\"inf\"), or list the site here with the reason it cannot hold a float")
    stale = sorted(set(ALLOWED) - set(found))
    assert not stale, f"listed but no longer calling json.dumps: {stale}"
