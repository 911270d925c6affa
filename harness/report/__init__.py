"""The run report: ``report.md`` and a self-contained ``report.html`` in the run directory.

Written by rank 0 at the end of every ``train()`` call (also after a crash or
a stop) and rebuilt at any time from the run directory alone with
``harness report <output_dir>``, which is how a run killed with ``kill -9``
gets its report.
"""
from __future__ import annotations

import os
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from harness.playbook import playbook_dir
from harness.report.build import build_report
from harness.report.html import render_html
from harness.report.markdown import PLAYBOOKS_DIR, PLOTS_DIR, render_markdown
from harness.report.model import Report, ReportSection
from harness.report.record import RunRecord
from harness.runinfo import read_run_info

__all__ = ["Report", "ReportFiles", "ReportSection", "RunRecord", "find_run_dirs", "write_report"]


@dataclass(frozen=True)
class ReportFiles:
    markdown: Path
    html: Path
    report: Report


def write_report(run_dir: Path, manager: Any = None, resolved: Any = None, plots: bool = True) -> ReportFiles:
    """Build and write the report of ``run_dir`` (``<output_dir>/harness``).

    ``manager``/``resolved`` are the live run's plugin manager and config; when
    None (``harness report``) the plugins are rebuilt from the run's config.yaml.
    """
    run_dir = Path(run_dir)
    record = RunRecord.load(run_dir)
    if manager is None:
        manager, resolved = offline_plugins(run_dir)
    report = build_report(record, lambda run: collect_sections(run, manager, resolved), plots=plots)
    assets = run_dir / "report"
    if assets.exists():
        shutil.rmtree(assets / "plots", ignore_errors=True)
    (run_dir / PLOTS_DIR).mkdir(parents=True, exist_ok=True)
    for plot in report.plots:
        (run_dir / PLOTS_DIR / f"{plot.name}.png").write_bytes(plot.png)
    _copy_playbooks(run_dir / PLAYBOOKS_DIR)
    markdown, html = run_dir / "report.md", run_dir / "report.html"
    _write_atomic(markdown, render_markdown(report))
    _write_atomic(html, render_html(report))
    return ReportFiles(markdown, html, report)


def collect_sections(run: RunRecord, manager: Any, resolved: Any) -> tuple[list[ReportSection], list[str]]:
    """Every plugin's ``report_sections``; a failing plugin costs its section, noted, never the report."""
    sections: list[ReportSection] = []
    notes: list[str] = []
    for name in manager.names:
        options = resolved.options_for(name) if resolved is not None else None
        try:  # not through the training isolation: a failed section must not count against the plugin's error budget
            result = manager.call_plugin_unisolated(name, "report_sections", run=run, options=options)
        except Exception as exc:  # noqa: BLE001
            notes.append(f"plugin '{name}' failed in report_sections: {type(exc).__name__}: {exc}")
            continue
        for section in result if isinstance(result, (list, tuple)) else [result] if result is not None else []:
            if isinstance(section, ReportSection):
                sections.append(section if section.plugin else ReportSection(section.title, section.markdown, name))
            else:
                notes.append(f"plugin '{name}' returned {type(section).__name__} from report_sections; expected ReportSection.")
    return sections, notes


def offline_plugins(run_dir: Path) -> tuple[Any, Any]:
    """The run's plugins, rebuilt from its config.yaml (those that are not installed here are left out)."""
    from harness.config import CORE_KEYS, Catalog, read_yaml, resolve_config
    from harness.errors import HarnessError
    from harness.manager import HarnessPluginManager

    catalog = Catalog.build()
    try:
        data = read_yaml(run_dir / "config.yaml") if (run_dir / "config.yaml").exists() else {}
    except HarnessError:
        data = {}
    classes = read_run_info(run_dir).get("plugin_classes") or {}
    for name in data.get("plugins") or []:
        if name not in catalog.entries and isinstance(classes.get(name), str):
            try:  # a plugin the run was given as an object or a path: importable here?
                catalog.add(classes[name])
            except Exception:  # noqa: BLE001 - not importable here: its section is left out
                pass
    known = {k: v for k, v in data.items() if k in CORE_KEYS or k in catalog.entries}
    if isinstance(known.get("plugins"), list):
        known["plugins"] = [p for p in known["plugins"] if p in catalog.entries]
    for key in ("severity", "policy"):
        if isinstance(known.get(key), dict):
            known[key] = {c: v for c, v in known[key].items() if c in catalog.codes}
    try:
        resolved = resolve_config(known, catalog, str(run_dir / "config.yaml"))
    except HarnessError:
        resolved = resolve_config({}, catalog, "<defaults>")
    manager = HarnessPluginManager()
    for name in resolved.enabled:
        manager.register(catalog.entries[name])
    return manager, resolved


def find_run_dirs(path: Path) -> list[Path]:
    """Run directories at or below ``path``: ``path/harness``, or ``path`` itself, and nested runs (depth 3)."""
    path = Path(path)
    found: list[Path] = []
    for candidate in [path, path / "harness"]:
        if (candidate / "findings.jsonl").exists() or (candidate / "run.json").exists() or (candidate / "config.yaml").exists() and candidate.name == "harness":
            found.append(candidate)
            break
    for depth in ("*/harness", "*/*/harness", "*/*/*/harness"):
        for candidate in sorted(path.glob(depth)):
            is_run = (candidate / "findings.jsonl").exists() or (candidate / "run.json").exists()  # not any folder named harness
            if is_run and candidate not in found and "checkpoint-" not in str(candidate.relative_to(path)):
                found.append(candidate)
    return found


def _copy_playbooks(target: Path) -> None:
    target.mkdir(parents=True, exist_ok=True)
    for source in playbook_dir().glob("*.md"):
        shutil.copyfile(source, target / source.name)


def _write_atomic(path: Path, text: str) -> None:
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(text, encoding="utf-8")
    os.replace(tmp, path)
