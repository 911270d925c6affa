"""``harness report``: rebuild a run's report from its run directory alone (also after ``kill -9``).

The report package takes a sections provider and never builds plugins; this
command is where the plugins of a finished run are rebuilt: catalog, config
and plugin manager, from the run's ``config.yaml``. Only plugins installed
here are used: the built-in ones and the user's own entry-point plugins. A
run directory is data: a ``module:Class`` path it names (config.yaml's
``plugins``, run.json's ``plugin_classes``) is shown in a note, never
imported, so unpacking a run and reporting on it runs no code from it.
"""
from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Any

from harness.core.catalog import Catalog
from harness.core.config import resolve_config
from harness.core.errors import HarnessError, RunDirNotWritableError
from harness.core.terminal_text import terminal_text
from harness.core.manager import HarnessPluginManager
from harness.core.options import CORE_KEYS, ResolvedConfig
from harness.lib.runinfo import read_run_info
from harness.lib.safe_paths import UnsafePathError
from harness.report import write_report
from harness.report.model import ReportSection
from harness.report.provider import PluginSections
from harness.report.record import RunRecord, read_run_config
from harness.tools.explain import scan_or_fail


class OfflineSections:
    """The sections of a finished run's plugins, rebuilt here on first use (after the report's path checks)."""

    def __init__(self, run_dir: Path) -> None:
        self.run_dir = Path(run_dir)

    def sections(self, run: RunRecord) -> tuple[list[ReportSection], list[str]]:
        manager, resolved, notes = offline_plugins(self.run_dir)
        return PluginSections(manager, resolved, notes).sections(run)


def offline_plugins(run_dir: Path) -> tuple[HarnessPluginManager, ResolvedConfig, list[str]]:
    """The run's plugins, rebuilt from its config.yaml: (manager, resolved config, notes on what was left out)."""
    catalog = Catalog.build()
    data, _ = read_run_config(run_dir)  # damaged values are already noted by RunRecord.load
    classes = read_run_info(run_dir).get("plugin_classes")
    classes = classes if isinstance(classes, dict) else {}
    listed = [p for p in data.get("plugins") or [] if p != "defaults"]
    notes = [_left_out(name, classes.get(name)) for name in listed if name not in catalog.entries]
    known = _known_options(data, listed, catalog)
    source = str(run_dir / "config.yaml")
    resolved = None
    for attempt in (known, {"plugins": known["plugins"]} if "plugins" in known else None, {}):
        if attempt is None:
            continue
        try:
            resolved = resolve_config(attempt, catalog, source if attempt else "<defaults>")
            break
        except HarnessError as exc:
            notes.append(f"config.yaml's options could not be used here ({' '.join(str(exc).split())[:300]}): "
                         + ("the plugins run with their default options." if attempt is known else "the default plugins are used."))
    assert resolved is not None  # {} always resolves
    manager = HarnessPluginManager()
    for name in resolved.enabled:
        manager.register(catalog.entries[name])
    return manager, resolved, notes


def _left_out(name: str, path: Any) -> str:
    """The note for a plugin the run used that is not installed here (a class path is never imported)."""
    if ":" in name:
        return (f"plugin {name!r} is a class path from the run's config.yaml; classes a run directory names are "
                "never imported offline: its section is left out.")
    if isinstance(path, str):
        return (f"plugin {name!r} ({path}) is not installed here: its section is left out "
                "(a class path from a run directory is never imported).")
    return f"plugin {name!r} is not installed here: its section is left out."


def _known_options(data: dict[str, Any], listed: list[Any], catalog: Catalog) -> dict[str, Any]:
    """config.yaml reduced to what this catalog knows: core options, installed plugins, declared codes."""
    known = {k: v for k, v in data.items() if k in CORE_KEYS or k in catalog.entries}
    if "plugins" in known:
        known["plugins"] = [p for p in listed if p in catalog.entries]
    if "disable" in known:
        disable = known["disable"] if isinstance(known["disable"], list) else []
        known["disable"] = [p for p in disable if isinstance(p, str) and p in catalog.entries]
    for key in ("severity", "policy"):
        if isinstance(known.get(key), dict):
            known[key] = {c: v for c, v in known[key].items() if c in catalog.codes}
    return known


def print_report(path: Path, plots: bool, out: Path | None = None) -> int:
    """Rebuild the report of every run under ``path`` (or write them under ``out``); print where it went and the verdict.

    Exit status 2 when a run could not be rebuilt: a write target in it is a symlink, or it cannot be written (the
    other runs are still rebuilt). A symlink met while searching for runs is only a note on stderr.
    """
    found, _ = scan_or_fail(path)  # links met on the way are notes there
    targets: dict[Path, Path | None] = {}
    for run_dir in found:
        if out is None:
            targets[run_dir] = None
            for folder in (run_dir, run_dir / "report"):
                if folder.is_dir() and not folder.is_symlink() and not os.access(folder, os.W_OK):
                    raise RunDirNotWritableError(
                        f"the run directory '{folder}' is not writable here, so its report cannot be rebuilt in place. "
                        f"Fix: write it elsewhere with `harness report {path} --out DIR` (the run directory is left untouched)."
                    )
        else:
            inside = run_dir.relative_to(path) if run_dir.is_relative_to(path) else Path(run_dir.name)
            targets[run_dir] = out if len(found) == 1 else out / inside
    refused = False
    for run_dir, target in targets.items():
        try:
            files = write_report(run_dir, plots=plots, out_dir=target, sections=OfflineSections(run_dir))
        except (UnsafePathError, RunDirNotWritableError) as exc:
            sys.stderr.write(f"harness: {run_dir}: {exc}\n")
            refused = True
            continue
        print(terminal_text(f"{run_dir}: {files.report.verdict.line()}"))  # the verdict quotes the run's error: data
        print(f"  {files.html}\n  {files.markdown}")
        for note in files.report.notes:
            print(terminal_text(f"  note: {note}"))
    return 2 if refused else 0
