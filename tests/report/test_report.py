"""The run report: written at every train() end, rebuilt from the run directory alone, links that resolve, a real browser."""
from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

import harness
from cli_in_process import harness_in_process
from conftest import FAULTS, broken_report_links, findings_of, harness_cli, read_jsonl, wrapped_example, write_yaml
from harness.cli import main as harness_main
from harness.core.hookspecs import hookimpl
from harness.report import ReportSection

STEPS, SAVE_AT, STOP_AT = 10, 5, 8


class SectionPlugin:
    """Contributes a report section from the run directory alone, as the hook asks."""

    name = "section_plugin"

    @hookimpl
    def report_sections(self, run: Any) -> ReportSection:
        records = len(read_jsonl(run.run_dir / "steps.jsonl"))
        return ReportSection("Section from a plugin", f"{records} step records in [steps.jsonl](steps.jsonl).")


class BrokenSection:
    name = "broken_section"

    @hookimpl
    def report_sections(self) -> None:
        raise RuntimeError("no section today")


def _trainer(output_dir: Path, tokenizer: Any, rows: Any) -> Any:
    from transformers import Trainer, TrainingArguments

    from harness.lib.tiny import build_tiny_llama

    args = TrainingArguments(output_dir=str(output_dir), max_steps=STEPS, per_device_train_batch_size=4, learning_rate=1e-3,
                             report_to="none", logging_steps=1, use_cpu=True, save_strategy="steps", save_steps=SAVE_AT,
                             disable_tqdm=True, dataloader_num_workers=0, seed=0)
    return Trainer(model=build_tiny_llama(tokenizer, seed=0), args=args, train_dataset=rows)


@pytest.fixture(scope="module")
def resumed_run(tmp_path_factory: pytest.TempPathFactory, tokenizer: Any, lm_rows: Any) -> Path:
    """A NaN step at 4, a stop at 8, then a resume from checkpoint-5 that replays 6-8 and finishes at 10."""
    out = tmp_path_factory.mktemp("report") / "run"
    plugins = [SectionPlugin(), BrokenSection()]
    first = _trainer(out, tokenizer, lm_rows)
    harness.attach(first, config={"plugins": ["defaults", FAULTS], "report_plots": True,
                                  "fault_injector": {"nonfinite_loss_at_steps": [4], "stop_at_step": STOP_AT}}, plugins=plugins)
    first.train()
    second = _trainer(out, tokenizer, lm_rows)
    harness.attach(second, config={"plugins": ["defaults", FAULTS], "report_plots": True}, plugins=[SectionPlugin(), BrokenSection()])
    second.train(resume_from_checkpoint=str(out / f"checkpoint-{SAVE_AT}"))
    return out


def test_report_is_written_at_run_end_with_verdict_findings_plots_and_card(resumed_run: Path, tokenizer: Any) -> None:
    run_dir = resumed_run / "harness"
    markdown = (run_dir / "report.md").read_text(encoding="utf-8")
    verdict = markdown.splitlines()[2]
    assert verdict.startswith("**Verdict: needs attention.** training completed at step 10") and "NONFINITE_LOSS" in verdict
    # the finding, linked to its own playbook section, with its numbers and its capture
    row = next(line for line in markdown.splitlines() if line.startswith("| [NONFINITE_LOSS]"))
    assert "(report/playbooks/numeric-health.md#nonfinite_loss)" in row and "| 4 |" in row and "skip_step" in row
    assert "[capture](captures/step-4/capture.rank-0.json)" in row
    assert "**NONFINITE_LOSS** (step 4): Read the `NONFINITE_LOSS` line of `" + str(resumed_run) + "/harness/findings.jsonl`" in markdown
    # plots exist, and the steps file holds the replayed steps 6-8 twice (the resume is a new segment)
    assert {p.name for p in (run_dir / "report" / "plots").glob("*.png")} == {"loss.png", "grad_norm.png", "lr.png", "throughput.png"}
    steps = [r["step"] for r in read_jsonl(run_dir / "steps.jsonl")]
    assert steps == list(range(1, STOP_AT + 1)) + list(range(SAVE_AT + 1, STEPS + 1))
    tokens = {r["step"]: r["tokens"] for r in read_jsonl(run_dir / "steps.jsonl")}
    assert tokens[STEPS] == STEPS * 4 * 32  # restored at the resume: tokens processed by the weights, not by the machine
    # the run card's parameter count is the model's; both attempts with how they ended
    from harness.lib.tiny import build_tiny_llama

    parameters = sum(p.numel() for p in build_tiny_llama(tokenizer, seed=0).parameters())
    assert f"| parameters | {parameters / 1e3:.3g}k ({parameters:,}) |" in markdown
    attempts = markdown[markdown.index("## Attempts"):].splitlines()[4:6]
    assert "| 0-8 | stopped by the harness at step 8 after PLUGIN_STOP |" in attempts[0] and f"checkpoint-{SAVE_AT} | 5-10 | completed |" in attempts[1]
    # plugin sections: the core's captures, a plugin's own, and a note for the plugin that failed
    assert "## Captured batches" in markdown and "harness replay " in markdown
    assert f"## Section from a plugin\n\n{len(steps)} step records in [steps.jsonl](steps.jsonl)." in markdown
    assert "plugin 'broken_section' failed in report_sections: RuntimeError: no section today" in markdown
    assert "INTERNAL_PLUGIN_ERROR" not in markdown  # a failing section is a note, not a finding


