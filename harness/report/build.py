"""Builds the report from a run directory: verdict, grouped findings, plots, run card, plugin sections."""
from __future__ import annotations

import dataclasses
import os
import re
from urllib.parse import quote
from collections import defaultdict
from pathlib import Path
from typing import Any

from harness.core.findings import Severity
from harness.lib.hang_summary import RANK_HANG_CODE, stall_order
from harness.lib.playbook import find_section, section_for_link
from harness.report.model import FindingGroup, Raw, Report, ReportSection, md_table
from harness.report.plots import make_plots
from harness.report.provider import SectionsProvider
from harness.report.section_plots import name_section_plots
from harness.report.record import INTERRUPTED, RunRecord, as_float, attempt_status, error_text
from harness.report.verdict import rank_failure, symptoms_of, verdict_of
from harness.lib.textsafe import counted, md_escape

MAX_EVIDENCE_LINKS = 6


def build_report(run: RunRecord, plugin_sections: SectionsProvider | None = None, plots: bool = True) -> Report:
    """The report of ``run``; ``plugin_sections`` supplies the plugins' sections (and notes on failures)."""
    sections, notes = plugin_sections.sections(run) if plugin_sections is not None else ([], [])
    captured = captures_section(run)
    if captured is not None:
        sections.insert(0, captured)
    if not (run.run_dir / "run.json").exists():
        notes.append("run.json is missing: the run card and the attempts are incomplete (a run from before the report existed?).")
    notes.extend(run.damage_notes())
    if len(run.attempts) > ATTEMPTS_SHOWN:
        notes.append(f"run.json records {len(run.attempts):,} train() calls; the attempts table shows the last {ATTEMPTS_SHOWN}.")
    drawn = []
    if plots:
        try:
            drawn = make_plots(run)
        except Exception as exc:  # noqa: BLE001 - a report without plots beats no report
            notes.append(f"plots could not be drawn: {type(exc).__name__}: {exc}")
    if plots:
        sections, drawing_notes = name_section_plots(sections, taken=[plot.name for plot in drawn])
        notes.extend(drawing_notes)
    else:  # --no-plots: no PNG at all, the sections' text stays
        sections = [dataclasses.replace(section, plots=()) if section.plots else section for section in sections]
    return Report(
        run_dir=run.run_dir,
        title=f"Run report: {run.output_dir.name or run.output_dir}",
        verdict=verdict_of(run),
        groups=group_findings(run),
        symptoms=[(symptom, find_section(symptom.topic)) for symptom in symptoms_of(run)],
        plots=drawn,
        card=run_card(run),
        attempts=attempts_with_outcome(run),
        sections=sections,
        notes=notes,
        findings_unknown=run.findings_unknown,
    )


ATTEMPTS_SHOWN = 100  # the report's attempts table: the last this many train() calls (run.json may hold thousands)


def attempts_with_outcome(run: RunRecord) -> list[dict[str, Any]]:
    """run.json's attempts (the last ``ATTEMPTS_SHOWN``), each with ``outcome``: how it ended, in words (a stop names its
    step and cause)."""
    rows = []
    first = max(0, len(run.attempts) - ATTEMPTS_SHOWN)
    for index, attempt in enumerate(run.attempts[first:], first):
        status = attempt_status(attempt) if "status" in attempt else "?"
        outcome = "never recorded its end (killed?)" if status == "running" else str(status)
        if status == INTERRUPTED:
            outcome += " (Ctrl-C / SIGINT)"
        if status == "stopped":
            step, causes = run.attempt_stop(index)
            outcome += (f" by the harness at step {step}" if step is not None else " by the harness") + (f" after {causes[-1]}" if causes else "")
        shown = {"error": error_text(attempt["error"])} if error_text(attempt.get("error")) else {}  # no dangling "Type: "
        ranks = rank_failure(run, index)  # several processes: the rank that failed first, not rank 0's secondary error
        if ranks:
            shown = {"error": ranks}
            if status == "completed":
                outcome = "crashed on another rank (rank 0 completed)"
        rows.append({**attempt, **shown, "outcome": outcome})
    return rows


def group_findings(run: RunRecord) -> list[FindingGroup]:
    """Findings grouped by code and severity, most severe first, then by first step."""
    by_key: dict[tuple[str, Severity], list[Any]] = defaultdict(list)
    for finding in run.findings:
        by_key[(finding.code, finding.severity)].append(finding)  # a code found at two severities makes two rows
    groups = []
    for (code, severity), findings in by_key.items():
        groups.append(FindingGroup(code, severity, findings, section_for_link(findings[0].playbook), _evidence(run, findings),
                                   run.left_out.get((code, severity), 0)))
    return sorted(groups, key=lambda g: (-g.severity.rank, g.steps[0] if g.steps else -1, g.code))


