"""A torn last line (a writer killed mid-line) never swallows the next record of any append-only file."""
from __future__ import annotations

import json
import re
from pathlib import Path
from types import SimpleNamespace
from typing import Any, Callable

import pytest

import harness
from conftest import REPO
from harness.core.findings import Finding, FindingsFile, Severity, read_findings
from harness.lib.journal import Journal
from harness.lib.ledger import LedgerWriter, iter_records, ledger_path, read_ledger

TORN = '{"attempt": 1, "step": 7, "micro_batch": 0, "sample_ha'  # what a kill -9 in the middle of a write leaves


def _tear(path: Path, text: str = TORN) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a", encoding="utf-8") as handle:  # a killed writer's last line: no newline
        handle.write(text)


def _intact(path: Path) -> list[dict[str, Any]]:
    """Every line that parses, the way the harness's readers see the file (the torn line itself is skipped)."""
    out = []
    for line in path.read_text(encoding="utf-8").splitlines():
        try:
            out.append(json.loads(line))
        except ValueError:
            continue
    return out


def _findings(tmp: Path) -> tuple[Path, list[Any]]:
    path = tmp / "findings.jsonl"
    FindingsFile(path).append(Finding("A", Severity.INFO, "p", "before"))
    _tear(path)
    appender = FindingsFile(path)
    appender.append(Finding("B", Severity.WARNING, "p", "after the kill"))
    appender.close()
    assert [f.code for f in read_findings(path)] == ["A", "B"]
    return path, [r["code"] for r in _intact(path)]


def _journal(tmp: Path) -> tuple[Path, list[Any]]:
    path = tmp / "outbox.jsonl"
    Journal(path).append([{"n": 1}])
    _tear(path)
    journal = Journal(path)
    journal.append([{"n": 2}])
    journal.close()
    records, _ = journal.read(0, 10)
    assert records == [{"n": 1}, {"n": 2}]
    return path, [r["n"] for r in _intact(path)]


def _ledger(tmp: Path) -> tuple[Path, list[Any]]:
    first = LedgerWriter(tmp, 0)
    first.start(0, 1, None)
    first.write_step([{"step": 1, "micro_batch": 0, "epoch": 0, "batch_hash": "0", "sample_hashes": ["0"], "sample_ids": None}])
    first.close()
    path = ledger_path(tmp, 0)
    _tear(path)
    second = LedgerWriter(tmp, 0)
    second.start(1, 1, "checkpoint-1")
    second.close()
    assert [(r.get("event"), r["attempt"]) for r in iter_records(path)] == [("start", 1), (None, 1), ("start", 2)]
    return path, [(r.get("event"), r["attempt"]) for r in _intact(path)]


def _metrics_log(name: str) -> Callable[[Path], tuple[Path, list[Any]]]:
    def run(tmp: Path) -> tuple[Path, list[Any]]:
        from harness.plugins.metrics_log import MetricsLog

        ctx = SimpleNamespace(is_main=True, world_size=1, path=lambda *parts: tmp.joinpath(*parts))
        path = tmp / name
        _tear(path)
        plugin = MetricsLog()
        plugin.on_run_start(ctx=ctx)
        plugin.on_step_end(ctx=ctx, step=1, metrics={"loss": 1.0, "tokens": 3})
        plugin.on_log(ctx=ctx, step=1, logs={"loss": 1.0})
        plugin.on_run_end(ctx=ctx)
        return path, [r["step"] for r in _intact(path)]

    return run


def _line_appender(tmp: Path) -> tuple[Path, list[Any]]:
    from harness.core.appendfile import LineAppender

    path = tmp / "any.jsonl"
    _tear(path)
    first = LineAppender(path)
    first.write('{"n": 1}\n')
    first.close()
    second = LineAppender(path)  # a file that ends well gets no blank line
    second.write('{"n": 2}\n')
    second.close()
    assert path.read_text().splitlines() == [TORN, '{"n": 1}', '{"n": 2}']
    return path, [r["n"] for r in _intact(path)]


APPENDERS = {
    "findings": (_findings, ["A", "B"]),
    "journal": (_journal, [1, 2]),
    "ledger": (_ledger, [("start", 1), (None, 1), ("start", 2)]),
    "metrics.jsonl": (_metrics_log("metrics.jsonl"), [1]),
    "steps.jsonl": (_metrics_log("steps.jsonl"), [1]),
    "LineAppender": (_line_appender, [1, 2]),
}


@pytest.mark.parametrize("name", list(APPENDERS))
def test_appenders_start_on_a_fresh_line_after_a_torn_line(name: str, tmp_path: Path) -> None:
    make, expected = APPENDERS[name]
    path, records = make(tmp_path)
    assert records == expected  # the first record after the kill is on a line of its own, readable
    assert TORN in path.read_text().splitlines()  # the fragment stays, alone on its line (readers skip it)


def test_no_appender_opens_a_file_for_append_directly() -> None:
    """Every append-only file of the harness goes through ``LineAppender`` (the grep of item 5, kept true): never a torn
    line glued to a record, never a full disk raised into training."""
    pattern = re.compile(r"""open\([^)]*["'](a|ab|a\+)["']|O_APPEND""")
    offenders = [
        f"{path.relative_to(REPO)}:{n}"
        for folder in ("harness", "plugins", "stages")
        for path in sorted((REPO / folder).rglob("*.py"))
        if path.name != "appendfile.py"
        for n, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1)
        if pattern.search(line)
    ]
    assert offenders == []


def test_a_resume_after_torn_lines_keeps_its_first_finding_and_numbers_its_attempts(make_trainer: Any, lm_rows: Any, tmp_path: Path) -> None:
    """Killed mid-line twice: each resumed run's first finding and ledger start line are readable, attempts 1, 2, 3."""
    out = tmp_path / "run"
    run_dir = out / "harness"
    first = make_trainer(output_dir=out, max_steps=5, save_strategy="steps", save_steps=5)
    harness.attach(first)
    first.train()
    made: list[list[str]] = []
    for _ in range(2):
        _tear(run_dir / "findings.jsonl", '{"code": "LOSS_SPIKE", "id": "0123456789abcdef", "mess')
        _tear(ledger_path(run_dir, 0))
        resumed = make_trainer(output_dir=out, max_steps=7, train_dataset=lm_rows.select(range(48)))  # changed data: a finding
        ctx = harness.attach(resumed)
        resumed.train(resume_from_checkpoint=str(out / "checkpoint-5"))
        made.append([f.id for f in ctx.findings])
        assert "RESUME_DATA_CHANGED" in [f.code for f in ctx.findings]
    on_disk = [f.id for f in read_findings(run_dir / "findings.jsonl")]
    for ids in made:
        assert ids and set(ids) <= set(on_disk)  # the first finding after each kill included
    starts = [r for r in iter_records(ledger_path(run_dir, 0)) if r.get("event") == "start"]
    assert [(s["attempt"], s["step"]) for s in starts] == [(1, 0), (2, 5), (3, 5)]
    ledger = read_ledger(out)
    assert sorted(ledger["attempt"].unique()) == [1, 2, 3]
    assert ledger.groupby("attempt")["step"].apply(lambda s: sorted(set(s))).to_dict() == {1: [1, 2, 3, 4, 5], 2: [6, 7], 3: [6, 7]}
    assert ledger[ledger["attempt"] == 2]["superseded"].all() and not ledger[ledger["attempt"] == 3]["superseded"].any()
