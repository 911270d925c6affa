"""``harness wrap -- COMMAND``: run an unmodified training command with the harness attached.

The config travels by environment (``HARNESS_CONFIG``, ``HARNESS_PLUGINS``,
``HARNESS_WRAP=1``, ``PYTHONPATH``) to every process the command starts,
including those spawned by torchrun, deepspeed and accelerate launch (and
once more inside ``PYTHON_HARNESS_SETTINGS``, which DeepSpeed's multi-node
launcher forwards to remote nodes). The command's exit status is returned
unchanged; SIGTERM is passed on, Ctrl-C reaches it through the terminal.
"""
from __future__ import annotations

import json
import os
import signal
import subprocess
from pathlib import Path
from typing import Sequence

from harness.launch.autoattach import CARRIER_ENV, SITE_DIR, WRAP_ENV
from harness.core.config import CONFIG_ENV, PLUGINS_ENV, Catalog, load_config
from harness.core.errors import HarnessError


def wrap_environment(config: str | None, plugins: Sequence[str], base: dict[str, str] | None = None) -> dict[str, str]:
    """The environment that makes every Python process of the job attach the harness."""
    env = dict(os.environ if base is None else base)
    env[WRAP_ENV] = "1"
    paths = [str(SITE_DIR)] + [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p]
    env["PYTHONPATH"] = os.pathsep.join(paths)
    if config:
        env[CONFIG_ENV] = str(Path(config).resolve())
    if plugins:
        env[PLUGINS_ENV] = ",".join(plugins)
    env[CARRIER_ENV] = json.dumps({k: env[k] for k in (WRAP_ENV, CONFIG_ENV, PLUGINS_ENV) if k in env})
    return env


def validate(config: str | None, plugins: Sequence[str]) -> None:
    """Fail before the job starts (and before it allocates anything) if the config is wrong."""
    load_config(config if config else {}, Catalog.build(), extra_plugins=list(plugins))


def run_wrapped(command: Sequence[str], config: str | None = None, plugins: Sequence[str] = ()) -> int:
    """Validate, then run ``command``; return its exit status (128+N when killed by signal N)."""
    if not command:
        raise HarnessError("harness wrap needs a command after '--', e.g. `harness wrap -- python train.py`.")
    validate(config, plugins)
    env = wrap_environment(config, plugins)
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