def _evidence(run: RunRecord, findings: list[Any]) -> list[tuple[str, str]]:
    """Evidence values that name existing files, as links relative to the run directory."""
    links: dict[str, str] = {}
    for finding in findings[:50]:  # enough to find six files; thousands of findings must not mean thousands of stat calls
        for key, value in finding.evidence.items():
            values = value if isinstance(value, list) else [value]
            for item in values[:MAX_EVIDENCE_LINKS]:
                path = run.evidence_path(item)
                if path is None or not path.is_file():  # files only: a checkpoint folder is not part of the report's artifacts
                    continue
                relative = quote(Path(os.path.relpath(path, run.run_dir.resolve())).as_posix())
                links.setdefault(relative, key)
                if len(links) >= MAX_EVIDENCE_LINKS:
                    return [(label, rel) for rel, label in links.items()]
    return [(label, rel) for rel, label in links.items()]


def captures_section(run: RunRecord) -> ReportSection | None:
    """The batches captured at findings (``captures/step-<N>/``), with their most suspect sample."""
    rows = []
    for summary in sorted(_capture_files(run.run_dir), key=_capture_order):
        data = _read_json(summary)
        samples = data.get("samples") or []
        top = samples[0] if samples and isinstance(samples[0], dict) else {}
        suspect = _suspect(top)
        table = summary.with_name(summary.name.replace("capture.", "summary.").replace(".json", ".md"))
        folder = summary.parent.relative_to(run.run_dir).as_posix()
        links = [f"[capture]({quote(f'{folder}/{summary.name}')})"] + ([f"[samples]({quote(f'{folder}/{table.name}')})"] if table.exists() else [])
        replay = f"harness replay {summary.parent}"
        if not data:  # damaged or edited by hand: said, and no replay suggested that would only fail on it
            reason, replay = f"{summary.name} could not be read (not the JSON object a capture writes)", "-"
        else:
            reason = data.get("reason", "")
        rows.append([data.get("step", "?"), data.get("rank", "?"), data.get("code", "?"), reason,
                     "yes" if data.get("after_resume") else "no", suspect, Raw(", ".join(links)), replay])
    if not rows:
        return None
    text = ("Batches captured when a finding fired, most suspect sample first in each `samples` table; "
            "`harness replay` recomputes them on the checkpoint before the step.\n\n")
    headers = ["step", "rank", "code", "reason", "after resume", "top suspect", "files", "replay"]
    return ReportSection("Captured batches", text + md_table(headers, rows), "harness")


def _capture_files(run_dir: Path) -> list[Path]:
    """``captures/step-*/capture.rank-*.json``, no linked folder followed (a received run's link may point anywhere)."""
    root = run_dir / "captures"
    if root.is_symlink() or not root.is_dir():
        return []
    return [file for folder in root.iterdir() if folder.name.startswith("step-") and not folder.is_symlink() and folder.is_dir()
            for file in folder.iterdir() if file.name.startswith("capture.rank-") and file.name.endswith(".json")]


def _suspect(sample: dict[str, Any]) -> str:
    if not sample:
        return "-"
    where = f"sample {sample['sample_id']}" if sample.get("sample_id") is not None else f"micro-batch {sample.get('micro_batch', '?')} row {sample.get('row', '?')}"
    loss = as_float(sample.get("loss"))
    return where + (f" (loss {loss:.4g})" if loss is not None else "")


def _capture_order(path: Path) -> tuple[int, str]:
    try:
        return int(path.parent.name.split("-", 1)[1]), path.name
    except (IndexError, ValueError):
        return 0, path.name


def _read_json(path: Path) -> dict[str, Any]:
    from harness.core.received import read_received_json

    try:
        data = read_received_json(path)  # a received run's file: never a link, a FIFO or a device
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}


def run_card(run: RunRecord) -> list[tuple[str, str]]:
    """The run card: what was trained, on what, how far it got."""
    info = run.info
    model = info.get("model") if isinstance(info.get("model"), dict) else {}
    training = info.get("training") if isinstance(info.get("training"), dict) else {}
    rows: list[tuple[str, Any]] = [
        ("stage", info.get("stage")),
        ("trainer", info.get("trainer")),
        ("model", model.get("class")),
        ("parameters", _count(model.get("parameters"))),
        ("trainable parameters", _count(model.get("trainable_parameters"))),
        ("architecture", _architecture(model)),
        ("weights dtype", model.get("dtype")),
        ("precision", training.get("precision")),
        ("world size", info.get("world_size")),
        ("DeepSpeed ZeRO stage", training.get("deepspeed_zero_stage")),
        ("global batch (sequences)", _global_batch(training, info)),
        ("learning rate", _schedule(training)),
        ("planned steps", training.get("max_steps")),
        ("training rows", _count(training.get("train_rows"))),
        ("eval rows", _count(training.get("eval_rows"))),
        ("steps recorded", run.last_step),
        ("tokens processed", _count(_last_tokens(run))),
        ("attempts (train() calls)", len(run.attempts) or None),
        ("plugins", ", ".join(run.config.get("plugins") or []) or None),
        ("versions", ", ".join(f"{k} {v}" for k, v in info["versions"].items()) if isinstance(info.get("versions"), dict) else None),
    ]
    return [(label, str(value)) for label, value in rows if value not in (None, "", "None")]


