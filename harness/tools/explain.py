"""``harness explain`` and ``harness playbook``: the run directory and the playbooks, in a terminal (``harness report`` is :mod:`harness.tools.report`)."""
from __future__ import annotations

import shlex
import sys
import textwrap
from pathlib import Path
from typing import Any

from harness.core.console import shorten
from harness.core.terminal_text import terminal_text
from harness.core.errors import HarnessError, did_you_mean
from harness.lib.hang_summary import RANK_HANG_CODE, hang_summary
from harness.lib.playbook import find_section, load_library
from harness.lib.runinfo import INTERRUPTED
from harness.report.rundirs import scan_run_dirs


def run_dirs_or_fail(path: Path) -> list[Path]:
    """The run directories at or below ``path``; a folder with none is an error that says why."""
    return scan_or_fail(path)[0]


def scan_or_fail(path: Path) -> tuple[list[Path], list[Path]]:
    """(run directories at or below ``path``, symlinks not followed, each noted on stderr); none is an error."""
    if not path.exists():
        raise HarnessError(f"'{path}' does not exist. Fix: pass the training run's output_dir (the folder that holds harness/).")
    found, links = scan_run_dirs(path)
    for link in links:  # a note, not a failure: `runs/latest -> runs/2024-...` is common and its run is found anyway
        sys.stderr.write(f"harness: note: not followed: {link} is a symbolic link (links found while searching for runs "
                         "are never followed; pass the real folder it points to, if you trust it).\n")
    if not found:
        looks = [name for name in ("run.json", "findings.jsonl", "config.yaml", "report.md") if (path / name).exists()]
        if looks:
            raise HarnessError(
                f"'{path}' is not a train-harness run directory: it has {', '.join(looks)}, but its run.json has no "
                '"format": "train-harness-run/1" marker and it is not an older harness run directory (a folder named '
                "harness with the harness's config.yaml and findings.jsonl or run.json). Nothing was read or written. "
                "Fix: pass the output_dir of a training run that had the harness attached (the folder that holds harness/)."
            )
        raise HarnessError(
            f"no harness run directory in '{path}': expected '{path / 'harness'}' written by the harness (run.json with "
            '"format": "train-harness-run/1", or config.yaml with findings.jsonl). '
            "Fix: pass the Trainer's output_dir of a run that had the harness attached."
        )
    return found, links


MESSAGE_CHARS = 600  # of a finding's message, as the HTML report's table shows it


def _say(text: str = "") -> None:
    """One line of ``explain`` on stdout: what a run directory holds is data, its control characters shown, not sent."""
    sys.stdout.write(terminal_text(text) + "\n")


def print_explain(path: Path, width: int = 100) -> int:
    """The verdict and, for each finding code, what happened and the first step of its playbook."""
    from harness.report.build import group_findings, next_step
    from harness.report.record import RunRecord
    from harness.report.verdict import symptoms_of, verdict_of

    for n, run_dir in enumerate(run_dirs_or_fail(path)):
        run = RunRecord.load(run_dir)
        if n:
            _say()
        _say(f"== {run_dir}")
        verdict = verdict_of(run)
        _say(textwrap.fill(f"Verdict: {_clip(verdict.line(), where='run.json and findings.jsonl')}", width, subsequent_indent="  "))
        for note in run.damage_notes():
            _say(textwrap.fill(f"Note: {_clip(note, where='the file it names')}", width, subsequent_indent="  "))
        groups = group_findings(run)
        explained: set[str] = set()
        for group in groups:
            _say()
            head = f"[{group.severity.value}] {group.code} x{group.count} (step {group.step_range}): {_clip(group.message)}"
            _say(textwrap.fill(head, width, subsequent_indent="    "))
            if group.code == RANK_HANG_CODE and group.code not in explained:  # the ranks' watchdogs: which one stopped first
                _say(_fill(f"stalled first: {hang_summary(group.findings, run)}", width))
            if group.code in explained:
                _say("  next: as above")
                continue
            explained.add(group.code)
            _say(_fill(f"next: {next_step(group, run.output_dir)}", width))
            if group.playbook is not None:
                _say(f"  more: harness playbook {group.code}   (playbooks/{group.playbook.link})")
        for symptom in symptoms_of(run):
            section = find_section(symptom.topic)
            _say()
            _say(textwrap.fill(f"[worth a look] {symptom.topic}: {symptom.why}", width, subsequent_indent="    "))
            if section is not None and section.next_step:
                _say(_fill(f"next: {section.next_step.replace('<output_dir>', str(run.output_dir))}", width))
                _say(f"  more: harness playbook {symptom.topic}")
        if not groups:
            _say("No findings." if run.findings_known else f"No findings could be read: {run.findings_unknown} (see the note above).")
        after = run_next_step(run, verdict.label)
        if after is not None:
            _say()
            _say(_fill(f"next: {after}", width))
    return 0


