"""``harness wrap -- COMMAND``: run an unmodified training command with the harness attached.

The config travels by environment (``HARNESS_CONFIG``, ``HARNESS_PLUGINS``,
``HARNESS_ONLY``, ``HARNESS_WRAP=1``, ``PYTHONPATH``) to every process the command starts,
including those spawned by torchrun, deepspeed and accelerate launch (and
once more inside ``PYTHON_HARNESS_SETTINGS``, which DeepSpeed's multi-node
launcher forwards to remote nodes). The command runs in its own process
group; SIGINT and SIGTERM sent to wrap (Ctrl-C, a scheduler's preemption
notice) are passed on to the command (torchrun and accelerate pass them on to
their workers), and wrap then waits for the command to end: the
``preemption`` plugin turns the SIGTERM into a checkpoint and a stop. When
the command ends of it while processes of its group still run (a shell script
that ran python as a child), the signal goes on to that group, and wrap waits
for it too. Data-loader workers are never signalled by wrap: under ``spawn``
or ``forkserver`` they would die of it and crash the training they serve.

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
import stat
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Callable, Sequence

from harness.core.terminal_text import terminal_text
from harness.launch.autoattach import CARRIER_ENV, SITE_DIR, WRAP_ENV
from harness.core.config import CONFIG_ENV, ONLY_ENV, PLUGINS_ENV, Catalog, effective_selection, load_config, read_config_text
from harness.core.console import QUIET_ENV, quiet_from_env
from harness.core.errors import ConfigError, HarnessError
from harness.launch.light_imports import heavy_imports_deferred
from harness.lib.stops import STOP_DIR_ENV, read_markers, wrap_summary, wrapped_exit_status
from harness.lib.wrapped_runs import read_run_markers_since


GROUP_DRAIN_S = 600.0  # after a forwarded signal, how long wrap waits for the rest of the command's process group


def wrap_environment(
    config: str | None, plugins: Sequence[str], base: dict[str, str] | None = None, stop_dir: str | None = None,
    only: Sequence[str] | None = None,
) -> dict[str, str]:
    """The environment that makes every Python process of the job attach the harness (and report a stop into ``stop_dir``)."""
    env = dict(os.environ if base is None else base)
    if stop_dir:
        env[STOP_DIR_ENV] = stop_dir
    env[WRAP_ENV] = "1"
    paths = [str(SITE_DIR)] + [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p]
    env["PYTHONPATH"] = os.pathsep.join(paths)
    for inherited in (CONFIG_ENV, PLUGINS_ENV, ONLY_ENV):  # the job gets exactly the selection given here (see validate)
        env.pop(inherited, None)
    if config:
        env[CONFIG_ENV] = str(Path(config).resolve())
    if plugins:
        env[PLUGINS_ENV] = ",".join(plugins)
    if only is not None:
        env[ONLY_ENV] = ",".join(only)
    carried = (WRAP_ENV, CONFIG_ENV, PLUGINS_ENV, ONLY_ENV, STOP_DIR_ENV, QUIET_ENV)
    env[CARRIER_ENV] = json.dumps({k: env[k] for k in carried if k in env})
    return env


def config_for_job(config: str | None, folder: str) -> str | None:
    """The config file the job reads: ``config`` itself, or, for a pipe (``--config <(envsubst < t.yaml)``), which can be
    read only once, a private copy of what it carried, in ``folder``."""
    try:
        regular = not config or stat.S_ISREG(os.stat(config).st_mode)
    except OSError:
        regular = True  # missing or unreadable: validation says so, naming it
    if regular:
        return config
    copy = Path(folder) / "config.yaml"
    copy.write_text(read_config_text(config), encoding="utf-8")
    return str(copy)


def validate(config: str | None, plugins: Sequence[str], only: Sequence[str] | None = None, source: str | None = None) -> None:
    """Fail before the job starts (and before it allocates anything) if the config is wrong.

    The plugins' modules are imported with torch and the other frameworks deferred
    (:mod:`harness.launch.light_imports`): checking options needs none of them, and
    loading torch here would delay the user's command by seconds.
    """
    with heavy_imports_deferred():
        resolved = load_config(config if config else {}, Catalog.build(), extra_plugins=list(plugins),
                               only=list(only) if only is not None else None, source=source)
    for note in resolved.notes:
        sys.stderr.write(f"harness wrap: note: {note}.\n")


def run_wrapped(command: Sequence[str], config: str | None = None, plugins: Sequence[str] = (), quiet: bool = False,
                only: Sequence[str] | None = None) -> int:
    """Validate, then run ``command``; its exit status (128+N when killed by signal N), or 75 after a harness stop.

    Then the closing summary on stderr (:mod:`harness.launch.summary`), unless ``quiet`` (``--quiet``, which also
    silences the live console lines of the job) or ``HARNESS_QUIET=1``.
    """
    if not command:
        raise HarnessError("harness wrap needs a command after '--', e.g. `harness wrap -- python train.py`.")
    selection = effective_selection(config, plugins, only)  # the flags, else what the shell's environment sets
    for note in selection.notes:
        sys.stderr.write(f"harness wrap: note: {note}.\n")
    config, plugins, only = selection.config, selection.plugins, selection.only
    stop_dir = tempfile.mkdtemp(prefix="harness-wrap-")  # private (0700): the job's stop markers, read after it ends
    try:
        try:
            given, config = config, config_for_job(config, stop_dir)
            validate(config, plugins, only, source=given)
        except ConfigError as exc:
            if selection.from_env:  # say where a value the user did not type here came from
                raise ConfigError([*exc.problems, f"(The selection came from the environment: {', '.join(selection.from_env)}.)"]) from None
            raise
        base = {**os.environ, QUIET_ENV: "1"} if quiet else None
        status = _run(command, wrap_environment(config, plugins, base=base, stop_dir=stop_dir, only=only))
        stops = [n for n in read_markers(stop_dir) if n.ends_training]
        runs = read_run_markers_since(stop_dir)
    finally:
        shutil.rmtree(stop_dir, ignore_errors=True)
    returned = wrapped_exit_status(status, stops)
    if stops:
        sys.stderr.write(wrap_summary(stops, status, returned))
    if not (quiet or quiet_from_env()):
        _print_summary(runs)
    return returned


def _print_summary(runs: dict[Path, float | None]) -> None:
    """The closing summary on stderr; never changes wrap's exit status."""
    from harness.launch.summary import closing_summary

    try:
        sys.stderr.write(terminal_text(closing_summary(runs)))  # finding messages and errors of the run: data, shown inert
        sys.stderr.flush()
    except (OSError, ValueError):  # stderr closed or gone
        pass


