"""The run report: ``report.md`` and a self-contained ``report.html`` in the run directory.

Written by rank 0 at the end of every ``train()`` call (also after a crash or
a stop) and rebuilt at any time from the run directory alone with
``harness report <output_dir>``, which is how a run killed with ``kill -9``
gets its report.
"""
from __future__ import annotations

import json
import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import quote

from harness.errors import RunDirNotWritableError
from harness.playbook import playbook_dir
from harness.report.build import build_report
from harness.report.html import render_html
from harness.report.markdown import PLAYBOOKS_DIR, PLOTS_DIR, render_markdown
from harness.report.model import Report, ReportSection
from harness.report.record import RunRecord, read_run_config
from harness.runinfo import RUN_FILE, RUN_FORMAT, read_run_info
from harness.safe_paths import safe_mkdir, safe_rmtree, safe_target, safe_write_bytes, safe_write_text

__all__ = ["Report", "ReportFiles", "ReportSection", "RunRecord", "find_run_dirs", "is_run_dir", "scan_run_dirs", "write_report"]


@dataclass(frozen=True)
class ReportFiles:
    markdown: Path
    html: Path
    report: Report


def write_report(run_dir: Path, manager: Any = None, resolved: Any = None, plots: bool = True, out_dir: Path | None = None) -> ReportFiles:
    """Build and write the report of ``run_dir`` (``<output_dir>/harness``).

    ``manager``/``resolved`` are the live run's plugin manager and config; when
    None (``harness report``) the plugins are rebuilt from the run's config.yaml,
    built-in and installed (entry-point) plugins only: nothing a run directory
    names is imported. ``out_dir``: write the report there instead (a
    read-only run directory); its links to the run's files point back into it.
    Nothing is ever written or deleted through a symlink (:mod:`harness.safe_paths`).
    """
    run_dir = Path(run_dir)
    target = Path(out_dir) if out_dir is not None else run_dir
    if out_dir is not None:
        try:
            target.mkdir(parents=True, exist_ok=True)  # the user's own choice of folder
        except OSError as exc:
            raise _not_writable(run_dir, target, True, exc) from exc
    _check_targets(target)  # before anything is read or deleted: a link anywhere on the way refuses the whole rebuild
    record = RunRecord.load(run_dir)
    offline_notes: list[str] = []
    if manager is None:
        manager, resolved, offline_notes = offline_plugins(run_dir)

    def sections(run: RunRecord) -> tuple[list[ReportSection], list[str]]:
        found, notes = collect_sections(run, manager, resolved)
        return found, offline_notes + notes

    report = build_report(record, sections, plots=plots)
    markdown, html = target / "report.md", target / "report.html"
    text_md, text_html = render_markdown(report), render_html(report)
    if out_dir is not None:
        back = quote(Path(os.path.relpath(run_dir.resolve(), target.resolve())).as_posix())
        text_md, text_html = relink(text_md, back, _MD_LINK), relink(text_html, back, _HTML_LINK)
    try:  # a read-only mount (root too: os.access says yes there), a full disk, a folder where a file goes
        safe_rmtree(target, target / PLOTS_DIR)
        safe_mkdir(target, target / PLOTS_DIR)
        for plot in report.plots:
            safe_write_bytes(target, target / PLOTS_DIR / f"{plot.name}.png", plot.png)
        _copy_playbooks(target, target / PLAYBOOKS_DIR)
        safe_write_text(target, markdown, text_md)
        safe_write_text(target, html, text_html)
    except OSError as exc:
        raise _not_writable(run_dir, target, out_dir is not None, exc) from exc
    return ReportFiles(markdown, html, report)


def _not_writable(run_dir: Path, target: Path, elsewhere: bool, exc: OSError) -> RunDirNotWritableError:
    """The one-paragraph error for a report that could not be written (the OS's reason in it)."""
    where = exc.filename2 or exc.filename  # os.replace(tmp, name): the name is the second
    reason = f"{exc.strerror or type(exc).__name__}: '{where}'" if where else (str(exc) or type(exc).__name__)
    if elsewhere:
        return RunDirNotWritableError(
            f"the report could not be written under '{target}' ({reason}). Fix: pass another folder to --out DIR "
            "(one this user can write, with room left)."
        )
    output_dir = run_dir.parent if run_dir.name == "harness" else run_dir
    return RunDirNotWritableError(
        f"the run directory '{run_dir}' is not writable here ({reason}), so its report cannot be rebuilt in place. "
        f"Fix: write it elsewhere with `harness report {output_dir} --out DIR` (the run directory is left untouched)."
    )


_MD_LINK = re.compile(r"(?<!\\)(\]\()([^)\s]+)(\))")
_HTML_LINK = re.compile(r'(\b(?:href|src)=")([^"]+)(")')


def relink(text: str, prefix: str, pattern: re.Pattern[str]) -> str:
    """Links relative to the run directory made relative to a report written elsewhere (``--out``).

    The report's own files (``report/...``), anchors, absolute paths and URLs stay as they are.
    """
    def fix(match: re.Match[str]) -> str:
        link = match.group(2)
        if link.startswith(("report/", "#", "/")) or re.match(r"^[A-Za-z][A-Za-z0-9+.-]*:", link):
            return match.group(0)
        return f"{match.group(1)}{prefix}/{link}{match.group(3)}"

    return pattern.sub(fix, text)