def run_next_step(run: Any, label: str) -> str | None:
    """What to do about how the last ``train()`` call ended (the findings' next steps are about what it found): for a
    call that did not end well, where to resume from; for one still training, to wait. None for a completed run."""
    from harness.report.verdict import RUNNING

    status = run.last_status
    out = shlex.quote(str(run.output_dir))
    point = f"harness resume-point {out}"
    resume = f'(names the newest proven checkpoint to resume from: --resume_from_checkpoint "$({point})")'
    if label == RUNNING:
        holder = run.lock_holder()
        pid = f" (pid {holder.pid})" if holder is not None else ""
        return f"the run is still training{pid}: run `harness explain {out}` again when it has ended."
    if status == "killed":
        return f"{point}   {resume}; the killed call's steps after that checkpoint are trained again."
    if status == INTERRUPTED:
        return f"{point}   {resume}, to go on where the interrupted call left off."
    if status == "stopped":
        return f"{point}   {resume}, once the cause of the stop (above) is dealt with."
    if status == "crashed":
        return f"{point}   {resume}, once the error is fixed."
    return None


def _clip(text: str, limit: int = MESSAGE_CHARS, where: str = "findings.jsonl") -> str:
    """At most ``limit`` characters of a text a run directory holds (the wrapping of one long word is quadratic: a
    received findings line of megabytes must not hold the terminal); the rest is in ``where``."""
    text = str(text)
    if len(text) <= limit:
        return text
    return f"{shorten(text, limit)} ({len(text):,} characters in all: the whole text is in {where})"


def _fill(text: str, width: int) -> str:
    """Wrapped at spaces only: paths and commands stay whole, so they can be copied."""
    return textwrap.fill(text, width, initial_indent="  ", subsequent_indent="        ", break_long_words=False, break_on_hyphens=False)


def print_playbook(key: str | None) -> int:
    """List the playbooks, or print one code's section / one topic."""
    books = load_library()
    if key is None:
        for book in books.values():
            kind = "topic" if book.is_topic else "codes"
            codes = "" if book.is_topic else ": " + ", ".join(s.key for s in book.sections)
            print(f"{book.name:<24} {kind:<5} {book.title}{codes}")
        print("\nharness playbook CODE prints a finding code's section; harness playbook TOPIC prints a file.")
        return 0
    section = find_section(key)
    if section is not None:
        _print_markdown(section.text)
        return 0
    book = books.get(key.lower())
    if book is not None:
        _print_markdown(book.text)
        return 0
    choices = [s.key for b in books.values() for s in b.sections] + list(books)
    raise HarnessError(
        f"no playbook for '{key}'.{did_you_mean(key.upper(), choices) or did_you_mean(key.lower(), choices)} "
        "Fix: use a finding code (harness plugins --codes) or a playbook name (harness playbook, no argument)."
    )


def _print_markdown(text: str) -> None:
    if sys.stdout.isatty():
        from rich.console import Console
        from rich.markdown import Markdown

        Console().print(Markdown(text))
    else:
        sys.stdout.write(text if text.endswith("\n") else text + "\n")