def _run(command: Sequence[str], env: dict[str, str]) -> int:
    """Start the command in its own process group, pass SIGINT/SIGTERM on to that group, wait; its exit status.

    128+N when killed by signal N. The group is the command's own
    (``start_new_session``), so a signal forwarded to it never comes back to
    wrap, and Ctrl-C reaches the command once, through wrap, not twice. On
    Linux the command is killed when wrap dies (``kill -9`` of wrap, as of
    wrap's old group, still ends the command rather than orphaning it).
    """
    try:
        child = subprocess.Popen(list(command), env=env, start_new_session=True,
                                 preexec_fn=_die_with_parent(os.getpid()) if sys.platform.startswith("linux") else None)
    except FileNotFoundError:
        raise HarnessError(f"harness wrap: command not found: '{command[0]}'. Fix: check the command after '--' and your PATH.") from None

    forwarded: list[int] = []

    def forward(signum: int, _frame: object) -> None:
        forwarded.append(signum)
        child.send_signal(signum)

    previous = {sig: signal.signal(sig, forward) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        code = child.wait()
        if forwarded and _group_alive(child.pid):  # a shell the signal ended left its python child running: tell it, wait
            try:
                os.killpg(child.pid, forwarded[-1])
            except (ProcessLookupError, PermissionError):  # gone already, or a member we may not signal
                pass
            _wait_for_group(child.pid, GROUP_DRAIN_S)
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    return 128 - code if code < 0 else code


def _wait_for_group(pgid: int, timeout: float) -> None:
    """Until no process is left in the process group ``pgid`` (the command's), at most ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and _group_alive(pgid):
        time.sleep(0.1)


def _group_alive(pgid: int) -> bool:
    """Whether a process of group ``pgid`` still runs (zombies, which a container's init may never reap, do not count)."""
    proc = Path("/proc")
    if not proc.is_dir():
        try:
            os.killpg(pgid, 0)
        except ProcessLookupError:
            return False
        except PermissionError:
            pass
        return True
    for entry in proc.iterdir():
        if not entry.name.isdigit():
            continue
        try:
            fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
        except (OSError, IndexError):
            continue
        if len(fields) > 2 and fields[0] != "Z" and fields[2] == str(pgid):
            return True
    return False


def _die_with_parent(parent: int) -> "Callable[[], None]":
    """For the child, between fork and exec: SIGKILL when wrap ends (``PR_SET_PDEATHSIG``); best effort."""

    def arm() -> None:
        try:
            import ctypes

            ctypes.CDLL(None, use_errno=True).prctl(1, int(signal.SIGKILL), 0, 0, 0)  # PR_SET_PDEATHSIG = 1
        except Exception:  # noqa: BLE001 - without it the command merely outlives a killed wrap
            return
        if os.getppid() != parent:  # wrap died before the request took effect
            os._exit(128 + int(signal.SIGKILL))

    return arm
