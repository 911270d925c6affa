"""`harness demo`: the embedded default runs end to end and names every injected fault."""
from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from cli_in_process import harness_in_process
from conftest import broken_report_links, findings_of, harness_cli, read_jsonl
from harness.lib.playbook import find_section


@pytest.mark.slow  # a long end-to-end run (subprocesses or hundreds of steps): CI runs it, the quick subset does not
def test_demo_names_each_injected_fault(tmp_path: Path, capsys: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    out = tmp_path / "demo"
    result = harness_cli("demo", "--out", str(out))
    assert result.returncode == 0, result.stderr[-3000:]
    summary = result.stdout[result.stdout.index("harness demo: finished"):]
    faults = ("makes the loss non-finite", "made infinite", "replaced by random tokens", "is masked (-100)", "kills itself (SIGKILL)", "(divergence)",
              "a padding collator instead", "holds a NaN sample")
    for fault in faults:
        assert fault in summary
    assert "harness skipped the optimizer update at step 8 after NONFINITE_LOSS" in summary
    assert "mlflow ui --backend-store-uri sqlite:///" in summary
    injected = sorted(f["evidence"]["fault"] for f in findings_of(out, "DEMO_FAULT"))
    assert injected == ["all_labels_masked", "corrupted_batch", "corrupted_batch", "crash", "divergence", "lr_advanced_on_skip", "nan_batch", "nonfinite_grad",
                        "nonfinite_loss", "padding_collator"]
    assert (out / "model.safetensors").exists()  # the resumed run finished
    # the detectors caught what was injected, at the injected steps
    assert [f["step"] for f in findings_of(out, "NONFINITE_LOSS") if f["step"] in (8, 14)] == [8, 14]
    # the rerun verdicts: the one-shot NaN (8) and infinite gradients (11) are transient, the NaN sample (14) and the corrupted batch (31) reproduce
    assert [f["step"] for f in findings_of(out, "FAULT_TRANSIENT")] == [8, 11]
    reproduced = [f["step"] for f in findings_of(out, "FAULT_REPRODUCED")]
    assert 14 in reproduced and 31 in reproduced and findings_of(out, "FAULT_RANK_SUSPECT") == []
    (grad,) = findings_of(out, "NONFINITE_GRAD")
    assert grad["step"] == 11 and grad["action"] == "skip_step"
    (masked,) = findings_of(out, "ALL_LABELS_MASKED")
    assert masked["step"] == 17
    # the padding collator's batch (its loss on labelled padding is far above the baseline: no warm-up grace hides step 20 any more),
    # the corrupted batch (met again by the resumed run, which replays step 31), then the blown-up LR
    assert [f["step"] for f in findings_of(out, "LOSS_SPIKE")] == [20, 31, 31, 47]
    assert [f["code"] for f in findings_of(out) if f["code"].startswith(("RESUME_", "DATA_"))] == []  # the resume itself was right
    spike = findings_of(out, "LOSS_SPIKE")[1]  # the corrupted batch of step 31
    capture_dir = Path(spike["evidence"]["capture"]).parent
    assert f"harness replay {capture_dir}" in summary
    # on checkpoint-30, the weights the spike was computed with (the CLI in this process: tests/plugins/test_spike_capture.py runs
    # `harness replay` as a subprocess)
    replayed = harness_in_process(capsys, monkeypatch, "replay", str(capture_dir))
    assert replayed.returncode == 0 and "reproduced: every per-sample loss" in replayed.stdout, replayed.stdout[-2000:]
    (divergence,) = findings_of(out, "LOSS_DIVERGENCE")
    assert divergence["evidence"]["since_step"] == 47
    # the spike of step 47 names the LR the harness found at 46 before the resume 17 steps earlier; the loss then went over
    # ln(vocab), where the run started, and never came back
    lr_spike = findings_of(out, "LOSS_SPIKE")[3]
    assert [c["code"] for c in lr_spike["evidence"]["earlier_findings"]] == ["LR_SCHEDULE_MISMATCH"] and lr_spike["evidence"]["after_resume"]
    assert "suspect the checkpoint restore first" not in lr_spike["message"]
    assert [f["step"] for f in findings_of(out, "LOSS_ABOVE_START")] == [48]
    assert [f["step"] for f in findings_of(out, "LOSS_NOT_RECOVERED")] == [60]
    # the skipped steps of the killed process were carried through the checkpoint into the run-end summary
    (summary,) = findings_of(out, "SKIPPED_STEPS")
    assert summary["evidence"]["skipped_steps"] == [8, 11, 14] and summary["evidence"]["scheduler_advanced"] == [11]
    # the scheduler stepped on the skipped step 11; the 300x LR from step 46 is not the schedule
    assert [(f["code"], f["step"]) for f in findings_of(out) if f["code"].startswith("LR_")] == [
        ("LR_ADVANCED_ON_SKIPPED_STEP", 11), ("LR_SCHEDULE_MISMATCH", 46)]
    # the resume done wrong: optimizer.pt deleted and ignore_data_skip, from checkpoint-30 again
    broken = out / "broken-resume"
    wrong = {f["code"]: f for f in findings_of(broken)}
    for code in ("RESUME_OPTIMIZER_NOT_RESTORED", "RESUME_SCHEDULER_MISMATCH", "RESUME_DATA_POSITION", "DATA_REPEATED", "DATA_SKIPPED"):
        assert code in wrong, code
    assert wrong["RESUME_DATA_POSITION"]["step"] == 31 and wrong["RESUME_DATA_POSITION"]["plugin"] == "resume_check"
    assert not (broken / "checkpoint-40").exists()  # it stopped before training on
    assert "the resume done wrong" in result.stdout
    # the padding collator's batch: documents see each other and padding is trained on; the stage's own packing is clean
    verdicts = {r["step"]: r["verdict"] for r in read_jsonl(out / "harness" / "packing_check.jsonl")}
    assert verdicts[1] == "separate" and verdicts[20] == "leak" and verdicts[40] == "separate"
    (leak,) = findings_of(out, "PACKING_CROSS_DOC_ATTENTION")
    assert leak["step"] == 20 and leak["severity"] == "error" and "2D attention_mask" in leak["message"]
    (labels,) = findings_of(out, "PACKING_LOSS_ON_PADDING")
    assert labels["step"] == 20 and labels["evidence"]["boundary_labels"] > 0 and labels["evidence"]["labelled_padding"] > 0
    # two DDP processes: the drifted weight at the first check after step 7, the wrong gradient at step 15, each once
    desync = out / "desync"
    assert [(f["code"], f["step"]) for f in findings_of(desync) if f["code"].endswith("_DESYNC")] == [("PARAM_DESYNC", 10), ("GRAD_DESYNC", 15)]
    assert "the data-parallel replicas that drift apart" in result.stdout
    # the contaminated eval set: lines of the training corpus are found in training batches, made-up questions never
    leaks = findings_of(out, "CONTAMINATION")
    assert leaks and all(f["evidence"]["example_id"].startswith("leaked-") for f in leaks)
    dirty = (out / "harness" / "contamination" / "dirty_ids.rank-0.txt").read_text()
    assert "leaked-" in dirty and "made-up" not in dirty
    # every run ends with a report whose findings link to their own playbook section, and explain names the next step
    for run in (out, broken, desync):
        assert f"{run / 'harness' / 'report.html'}" in result.stdout
        assert broken_report_links(run / "harness") == [], run
        report = (run / "harness" / "report.md").read_text(encoding="utf-8")
        for code in {f["code"] for f in findings_of(run)}:
            section = find_section(code)
            assert f"| [{code}](report/playbooks/{section.link}) |" in report, (run, code)
    assert "**Verdict: needs attention.**" in (out / "harness" / "report.md").read_text(encoding="utf-8")
    assert "**Verdict: failed.** the harness stopped training at step 31 after RESUME_DATA_POSITION" in (broken / "harness" / "report.md").read_text(encoding="utf-8")
    main_report = (out / "harness" / "report.md").read_text(encoding="utf-8")
    for section in ("## Captured batches", "## Packing experiments (packing_check)", "## Contamination", "![Loss per token processed](report/plots/loss.png)"):
        assert section in main_report, section
    assert "| demo_quiz | 50 |" in main_report and "## Replica consistency (grad_sync)" in (desync / "harness" / "report.md").read_text(encoding="utf-8")
    assert f"harness explain {out}" in result.stdout
    explained = harness_in_process(capsys, monkeypatch, "explain", str(out))
    assert explained.returncode == 0, explained.stderr[-2000:]
    for run in (out, broken, desync):
        block = explained.stdout[explained.stdout.index(f"== {run / 'harness'}"):]
        block = block.split("\n== ", 1)[0]
        for code in {f["code"] for f in findings_of(run)}:
            next_step = " ".join(find_section(code).next_step.replace("<output_dir>", str(run)).split()).split("<")[0][:60]
            assert f"] {code} x" in block and "next: " + next_step in " ".join(block.split()), (run, code)
    _poisoned_runs_stay_inert(out, tmp_path / "poisoned", capsys, monkeypatch)


PAYLOAD = "<script>alert(1)</script>[l](http://evil.example/a) ![i](http://evil.example/i.png) <http://evil.example/b>"
STRUCTURAL = {"code", "severity", "plugin", "action", "id"}  # kept: a finding without them is skipped, not shown


def _poisoned(value: Any) -> Any:
    if isinstance(value, str):
        return PAYLOAD
    if isinstance(value, list):
        return [_poisoned(v) for v in value]
    if isinstance(value, dict):
        return {k: v if k in STRUCTURAL else _poisoned(v) for k, v in value.items()}
    return value


def _poisoned_runs_stay_inert(out: Path, copies: Path, capsys: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """Issue 44 item 7: every string value of every JSON and JSONL file of the demo's three runs (findings, steps,
    run.json, captures, ledger, contamination, packing and grad_sync records ...) replaced by a markdown and HTML
    payload: every section of report.md and report.html shows it as text, with no tag and no live link, and explain
    prints it without a control sequence."""
    import json
    import shutil

    from markdown_it import MarkdownIt

    permissive = MarkdownIt("commonmark", {"html": True}).enable("table")  # renders raw HTML, as some viewers do
    for run in (out, out / "broken-resume", out / "desync"):
        harness_dir = copies / run.name / "harness"
        shutil.copytree(run / "harness", harness_dir, ignore=shutil.ignore_patterns("mlflow", "report", "report.*"))
        files = [*harness_dir.rglob("*.json"), *harness_dir.rglob("*.jsonl")]
        for path in files:
            text = path.read_text(encoding="utf-8")
            if path.suffix == ".json":
                path.write_text(json.dumps(_poisoned(json.loads(text))), encoding="utf-8")
            else:
                lines = [_poisoned(json.loads(line)) for line in text.splitlines() if line.strip()]
                path.write_text("".join(json.dumps(v) + "\n" for v in lines), encoding="utf-8")
        assert len(files) > 5, files
        reported = harness_in_process(capsys, monkeypatch, "report", str(harness_dir.parent), "--no-plots")
        assert reported.returncode == 0, reported.stderr[-2000:]
        html = (harness_dir / "report.html").read_text(encoding="utf-8")
        markdown = permissive.render((harness_dir / "report.md").read_text(encoding="utf-8"))
        for text in (html, markdown):
            assert "alert(1)" in text  # shown, as text
            assert "<script" not in text and 'href="http' not in text and 'src="http' not in text, run
        explained = harness_in_process(capsys, monkeypatch, "explain", str(harness_dir.parent))
        assert explained.returncode == 0 and "\x1b" not in explained.stdout, explained.stderr[-2000:]


def test_every_demo_fault_is_documented_at_its_step() -> None:
    """The demo's faults as it injects them (``DEMO_FAULTS``, and the ``evidence.fault`` values of its plugin) against
    playbooks/demo.md (the list of values, a table row per step) and the README's paragraph (each step named). The
    NaN sample of step 14 was once injected and tested but named in neither."""
    import re

    from conftest import REPO
    from harness.stages.demo.run import DEMO_FAULTS

    source = (REPO / "stages" / "demo" / "faults.py").read_text(encoding="utf-8")
    values = set(re.findall(r'evidence=\{"fault": "(\w+)"\}', source))
    assert len(values) >= 9, values  # the pattern still reads the plugin
    playbook = (REPO / "playbooks" / "demo.md").read_text(encoding="utf-8")
    listed = re.findall(r"^- `(\w+)`: ", playbook, flags=re.MULTILINE)
    assert sorted(listed) == sorted(values), f"playbooks/demo.md lists {listed}, the plugin injects {sorted(values)}"
    rows = {int(m.group(1)): m.group(2) for m in re.finditer(r"^\| (\d+) \| ([^|]+)\|", playbook, flags=re.MULTILINE)}
    steps = {key: step for key, step in DEMO_FAULTS.items() if key.endswith("_step")}
    for key, step in steps.items():
        assert step in rows, f"playbooks/demo.md has no table row for step {step} ({key})"
    assert sorted(rows) == sorted(set(steps.values())), f"the table's steps {sorted(rows)}, the demo's {sorted(set(steps.values()))}"
    readme = " ".join((REPO / "README.md").read_text(encoding="utf-8").split())
    paragraph = readme[readme.index("`harness demo [--out DIR]` pretrains"):readme.index("## Three ways in")]
    for step in set(steps.values()):
        assert re.search(rf"\bstep {step}\b", paragraph), f"the README's demo paragraph does not name step {step}"