def test_every_link_in_the_report_resolves(resumed_run: Path) -> None:
    run_dir = resumed_run / "harness"
    assert broken_report_links(run_dir) == []
    html = (run_dir / "report.html").read_text(encoding="utf-8")
    assert 'href="#pb-numeric-health-nonfinite_loss"' in html and 'id="pb-numeric-health-nonfinite_loss"' in html
    assert "<h2>NONFINITE_LOSS</h2>" in html  # the playbook section itself is embedded
    # a link that does not resolve is found (the checker can fail)
    (run_dir / "report" / "playbooks" / "numeric-health.md").rename(run_dir / "gone.md")
    try:
        assert any("numeric-health.md does not exist" in b for b in broken_report_links(run_dir))
    finally:
        (run_dir / "gone.md").rename(run_dir / "report" / "playbooks" / "numeric-health.md")


def _refuse(token: str) -> Any:
    raise ValueError(f"not strict JSON: bare {token}")


def test_every_json_file_of_the_run_directory_is_strict_json(resumed_run: Path) -> None:
    """findings, metrics, steps, ledger, captures, run.json and the plugins' own files: a parser without NaN/Infinity
    (jq, JSON.parse, Go, serde_json) reads every line of a run with a NaN step; a non-finite number is "nan"/"inf"."""
    import json

    run_dir = resumed_run / "harness"
    files = sorted(p for p in run_dir.rglob("*") if p.is_file() and p.suffix in (".json", ".jsonl"))
    names = {p.relative_to(run_dir).as_posix() for p in files}
    assert {"findings.jsonl", "metrics.jsonl", "steps.jsonl", "run.json"} <= names
    assert any(n.startswith("captures/") for n in names) and any(n.startswith("ledger/") for n in names)
    nonfinite = 0
    for path in files:
        text = path.read_text(encoding="utf-8")
        for number, line in enumerate(text.splitlines() if path.suffix == ".jsonl" else [text], 1):
            if line.strip():
                try:
                    json.loads(line, parse_constant=_refuse)
                except ValueError as exc:
                    raise AssertionError(f"{path.relative_to(run_dir)} line {number}: {exc}") from None
                nonfinite += line.count('"nan"') + line.count('"inf"') + line.count('"-inf"')
    assert nonfinite  # the NaN step is in the files, spelled as strings
    step_4 = [r for r in read_jsonl(run_dir / "steps.jsonl") if r["step"] == 4]
    assert step_4 and step_4[0]["loss"] == "nan"


def test_harness_report_rebuilds_the_same_report_from_the_directory(resumed_run: Path, tmp_path: Path, capsys: Any) -> None:
    copy = tmp_path / "run"
    shutil.copytree(resumed_run, copy, ignore=shutil.ignore_patterns("checkpoint-*"))
    for name in ("report.md", "report.html"):
        (copy / "harness" / name).unlink()
    shutil.rmtree(copy / "harness" / "report")
    assert harness_main(["report", str(copy)]) == 0
    assert "needs attention: training completed at step 10" in capsys.readouterr().out

    def body(path: Path) -> list[str]:
        text = path.read_text(encoding="utf-8").replace(str(copy), str(resumed_run))
        return [line for line in text.splitlines() if not line.startswith(("_Built from", "| [capture]"))]

    original, rebuilt = body(resumed_run / "harness" / "report.md"), body(copy / "harness" / "report.md")
    # offline, the built-in plugins (sections included) come back from config.yaml; the test's object plugins are class
    # paths named by run.json, which is data: never imported (test_report_safety.py), a note each instead of their sections
    for name in ("section_plugin", "broken_section"):
        assert any(line.startswith(f"- plugin '{name}' (") and "is not installed here" in line for line in rebuilt), name
    section = original.index("## Section from a plugin")
    original = original[:section] + original[section + 4:]
    assert [line for line in rebuilt if not line.startswith("- plugin '")] == [line for line in original if not line.startswith("- plugin '")]
    assert broken_report_links(copy / "harness") == []


