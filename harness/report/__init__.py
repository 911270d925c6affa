"""The run report: ``report.md`` and a self-contained ``report.html`` in the run directory.

Written by rank 0 at the end of every ``train()`` call (also after a crash or
a stop) and rebuilt at any time from the run directory alone with
``harness report <output_dir>`` (:mod:`harness.tools.report`), which is how a
run killed with ``kill -9`` gets its report. The plugins' sections come from
a :class:`SectionsProvider`: this package never builds a catalog, a config
or a plugin manager.
"""
from __future__ import annotations

import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import quote

from harness.core.errors import RunDirNotWritableError
from harness.lib.playbook import playbook_dir
from harness.lib.safe_paths import safe_mkdir, safe_rmtree, safe_target, safe_write_bytes, safe_write_text
from harness.report.build import build_report
from harness.report.html import render_html
from harness.report.markdown import PLAYBOOKS_DIR, PLOTS_DIR, render_markdown
from harness.report.model import Report, ReportSection
from harness.report.provider import NoSections, PluginSections, SectionsProvider
from harness.report.record import RunRecord
from harness.report.rundirs import find_run_dirs, is_run_dir, scan_run_dirs

__all__ = [
    "NoSections", "PluginSections", "Report", "ReportFiles", "ReportSection", "RunRecord", "SectionsProvider",
    "collect_sections", "find_run_dirs", "is_run_dir", "scan_run_dirs", "write_report",
]


@dataclass(frozen=True)
class ReportFiles:
    markdown: Path
    html: Path
    report: Report


def write_report(
    run_dir: Path,
    manager: Any = None,
    resolved: Any = None,
    plots: bool = True,
    out_dir: Path | None = None,
    *,
    sections: SectionsProvider | None = None,
) -> ReportFiles:
    """Build and write the report of ``run_dir`` (``<output_dir>/harness``).

    The plugins' sections come from ``sections`` (preferred:
    ``write_report(run_dir, sections=PluginSections(manager, config), plots=...)``);
    ``manager``/``resolved`` (a live run's plugin manager and config) are the
    older spelling of the same thing. With neither, the report holds no plugin
    sections: ``harness report`` rebuilds the plugins in :mod:`harness.tools.report`.
    ``out_dir``: write the report there instead (a read-only run directory);
    its links to the run's files point back into it. Nothing is ever written
    or deleted through a symlink (:mod:`harness.lib.safe_paths`).
    """
    if sections is None:
        sections = PluginSections(manager, resolved) if manager is not None else NoSections()
    run_dir = Path(run_dir)
    target = Path(out_dir) if out_dir is not None else run_dir
    if out_dir is not None:
        try:
            target.mkdir(parents=True, exist_ok=True)  # the user's own choice of folder
        except OSError as exc:
            raise _not_writable(run_dir, target, True, exc) from exc
    _check_targets(target)  # before anything is read or deleted: a link anywhere on the way refuses the whole rebuild
    record = RunRecord.load(run_dir)
    report = build_report(record, sections, plots=plots)
    markdown, html = target / "report.md", target / "report.html"
    text_md, text_html = render_markdown(report), render_html(report)
    if out_dir is not None:
        back = quote(Path(os.path.relpath(run_dir.resolve(), target.resolve())).as_posix())
        text_md, text_html = relink(text_md, back, _MD_LINK), relink(text_html, back, _HTML_LINK)
    try:  # a read-only mount (root too: os.access says yes there), a full disk, a folder where a file goes
        safe_rmtree(target, target / PLOTS_DIR)
        safe_mkdir(target, target / PLOTS_DIR)
        for plot in report.all_plots:  # the report's own and the plugin sections' (named safe in build_report)
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
    """Every plugin's ``report_sections`` (kept for callers of the old name; see :class:`PluginSections`)."""
    return PluginSections(manager, resolved).sections(run)


def _copy_playbooks(root: Path, target: Path) -> None:
    safe_mkdir(root, target)
    for source in playbook_dir().glob("*.md"):
        safe_write_bytes(root, target / source.name, source.read_bytes())