def _check_targets(target: Path) -> None:
    """Every path a rebuild writes or deletes, checked before the first write: no symlink, nothing outside."""
    paths = [target, target / "report", target / PLOTS_DIR, target / PLAYBOOKS_DIR, target / "report.md", target / "report.html"]
    paths += [target / PLAYBOOKS_DIR / source.name for source in playbook_dir().glob("*.md")]
    for path in paths:
        safe_target(target, path)


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


def offline_plugins(run_dir: Path) -> tuple[Any, Any, list[str]]:
    """The run's plugins, rebuilt from its config.yaml: (manager, resolved config, notes on what was left out).

    Only plugins installed here are used: the built-in ones and the user's own
    entry-point plugins. A run directory is data: a ``module:Class`` path it
    names (config.yaml's ``plugins``, run.json's ``plugin_classes``) is shown in
    a note, never imported, so unpacking a run and reporting on it runs no code from it.
    """
    from harness.config import CORE_KEYS, Catalog, resolve_config
    from harness.errors import HarnessError
    from harness.manager import HarnessPluginManager

    catalog = Catalog.build()
    data, _ = read_run_config(run_dir)  # damaged values are already noted by RunRecord.load
    classes = read_run_info(run_dir).get("plugin_classes")
    classes = classes if isinstance(classes, dict) else {}
    notes: list[str] = []
    listed = [p for p in data.get("plugins") or [] if p != "defaults"]
    for name in listed:
        if name in catalog.entries:
            continue
        path = classes.get(name)
        if ":" in name:
            notes.append(f"plugin {name!r} is a class path from the run's config.yaml; classes a run directory names are "
                         "never imported offline: its section is left out.")
        elif isinstance(path, str):
            notes.append(f"plugin {name!r} ({path}) is not installed here: its section is left out "
                         "(a class path from a run directory is never imported).")
        else:
            notes.append(f"plugin {name!r} is not installed here: its section is left out.")
    known = {k: v for k, v in data.items() if k in CORE_KEYS or k in catalog.entries}
    if "plugins" in known:
        known["plugins"] = [p for p in listed if p in catalog.entries]
    if "disable" in known:
        disable = known["disable"] if isinstance(known["disable"], list) else []
        known["disable"] = [p for p in disable if isinstance(p, str) and p in catalog.entries]
    for key in ("severity", "policy"):
        if isinstance(known.get(key), dict):
            known[key] = {c: v for c, v in known[key].items() if c in catalog.codes}
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


def find_run_dirs(path: Path) -> list[Path]:
    """Run directories at or below ``path``: ``path/harness``, or ``path`` itself, and nested runs (depth 3)."""
    return scan_run_dirs(path)[0]


def scan_run_dirs(path: Path) -> tuple[list[Path], list[Path]]:
    """(run directories at or below ``path``, symlinks that were not followed).

    Only real harness run directories count (:func:`is_run_dir`); no symlink
    below ``path`` is followed (``path`` itself is the user's own choice), and
    checkpoints are not searched.
    """
    path = Path(path)
    found: list[Path] = []
    links: list[Path] = []
    for candidate in [path, path / "harness"]:
        if candidate != path and candidate.is_symlink():
            links.append(candidate)
            break
        if is_run_dir(candidate):
            found.append(candidate)
            break
    level = [path]
    for _ in range(3):  # <path>/*/harness, */*/harness, */*/*/harness
        below: list[Path] = []
        for folder in level:
            try:
                entries = sorted(os.scandir(folder), key=lambda e: e.name)
            except OSError:
                continue
            for entry in entries:
                child = Path(entry.path)
                if entry.name.startswith("checkpoint-"):
                    continue
                if entry.is_symlink():
                    if entry.name == "harness" or (child / "harness").exists():
                        links.append(child)
                    continue
                if not entry.is_dir(follow_symlinks=False):
                    continue
                below.append(child)
        for folder in below:
            candidate = folder / "harness"
            if candidate.is_symlink():
                if candidate not in links:
                    links.append(candidate)
            elif candidate not in found and is_run_dir(candidate):
                found.append(candidate)
        level = below
    return found, links


def is_run_dir(candidate: Path) -> bool:
    """Whether ``candidate`` is a run directory this harness wrote (and so one ``harness report`` may rebuild).

    Its run.json carries ``"format": "train-harness-run/..."``; or (runs from
    before the marker) it is named ``harness`` and holds the harness's resolved
    config.yaml (``plugins`` and ``max_plugin_errors`` at the top level) and
    either findings.jsonl or a run.json whose attempts are the harness's. A
    user's folder that merely has a run.json is not one.
    """
    candidate = Path(candidate)
    if not candidate.is_dir():
        return False
    info = _read_json_object(candidate / RUN_FILE)
    if isinstance(info.get("format"), str) and info["format"].startswith(RUN_FORMAT.split("/")[0] + "/"):
        return True
    if candidate.name != "harness":
        return False
    config, _ = read_run_config(candidate)
    if not {"plugins", "max_plugin_errors"} <= set(config):
        return False
    attempts = info.get("attempts")
    harness_attempts = isinstance(attempts, list) and bool(attempts) and all(
        isinstance(a, dict) and {"status", "start_step"} <= set(a) for a in attempts)
    return (candidate / "findings.jsonl").is_file() or harness_attempts


def _read_json_object(path: Path) -> dict[str, Any]:
    try:
        data = json.loads(path.read_bytes().decode("utf-8"))
    except (OSError, UnicodeDecodeError, RecursionError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}


def _copy_playbooks(root: Path, target: Path) -> None:
    safe_mkdir(root, target)
    for source in playbook_dir().glob("*.md"):
        safe_write_bytes(root, target / source.name, source.read_bytes())