def _count(value: Any) -> str | None:
    number = as_float(value)
    if number is None:
        return None
    for unit, scale in (("B", 1e9), ("M", 1e6), ("k", 1e3)):
        if abs(number) >= scale:
            return f"{number / scale:.3g}{unit} ({int(number):,})"
    return f"{int(number):,}"


def _architecture(model: dict[str, Any]) -> str | None:
    parts = [counted(model[k], label) if label.endswith("s") else f"{model[k]} {label}" for k, label in
             (("num_hidden_layers", "layers"), ("hidden_size", "hidden"), ("num_attention_heads", "heads"), ("vocab_size", "vocab"))
             if model.get(k)]
    return ", ".join(parts) or None


def _global_batch(training: dict[str, Any], info: dict[str, Any]) -> str | None:
    if not training.get("global_batch_size"):
        return None
    return (f"{training['global_batch_size']} = {training.get('per_device_train_batch_size')} per device x "
            f"{training.get('gradient_accumulation_steps')} accumulation x {counted(info.get('world_size'), 'ranks')}")


def _schedule(training: dict[str, Any]) -> str | None:
    if not isinstance(training.get("learning_rate"), (int, float)) or not training["learning_rate"]:
        return None
    warmup = f", warmup {training['warmup_steps']}" if training.get("warmup_steps") else ""
    return f"{training['learning_rate']:g} ({training.get('lr_scheduler_type')}{warmup})"


def _last_tokens(run: RunRecord) -> float | None:
    values = [as_float(r.get("tokens")) for r in run.steps]
    values = [v for v in values if v]
    return values[-1] if values else None


def steps_to_take(groups: list[FindingGroup]) -> list[FindingGroup]:
    """One group per code for the "next steps" list: the most severe, warnings and above when there are any."""
    chosen = [g for g in groups if g.severity >= Severity.WARNING] or groups
    seen: set[str] = set()
    return [g for g in chosen if not (g.code in seen or seen.add(g.code))]  # type: ignore[func-returns-value]


def next_step(group: FindingGroup, output_dir: Path | None = None) -> str:
    """The first confirm step of a finding's playbook (what ``harness explain`` prints), made concrete.

    ``<output_dir>`` becomes the run's output directory; ``<N>`` and ``<r>``
    become the finding's step and rank when the group has only one of each.
    """
    if group.playbook is None or group.playbook.next_step is None:
        return f"no playbook section for {md_escape(group.code)}; read the finding's message and evidence."  # markdown: the code is data
    text = group.playbook.next_step
    if output_dir is not None:
        text = text.replace("<output_dir>", str(output_dir))
    if len(group.steps) == 1:
        text = text.replace("<N>", str(group.steps[0]))
    if len(group.ranks) == 1:
        text = text.replace("<r>", str(group.ranks[0]))
    elif group.code == RANK_HANG_CODE and (order := stall_order(group.findings)):
        first = order[0]  # several ranks' watchdogs fired: the next step is the stacks of the rank that stalled first
        text = text.replace("<r>", str(first.rank)).replace("<N>", str(first.step))
    return _drop_filled_legend(text)


_LEGEND = {"<N>": re.compile(r"N the finding's `step`(?:, |; )?"), "<r>": re.compile(r"r its (?:`evidence\.rank`|rank)(?:, |; )?")}


def _drop_filled_legend(text: str) -> str:
    """``(N the finding's `step`, r its rank)`` says what the placeholders mean: once they are filled in, it goes."""
    dropped = False
    for placeholder, legend in _LEGEND.items():
        if placeholder not in text:
            text, count = legend.subn("", text)
            dropped = dropped or bool(count)
    if not dropped:
        return text  # the snippets' own calls, `.first()` and `next(iter(...))`, are never touched
    # the legend's parentheses, now empty or half empty; a call's ``()`` follows a name, never a space
    return re.sub(r"\s+\(\s*\)", "", text).replace("( ", "(").replace(", )", ")").replace("; )", ")")


__all__ = ["build_report", "group_findings", "next_step", "run_card", "Severity"]
