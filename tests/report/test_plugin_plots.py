"""A plugin section's figures: drawn by the report, saved under report/plots/<plugin>-<name>.png whatever the names, linked and embedded."""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from harness.report import ReportSection, write_report
from harness.report.plots import Plot
from harness.report.record import RunRecord
from harness.report.section_plots import safe_stem

PNG = b"\x89PNG\r\n\x1a\n"


def _line(axes: Any) -> bool:
    axes.plot([1, 2, 3], [3.0, 1.0, 2.0])
    return True


def _boom(axes: Any) -> bool:
    raise ValueError("no figure today")


class HostileSections:
    """Names from a received run directory (a plugin's options, a block name): path traversal, duplicates, odd characters."""

    def sections(self, run: RunRecord) -> tuple[list[ReportSection], list[str]]:
        plots = (("../../x", "Escape <b>attempt</b>", _line), ("../../x", "Same name again", _line), ("empty", "Nothing", lambda axes: False),
                 ("boom", "Raises", _boom), Plot("/etc/passwd", "ready bytes", PNG + b"rest"), ("not", "a spec"))
        return [ReportSection("Hostile plots", "text first", "../../evil", plots)], []


def _run_dir(tmp_path: Path) -> Path:
    run_dir = tmp_path / "out" / "harness"
    run_dir.mkdir(parents=True)
    rows = [{"step": s, "loss": 5.0 - s * 0.1, "time": float(s)} for s in range(1, 5)]  # the loss plot only: fast
    (run_dir / "steps.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    return run_dir


def test_a_hostile_plot_name_stays_inside_report_plots_and_is_linked_and_embedded(tmp_path: Path) -> None:
    """(A rebuild keeping them: tests/plugins/test_layer_stats.py runs `harness report` twice.)"""
    run_dir = _run_dir(tmp_path)
    files = write_report(run_dir, sections=HostileSections(), plots=True)
    plots = run_dir / "report" / "plots"
    ours = sorted(p.name for p in plots.iterdir() if p.name.startswith("evil-"))
    assert ours == ["evil-etc_passwd.png", "evil-x-2.png", "evil-x.png"]  # empty and failing figures left out
    assert (plots / "loss.png").exists()  # beside the report's own plots
    assert not (tmp_path / "x.png").exists() and not list(tmp_path.glob("*.png")) and not (run_dir / "x.png").exists()
    assert all(p.read_bytes().startswith(PNG) for p in plots.iterdir())
    markdown, html = files.markdown.read_text(), files.html.read_text()
    section = markdown.split("## Hostile plots", 1)[1]
    assert section.index("text first") < section.index("](report/plots/evil-x.png)") and "](report/plots/evil-x-2.png)" in section
    assert 'id="plot-evil-x"' in html and 'href="report/plots/evil-x-2.png"' in html and "<b>attempt" not in html
    assert any("could not be drawn: ValueError: no figure today" in note for note in files.report.notes)



def test_no_plots_draws_none_and_keeps_the_text(tmp_path: Path) -> None:
    run_dir = _run_dir(tmp_path)
    files = write_report(run_dir, sections=HostileSections(), plots=False)
    assert list((run_dir / "report" / "plots").iterdir()) == []
    assert "text first" in files.markdown.read_text() and "report/plots/" not in files.markdown.read_text()


def test_safe_stem() -> None:
    assert [safe_stem(s) for s in ("../../x", "a b/c", "", "..", "model.layers.1")] == ["x", "a_b_c", "plot", "plot", "model_layers_1"]
