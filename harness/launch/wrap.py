"""``harness wrap -- COMMAND``: run an unmodified training command with the harness attached.

The config travels by environment (``HARNESS_CONFIG``, ``HARNESS_PLUGINS``,
``HARNESS_WRAP=1``, ``PYTHONPATH``) to every process the command starts,
including those spawned by torchrun, deepspeed and accelerate launch (and
once more inside ``PYTHON_HARNESS_SETTINGS``, which DeepSpeed's multi-node
launcher forwards to remote nodes). SIGTERM is passed on, Ctrl-C reaches it
through the terminal.

The command's exit status is returned unchanged, except when the harness
stopped training: the processes leave a marker in a private directory named
by ``HARNESS_STOP_DIR`` (:mod:`harness.lib.stops`), and wrap then exits 75 if
the command exited 0 anyway (or 1 from an uncaught ``HarnessStopped``); see
:func:`harness.lib.stops.wrapped_exit_status` for the whole rule.
"""
from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Sequence

from harness.launch.autoattach import CARRIER_ENV, SITE_DIR, WRAP_ENV
from harness.core.config import CONFIG_ENV, PLUGINS_ENV, Catalog, load_config
from harness.core.errors import HarnessError
from harness.launch.light_imports import heavy_imports_deferred
from harness.lib.stops import STOP_DIR_ENV, read_markers, wrap_summary, wrapped_exit_status


def wrap_environment(
    config: str | None, plugins: Sequence[str], base: dict[str, str] | None = None, stop_dir: str | None = None
) -> dict[str, str]:
    """The environment that makes every Python process of the job attach the harness (and report a stop into ``stop_dir``)."""
    env = dict(os.environ if base is None else base)
    if stop_dir:
        env[STOP_DIR_ENV] = stop_dir
    env[WRAP_ENV] = "1"
    paths = [str(SITE_DIR)] + [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p]
    env["PYTHONPATH"] = os.pathsep.join(paths)
    if config:
        env[CONFIG_ENV] = str(Path(config).resolve())
    if plugins:
        env[PLUGINS_ENV] = ",".join(plugins)
    env[CARRIER_ENV] = json.dumps({k: env[k] for k in (WRAP_ENV, CONFIG_ENV, PLUGINS_ENV, STOP_DIR_ENV) if k in env})
    return env


def validate(config: str | None, plugins: Sequence[str]) -> None:
    """Fail before the job starts (and before it allocates anything) if the config is wrong.

    The plugins' modules are imported with torch and the other frameworks deferred
    (:mod:`harness.launch.light_imports`): checking options needs none of them, and
    loading torch here would delay the user's command by seconds.
    """
    with heavy_imports_deferred():
        load_config(config if config else {}, Catalog.build(), extra_plugins=list(plugins))


def run_wrapped(command: Sequence[str], config: str | None = None, plugins: Sequence[str] = ()) -> int:
    """Validate, then run ``command``; its exit status (128+N when killed by signal N), or 75 after a harness stop."""
    if not command:
        raise HarnessError("harness wrap needs a command after '--', e.g. `harness wrap -- python train.py`.")
    validate(config, plugins)
    stop_dir = tempfile.mkdtemp(prefix="harness-wrap-")  # private (0700): the job's stop markers, read after it ends
    try:
        status = _run(command, wrap_environment(config, plugins, stop_dir=stop_dir))
        stops = [n for n in read_markers(stop_dir) if n.ends_training]
    finally:
        shutil.rmtree(stop_dir, ignore_errors=True)
    returned = wrapped_exit_status(status, stops)
    if stops:
        sys.stderr.write(wrap_summary(stops, status, returned))
    return returned


def _run(command: Sequence[str], env: dict[str, str]) -> int:
    """Start the command, pass SIGTERM on, wait; its exit status (128+N when killed by signal N)."""
    try:
        child = subprocess.Popen(list(command), env=env)
    except FileNotFoundError:
        raise HarnessError(f"harness wrap: command not found: '{command[0]}'. Fix: check the command after '--' and your PATH.") from None

    def forward(signum: int, _frame: object) -> None:
        child.send_signal(signum)

    # Ctrl-C already reaches the child through the shared process group: forwarding it too would
    # interrupt the child's own clean-up (on_run_end). SIGTERM, sent to us alone, is passed on.
    previous = {signal.SIGINT: signal.signal(signal.SIGINT, lambda *_: None), signal.SIGTERM: signal.signal(signal.SIGTERM, forward)}
    try:
        code = child.wait()
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    return 128 - code if code < 0 else code