def test_explain_prints_the_verdict_and_a_next_step_per_finding(resumed_run: Path, capsys: Any) -> None:
    assert harness_main(["explain", str(resumed_run)]) == 0
    out = capsys.readouterr().out
    assert "Verdict: needs attention: training completed at step 10" in out
    codes = {f["code"] for f in findings_of(resumed_run)}
    for code in codes:
        block = out[out.index(f"] {code} x"):]
        assert "\n  next: " in block.split("\n\n")[0] and f"harness playbook {code}" in block.split("\n\n")[0], code
    assert f"next: Read the `NONFINITE_LOSS` line of `{resumed_run}/harness/findings.jsonl`" in " ".join(out.split())  # filled in


def test_explain_and_report_name_the_fix_for_a_folder_without_a_run(tmp_path: Path) -> None:
    result = harness_cli("explain", str(tmp_path))
    assert result.returncode == 2 and "no harness run directory" in result.stderr and "Fix:" in result.stderr
    missing = harness_cli("report", str(tmp_path / "nope"))
    assert missing.returncode == 2 and "does not exist" in missing.stderr


@pytest.mark.slow  # a long end-to-end run (subprocesses or hundreds of steps): CI runs it, the quick subset does not
def test_a_run_killed_with_kill_9_gets_a_complete_report(tmp_path: Path, capsys: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    out = tmp_path / "killed"
    config = write_yaml(tmp_path / "h.yaml", {"plugins": ["defaults", FAULTS], "fault_injector": {"nonfinite_loss_at_steps": [3], "kill_at_step": 13}})
    result = wrapped_example(out, config, steps=20)
    assert result.returncode in (-9, 137), result.stderr[-2000:]
    assert not (out / "harness" / "report.md").exists()  # nothing ran at the end: the process was killed
    rebuilt = harness_in_process(capsys, monkeypatch, "report", str(out))  # the CLI in this process (as a subprocess: tools/test_report_safety.py)
    assert rebuilt.returncode == 0, rebuilt.stderr[-2000:]
    markdown = (out / "harness" / "report.md").read_text(encoding="utf-8")
    verdict = re.search(r"\*\*Verdict: failed\.\*\* the last train\(\) call never reached its end at step (\d+) or later "
                        r"\(the last step recorded\): killed: pid \d+ on this host no longer holds its run lock", markdown)
    assert verdict is not None and int(verdict.group(1)) in (12, 13), markdown[:2000]  # the ledger may hold the step in flight
    assert "[NONFINITE_LOSS](report/playbooks/numeric-health.md#nonfinite_loss) | 1 | 3 |" in markdown
    assert "never recorded its end (killed?)" in markdown and "| parameters |" in markdown
    steps = [r["step"] for r in read_jsonl(out / "harness" / "steps.jsonl")]
    assert steps[:10] == list(range(1, 11))  # flushed at every log (logging_steps=1); at most flush_every lost otherwise
    assert (out / "harness" / "report" / "plots" / "loss.png").exists()
    assert broken_report_links(out / "harness") == []


def _chromium() -> str | None:
    found = shutil.which("chromium") or shutil.which("chromium-browser")
    if found is None and os.environ.get("HARNESS_REQUIRE_BROWSER") == "1":
        pytest.fail("chromium is required (HARNESS_REQUIRE_BROWSER=1) but not installed; .ci/run installs Debian's chromium")
    return found


def test_report_html_renders_in_a_headless_browser(resumed_run: Path, tmp_path: Path) -> None:
    browser = _chromium()
    if browser is None:
        pytest.skip("chromium not installed (.ci/run installs it and sets HARNESS_REQUIRE_BROWSER=1)")
    page = (resumed_run / "harness" / "report.html").as_uri()
    flags = [browser, "--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run", "--disable-background-networking",
             "--disable-component-update", "--disable-sync", f"--user-data-dir={tmp_path / 'profile'}"]
    dom = subprocess.run([*flags, "--dump-dom", page], capture_output=True, text=True, timeout=120).stdout
    assert re.search(r'<div id="verdict" class="verdict needs-attention"><strong>Verdict: needs attention\.</strong>', dom), dom[:2000]
    assert re.search(r'<tr class="finding" data-code="NONFINITE_LOSS">', dom)
    assert len(re.findall(r'<img class="plot" id="plot-\w+" alt="[^"]+" src="data:image/png;base64,', dom)) == 4
    shot = tmp_path / "report.png"
    subprocess.run([*flags, "--window-size=1200,4000", f"--screenshot={shot}", page], capture_output=True, timeout=120, check=True)
    from PIL import Image

    pixels = Image.open(shot).convert("RGB").getdata()
    plot_blue = sum(1 for r, g, b in pixels if abs(r - 31) < 25 and abs(g - 119) < 25 and abs(b - 180) < 25)
    assert plot_blue > 300, "the plots did not render (no loss-line blue on the page)"


class ReportListener:
    name = "report_listener"

    def __init__(self) -> None:
        self.reports: list[Any] = []

    @hookimpl
    def on_report(self, report: Any) -> None:
        self.reports.append(report)


def test_on_report_fires_when_the_report_itself_fails(make_trainer: Any, monkeypatch: Any) -> None:
    import harness.report

    def broken(*args: Any, **kwargs: Any) -> Any:
        raise OSError("disk full")

    monkeypatch.setattr(harness.report, "write_report", broken)
    listener = ReportListener()
    trainer = make_trainer(max_steps=2)
    harness.attach(trainer, config={"plugins": ["metrics_log"]}, plugins=[listener])
    trainer.train()  # the run still ends normally
    assert listener.reports == [None] and trainer.state.global_step == 2


def test_on_report_fires_once_per_train_call_even_with_the_report_off(make_trainer: Any) -> None:
    listener = ReportListener()
    trainer = make_trainer(max_steps=2)
    ctx = harness.attach(trainer, config={"report": False, "plugins": ["metrics_log"]}, plugins=[listener])
    trainer.train()
    assert listener.reports == [None]  # trackers close on it: it fires with no report too
    assert not (ctx.run_dir / "report.md").exists() and (ctx.run_dir / "run.json").exists()
    listener.reports.clear()
    trainer = make_trainer(max_steps=2, output_dir=ctx.run_dir.parent / "on")
    harness.attach(trainer, config={"plugins": ["metrics_log"], "report_plots": False}, plugins=[listener])
    trainer.train()
    (files,) = listener.reports
    assert files.html.exists() and files.report.verdict.label == "healthy" and files.report.plots == []


@pytest.mark.parametrize("learning_rate,stuck", [(0.0, True), (3e-3, False)])
def test_a_loss_that_does_not_fall_points_at_its_general_playbook(make_trainer: Any, learning_rate: float, stuck: bool) -> None:
    trainer = make_trainer(max_steps=24, learning_rate=learning_rate, logging_steps=8)
    ctx = harness.attach(trainer, config={"plugins": ["metrics_log"], "report_plots": False})
    trainer.train()
    report = (ctx.run_dir / "report.md").read_text(encoding="utf-8")
    link = "- [Loss not decreasing](report/playbooks/loss-not-decreasing.md): median loss of the last 2 steps"
    assert (link in report) is stuck and ("## Worth a look" in report) is stuck


def test_a_next_step_drops_the_legend_of_the_placeholders_it_filled_in() -> None:
    """`(N the finding's step, r its evidence.rank)` explains `<N>`/`<r>`; filled in, the legend went on saying it."""
    from harness.core.findings import Finding, Severity
    from harness.lib.playbook import find_section
    from harness.report.build import next_step
    from harness.report.model import FindingGroup

    def group(code: str, steps: tuple[int, ...]) -> FindingGroup:
        section = find_section(code)
        assert section is not None and "(N the finding's `step`" in (section.next_step or ""), code
        return FindingGroup(code, Severity.WARNING, [Finding(code, Severity.WARNING, "p", "m", step=s, rank=1) for s in steps], section)

    text = next_step(group("LOSS_SPIKE", (7,)), Path("/out"))
    assert "/out/harness/captures/step-7/summary.rank-1.md" in text and "N the finding's" not in text, text
    assert "(`evidence.capture` is the path of `capture.rank-1.json` in the same folder)" in text, text
    assert "(N the finding's" not in next_step(group("FAULT_REPRODUCED", (7,)), Path("/out")).replace("`", "")
    several = next_step(group("LOSS_SPIKE", (7, 9)), Path("/out"))
    assert "step-<N>" in several and "N the finding's `step`" in several  # not filled in: the legend stays


def test_a_next_step_keeps_the_calls_of_its_snippets() -> None:
    """Issue 46 item 4: the report and explain printed `.first.unstack(0).head` for `.first().unstack(0).head()` and
    `next(iter(trainer.get_train_dataloader))`: the legend's clean-up removed every `()`. Every playbook's first step
    keeps each call it has, filled in or not."""
    import re

    from harness.core.findings import Finding, Severity
    from harness.lib.playbook import load_library
    from harness.report.build import next_step
    from harness.report.model import FindingGroup

    checked = 0
    for playbook in load_library().values():
        for section in playbook.sections:
            calls = re.findall(r"\w\(\)", section.next_step or "")
            if not calls or not section.anchor:
                continue
            for steps in ((7,), (7, 9)):
                found = [Finding(section.key, Severity.WARNING, "p", "m", step=s, rank=1) for s in steps]
                text = next_step(FindingGroup(section.key, Severity.WARNING, found, section), Path("/out"))
                assert all(call in text for call in calls), (section.key, calls, text)
            checked += 1
    assert checked >= 4
