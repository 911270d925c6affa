"""Run directories received from others are data: `harness report`/`explain` import nothing they name, write nothing
through their symlinks, rebuild only real run directories, survive damaged lines, can write elsewhere, and escape text."""
from __future__ import annotations

import json
from collections import Counter
import os
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from conftest import REPO, broken_report_links, harness_cli
from handmade_runs import finding_record as _finding, make_run

EVIL = "http://evil.example/x"
SCRIPT = "<script>alert(1)</script>"


def snapshot(folder: Path) -> dict[str, tuple[float, int, bytes | str]]:
    """Every entry below ``folder`` (links not followed): mtime, mode and content (or link target)."""
    found = {}
    for path in sorted(folder.rglob("*")):
        st = path.lstat()
        content: bytes | str = os.readlink(path) if path.is_symlink() else path.read_bytes() if path.is_file() else b""
        found[str(path.relative_to(folder))] = (st.st_mtime_ns, st.st_mode, content)
    return found


# -- 2: nothing a run directory names is imported -------------------------------------------------------------------

EVILMOD = """
import pathlib
pathlib.Path({marker!r}).write_text("imported from " + __file__)

class Evil:
    name = "evil"
"""


def test_report_imports_nothing_from_run_dir(tmp_path: Path) -> None:
    received = tmp_path / "received"
    out = received / "out"
    run_dir = make_run(out, plugins=["metrics_log", "evil", "evilmod:Evil", "inner_evil:Evil"],
                       run_json={"plugin_classes": {"evil": "evilmod:Evil", "metrics_log": "evilmod:Evil"}})
    marker = tmp_path / "PWNED"
    for folder in (received, out, run_dir):  # beside the run, inside it, and in the working directory
        (folder / "evilmod.py").write_text(EVILMOD.format(marker=str(marker)), encoding="utf-8")
    (run_dir / "inner_evil.py").write_text(EVILMOD.format(marker=str(marker)), encoding="utf-8")
    (received / "matplotlibrc").write_text("backend: module://evilmod\n", encoding="utf-8")  # cwd rc file: no backend import
    (run_dir / "captures" / "step-2").mkdir(parents=True)
    (run_dir / "captures" / "step-2" / "capture.rank-0.json").write_text(json.dumps(
        {"code": "NONFINITE_LOSS", "step": 2, "rank": 0, "reason": "nan", "weights_from_step": 1, "samples": [], "model": {}}))
    import torch

    torch.save({"rng": {}, "micro_batch_index": [], "micro_batches": []}, run_dir / "captures" / "step-2" / "batch.rank-0.pt")
    checkpoint = out / "checkpoint-1"
    checkpoint.mkdir()
    (checkpoint / "config.json").write_text(json.dumps({"model_type": "evilmod", "architectures": ["Evil"],
                                                         "auto_map": {"AutoConfig": "evilmod.Evil", "AutoModelForCausalLM": "evilmod.Evil"}}))
    # on the path: the working directory and the run directory itself (not `out`: a folder named harness there
    # would shadow the installed package for any program, which is no matter of the report's)
    env = {"PYTHONPATH": os.pathsep.join([str(received), str(run_dir), os.environ.get("PYTHONPATH", "")])}
    report = harness_cli("report", "out", env=env, cwd=received)
    assert report.returncode == 0, report.stderr[-3000:]
    assert not marker.exists(), marker.read_text()
    markdown = (run_dir / "report.md").read_text(encoding="utf-8")
    assert "plugin 'evil' (evilmod:Evil) is not installed here: its section is left out" in markdown
    assert "plugin 'evilmod:Evil' is a class path from the run's config.yaml" in markdown
    assert "plugin 'inner\\_evil:Evil'" in markdown or "plugin 'inner_evil:Evil'" in markdown
    explain = harness_cli("explain", "out", env=env, cwd=received)
    assert explain.returncode == 0 and "NONFINITE_LOSS" in explain.stdout, explain.stderr[-3000:]
    assert not marker.exists()
    replay = harness_cli("replay", str(run_dir / "captures" / "step-2"), env=env, cwd=received)
    assert not marker.exists(), replay.stderr[-3000:]  # the checkpoint's auto_map names code: never run without trust
    assert replay.returncode != 0 and "Traceback" not in replay.stderr, replay.stderr[-3000:]


# -- 3: never write or delete through a symlink ------------------------------------------------------------------------

@pytest.mark.parametrize("case", ["report_folder", "playbook_file", "report_md", "nested_run"])
def test_report_never_writes_through_symlinks(tmp_path: Path, case: str) -> None:
    victim = tmp_path / "victim"
    (victim / "plots").mkdir(parents=True)
    (victim / "plots" / "fig1.pdf").write_bytes(b"%PDF precious")
    (victim / "notes.md").write_text("precious notes\n", encoding="utf-8")
    project = tmp_path / "proj"
    run_dir = make_run(project / "a" if case == "nested_run" else project)
    if case == "report_folder":
        (run_dir / "report").symlink_to(victim, target_is_directory=True)
        link = run_dir / "report"
    elif case == "playbook_file":
        (run_dir / "report" / "playbooks").mkdir(parents=True)
        (run_dir / "report" / "playbooks" / "data.md").symlink_to(victim / "notes.md")
        link = run_dir / "report" / "playbooks" / "data.md"
    elif case == "report_md":
        (run_dir / "report.md").symlink_to(victim / "notes.md")
        link = run_dir / "report.md"
    else:  # another run, reached through a link in the tree the nested-run search walks
        other = make_run(victim / "other")
        (project / "b").symlink_to(victim / "other", target_is_directory=True)
        link = project / "b"
    before = snapshot(victim)
    result = harness_cli("report", str(project))
    assert snapshot(victim) == before  # nothing deleted, nothing written there
    assert link.is_symlink()  # and the link itself is left as it was
    if case == "nested_run":
        # a link met while searching for runs (`runs/latest -> runs/2024-...`) is a note, not a failure, once a real
        # run was rebuilt; the run it points to is not rebuilt (nor read)
        assert result.returncode == 0, (result.stdout, result.stderr[-3000:])
        assert f"not followed: {link} is a symbolic link" in result.stderr, result.stderr[-3000:]
        assert not (other / "report.md").exists()
        assert (run_dir / "report.md").is_file() and str(run_dir) in result.stdout  # the real run below proj is rebuilt
        only_links = tmp_path / "only_links"
        only_links.mkdir()
        (only_links / "latest").symlink_to(victim / "other", target_is_directory=True)
        alone = harness_cli("report", str(only_links))  # no real run found at all, only a link: exit 2
        assert alone.returncode == 2, (alone.stdout, alone.stderr[-3000:])
        assert "no harness run directory" in alone.stderr and f"not followed: {only_links / 'latest'}" in alone.stderr
        assert snapshot(victim) == before
    else:  # a write target inside the run being rebuilt is a link: refused, exit 2
        assert result.returncode == 2, (result.stdout, result.stderr[-3000:])
        assert str(link) in result.stderr and "symlink" in result.stderr, result.stderr[-3000:]
        assert not (run_dir / "report.html").exists() or case == "report_md"  # refused before the first write


# -- 4: only a real run directory is rebuilt ---------------------------------------------------------------------------

def test_report_refuses_a_folder_that_is_not_a_run(tmp_path: Path) -> None:
    project = tmp_path / "proj"
    (project / "report" / "plots").mkdir(parents=True)
    (project / "report" / "plots" / "fig1.pdf").write_bytes(b"%PDF the user's figure")
    (project / "report.md").write_text("# my own notes\n", encoding="utf-8")
    (project / "run.json").write_text(json.dumps({"attempts": [], "experiment": "mine"}), encoding="utf-8")
    (project / "findings.jsonl").write_text(json.dumps({"finding": "my own"}) + "\n", encoding="utf-8")
    before = snapshot(project)
    for command in ("report", "explain"):
        result = harness_cli(command, str(project))
        assert result.returncode == 2, (command, result.stdout, result.stderr)
        assert "is not a train-harness run directory" in result.stderr and "Fix:" in result.stderr, result.stderr
    assert snapshot(project) == before
    # a folder named harness with a run.json and config.yaml that are not the harness's: refused too
    named = tmp_path / "other" / "harness"
    named.mkdir(parents=True)
    (named / "run.json").write_text(json.dumps({"attempts": [{"name": "x"}]}), encoding="utf-8")
    (named / "config.yaml").write_text("lr: 0.1\n", encoding="utf-8")
    (named / "report.md").write_text("mine\n", encoding="utf-8")
    assert harness_cli("report", str(tmp_path / "other")).returncode == 2
    assert (named / "report.md").read_text() == "mine\n"
    # a run this harness wrote before run.json had its marker is still rebuilt; a marked one anywhere is
    old = make_run(tmp_path / "old")
    info = json.loads((old / "run.json").read_text())
    del info["format"]
    (old / "run.json").write_text(json.dumps(info), encoding="utf-8")
    assert harness_cli("report", str(tmp_path / "old")).returncode == 0 and (old / "report.md").is_file()
    from harness.lib.runinfo import RUN_FORMAT, read_run_info, write_run_info

    write_run_info(tmp_path, {"attempts": []})
    assert read_run_info(tmp_path)["format"] == RUN_FORMAT  # what training writes carries the marker


# -- 14: damaged lines cost themselves, not the report ----------------------------------------------------------------

DAMAGE = {
    "step_as_string": json.dumps(_finding(step="7", id="bad00001")),
    "evidence_as_list": json.dumps(_finding(evidence=["a", "b"], id="bad00002")),
    "rank_as_string": json.dumps(_finding(rank="1", id="bad00003")),
    "non_utf8_byte": b'{"code": "NONFINITE_LOSS", "message": "\xff\xfe"}',
    "plugins_not_a_list": None,
}


@pytest.mark.parametrize("case", list(DAMAGE))
def test_report_survives_damaged_lines(tmp_path: Path, case: str) -> None:
    out = tmp_path / "run"
    run_dir = make_run(out, findings=[_finding(), _finding(step=3, id="good0002")])
    bad = DAMAGE[case]
    if case == "plugins_not_a_list":
        (run_dir / "config.yaml").write_text("plugins: 5\nmax_plugin_errors: 10\n", encoding="utf-8")
        expected = "config.yaml: 'plugins' is not a list of names (got 5)"
    else:
        raw = bad if isinstance(bad, bytes) else bad.encode("utf-8")
        with open(run_dir / "findings.jsonl", "ab") as handle:
            handle.write(raw + b"\n")
        if case == "non_utf8_byte":
            with open(run_dir / "steps.jsonl", "ab") as handle:
                handle.write(b'{"step": 9, "loss": "\xff"}\n')
        expected = "1 line of findings.jsonl could not be read and was skipped"
    report = harness_cli("report", str(out), "--no-plots")
    assert report.returncode == 0, report.stderr[-3000:]
    markdown = (run_dir / "report.md").read_text(encoding="utf-8")
    assert expected in markdown and expected in report.stdout
    assert "| NONFINITE_LOSS" in markdown.replace("[NONFINITE_LOSS]", "NONFINITE_LOSS") and "| 2 | 2-3 | 0 |" in markdown
    if case == "non_utf8_byte":
        assert "1 line of steps.jsonl could not be read and was skipped" in markdown
    explain = harness_cli("explain", str(out))
    assert explain.returncode == 0, explain.stderr[-3000:]
    assert "NONFINITE_LOSS x2 (step 2-3)" in explain.stdout and " ".join(expected.split()) in " ".join(explain.stdout.split())


def test_explain_shows_a_huge_message_cut_and_at_once(tmp_path: Path) -> None:
    """A received findings line with a message of megabytes, one unbroken word: explain cuts it (wrapping it whole took
    minutes) and says where the rest is; the report reads the same directory."""
    out = tmp_path / "run"
    make_run(out, findings=[_finding(message="A" * 4_000_000)])
    explain = harness_cli("explain", str(out), timeout=60)
    assert explain.returncode == 0, explain.stderr[-3000:]
    assert "(4,000,000 characters in all: the whole text is in findings.jsonl)" in " ".join(explain.stdout.split())
    assert len(explain.stdout) < 10_000, len(explain.stdout)


# -- 15: --out for a read-only run directory ---------------------------------------------------------------------------

def _run_with_capture(out: Path) -> Path:
    run_dir = make_run(out, findings=[_finding(evidence={"capture": "captures/step-2/capture.rank-0.json"})])
    capture = run_dir / "captures" / "step-2"
    capture.mkdir(parents=True)
    (capture / "capture.rank-0.json").write_text(json.dumps({"code": "NONFINITE_LOSS", "step": 2, "rank": 0, "reason": "nan",
                                                             "samples": [{"sample_id": 7, "loss": "nan"}]}))
    return run_dir


def test_report_out_writes_elsewhere_for_readonly_run(tmp_path: Path) -> None:
    out = tmp_path / "run"
    run_dir = _run_with_capture(out)
    for path in [out, *out.rglob("*")]:
        path.chmod(0o555 if path.is_dir() else 0o444)
    try:
        before = snapshot(out)
        target = tmp_path / "elsewhere"
        result = harness_cli("report", str(out), "--out", str(target))
        assert result.returncode == 0, result.stderr[-3000:]
        assert snapshot(out) == before  # as root a chmod stops nothing: prove that nothing under the run dir changed
        assert (target / "report.md").is_file() and (target / "report.html").is_file() and (target / "report" / "playbooks").is_dir()
        assert str(target / "report.md") in result.stdout
        markdown = (target / "report.md").read_text(encoding="utf-8")
        assert "../run/harness/captures/step-2/capture.rank-0.json" in markdown  # links point back into the run
        assert broken_report_links(target) == []
    finally:
        for path in [out, *out.rglob("*")]:
            path.chmod(0o755 if path.is_dir() else 0o644)


def test_report_on_an_unwritable_run_dir_suggests_out(tmp_path: Path) -> None:
    """A run directory that cannot be written: a clear message naming --out, not a traceback.

    As root, permissions stop nothing, so the run directory is made a read-only mount for the command alone (a mount
    namespace of its own: ``unshare -m``), the case of a run directory on a read-only share; as another user a
    read-only folder does it.
    """
    out = tmp_path / "run"
    run_dir = make_run(out)
    command = [sys.executable, "-m", "harness.cli", "report", str(out), "--no-plots"]
    if os.geteuid() == 0:
        if shutil.which("unshare") is None:
            pytest.skip("root without unshare: no way to make a folder read-only for root here")
        script = 'mount --bind -o ro "$1" "$1" || exit 99; shift; exec "$@"'
        command = ["unshare", "-m", "--propagation", "private", "sh", "-c", script, "sh", str(out), *command]
    else:
        for path in [out, *out.rglob("*")]:
            path.chmod(0o555 if path.is_dir() else 0o444)
    try:
        result = subprocess.run(command, capture_output=True, text=True, cwd=str(REPO), timeout=300)
    finally:
        for path in [out, *out.rglob("*")]:
            path.chmod(0o755 if path.is_dir() else 0o644)
    if result.returncode == 99:
        pytest.skip(f"a read-only bind mount is not allowed here: {result.stderr.strip()}")
    assert result.returncode == 2, (result.stdout, result.stderr[-3000:])
    assert "not writable" in result.stderr and "--out DIR" in result.stderr and "Traceback" not in result.stderr, result.stderr
    assert not (run_dir / "report.md").exists()


@pytest.mark.parametrize("case", ["html_is_a_folder", "report_is_a_file"])
def test_report_that_cannot_be_written_suggests_out(tmp_path: Path, case: str) -> None:
    """A write that fails for real (for root too, where os.access says yes): exit 2 with the --out hint, no traceback."""
    project = tmp_path / "proj"
    broken = make_run(project / "a")
    fine = make_run(project / "b")
    if case == "html_is_a_folder":  # renaming the new report.html over it fails: IsADirectoryError
        (broken / "report.html").mkdir()
        (broken / "report.html" / "keep.txt").write_text("mine\n", encoding="utf-8")
    else:  # report/plots cannot be made: NotADirectoryError
        (broken / "report").write_text("a file where the report's folder goes\n", encoding="utf-8")
    result = harness_cli("report", str(project), "--no-plots")
    assert result.returncode == 2, (result.stdout, result.stderr[-3000:])
    assert "Traceback" not in result.stderr, result.stderr[-3000:]
    assert f"the run directory '{broken}' is not writable here" in result.stderr, result.stderr[-3000:]
    assert f"`harness report {broken.parent} --out DIR`" in result.stderr, result.stderr[-3000:]
    assert (fine / "report.html").is_file() and str(fine) in result.stdout  # the other run is still rebuilt
    if case == "html_is_a_folder":
        assert (broken / "report.html" / "keep.txt").read_text(encoding="utf-8") == "mine\n"
        assert not list(broken.glob(".report.html.*.tmp"))  # the temporary file is cleaned up
        elsewhere = harness_cli("report", str(broken.parent), "--out", str(tmp_path / "elsewhere"), "--no-plots")
        assert elsewhere.returncode == 0 and (tmp_path / "elsewhere" / "report.html").is_file(), elsewhere.stderr[-3000:]
    else:
        assert (broken / "report").is_file() and not (broken / "report.md").exists()  # failed before the report files
    explain = harness_cli("explain", str(project))  # reads only: not affected
    assert explain.returncode == 0 and "NONFINITE_LOSS" in explain.stdout, explain.stderr[-3000:]


# -- text from training data is escaped everywhere ---------------------------------------------------------------------

def test_report_escapes_text_from_training_data(tmp_path: Path) -> None:
    from markdown_it import MarkdownIt

    from harness.lib.capture import _markdown

    evil = f"[click me]({EVIL}) {SCRIPT} ![img]({EVIL}.png) <{EVIL}>"
    out = tmp_path / "run"
    run_dir = make_run(out, plugins=["contamination", "grad_sync"], findings=[
        _finding(message=f"loss was nan on {evil}", evidence={f"[ev]({EVIL})": "captures/step-2/capture.rank-0.json"}),
        _finding(code=f"[X]({EVIL})", id="weird001", playbook=None, action=SCRIPT)])
    capture = run_dir / "captures" / "step-2"
    capture.mkdir(parents=True)
    sample = {"text": evil, "loss": 9.5, "micro_batch": 0, "row": 1, "sample_id": f"[id]({EVIL})", "repetition": 0.0,
              "nonprintable_ratio": 0.0, "replacement_ratio": 0.0, "length_tokens": 12}
    meta = {"code": "NONFINITE_LOSS", "step": 2, "rank": 0, "reason": f"nan on {evil}", "per_sample_loss": "recomputed",
            "directory": str(capture), "samples": [sample]}
    (capture / "capture.rank-0.json").write_text(json.dumps(meta))
    (capture / "summary.rank-0.md").write_text(_markdown(meta, [sample]), encoding="utf-8")  # what the capture writes
    contamination = run_dir / "contamination"
    contamination.mkdir()
    (contamination / "summary.rank-0.json").write_text(json.dumps({
        "checked_tokens": 100, "eval_sets": {f"set {SCRIPT}": {"dirty": 1}},
        "examples": [{"eval_set": f"set {SCRIPT}", "id": f"[eval id]({EVIL})", "status": "dirty", "matched_fraction": 1.0,
                      "longest_span": 20, "documents_hit": 1}]}))
    (run_dir / "grad_sync.jsonl").write_text(json.dumps({  # every field the grad_sync section prints, as a payload (issue 44 item 7)
        "step": evil, "parallelism": SCRIPT, "ranks": f"[ranks]({EVIL})", "in_sync": False, "params_compared": SCRIPT,
        "grads_compared": f"<{EVIL}>", "slices_compared": f"![s]({EVIL}.png)"}) + "\n")
    result = harness_cli("report", str(out), "--no-plots")
    assert result.returncode == 0, result.stderr[-3000:]
    html = (run_dir / "report.html").read_text(encoding="utf-8")
    assert "<script>" not in html and 'href="http' not in html and 'src="http' not in html
    assert "Replica consistency" in html and "[ranks](" in html
    assert "[eval id](" in html and "&lt;script&gt;" in html  # shown, as text
    # the markdown files, rendered by a renderer that allows raw HTML: still no tag, no link, no image from the data
    permissive = MarkdownIt("commonmark", {"html": True}).enable("table")
    for path in (run_dir / "report.md", capture / "summary.rank-0.md"):
        rendered = permissive.render(path.read_text(encoding="utf-8"))
        assert "<script" not in rendered, path
        assert 'href="http' not in rendered and 'src="http' not in rendered, (path, rendered[:3000])
        assert "click me" in rendered, path  # the text is there, as text
    markdown = (run_dir / "report.md").read_text(encoding="utf-8")
    assert "## Contamination" in markdown and "\\[eval id\\]" in markdown


# -- evidence links stay inside the run's output directory ------------------------------------------------------------

def test_report_links_no_evidence_outside_the_run(tmp_path: Path) -> None:
    """A received findings.jsonl names files anywhere: only those inside the run's output directory become links."""
    secret = tmp_path / "secret.txt"  # a file beside the received folder: on the reader's machine, not the run's
    secret.write_text("private", encoding="utf-8")
    out = tmp_path / "received" / "run"
    run_dir = make_run(out, findings=[
        _finding(evidence={"absolute": str(secret), "climbing": "../../../secret.txt",
                           "through_the_run_name": str(out / "harness" / ".." / ".." / ".." / "secret.txt"),
                           "symlinked": "captures/out.txt", "own": "captures/own.txt"}),
    ])
    (run_dir / "captures").mkdir()
    (run_dir / "captures" / "own.txt").write_text("the run's own evidence", encoding="utf-8")
    (run_dir / "captures" / "out.txt").symlink_to(secret)
    result = harness_cli("report", str(out), "--no-plots")
    assert result.returncode == 0, result.stderr[-3000:]
    markdown = (run_dir / "report.md").read_text(encoding="utf-8")
    html = (run_dir / "report.html").read_text(encoding="utf-8")
    assert "[own](captures/own.txt)" in markdown, markdown  # inside: still a link
    for text in (markdown, html):
        assert "secret.txt" not in text and "out.txt" not in text, text[:4000]
    assert broken_report_links(run_dir) == []


def test_a_damaged_capture_file_is_said_in_the_report_not_offered_to_replay(tmp_path: Path) -> None:
    out = tmp_path / "run"
    run_dir = make_run(out)
    capture = run_dir / "captures" / "step-2"
    capture.mkdir(parents=True)
    (capture / "capture.rank-0.json").write_text('{"code": "LOSS', encoding="utf-8")  # cut short
    result = harness_cli("report", str(out), "--no-plots")
    assert result.returncode == 0, result.stderr[-3000:]
    markdown = (run_dir / "report.md").read_text(encoding="utf-8")
    row = next(line for line in markdown.splitlines() if "capture.rank-0.json could not be read" in line)
    assert "harness replay" not in row, row


# -- issue 44 item 5: terminal control sequences from a run directory never reach the terminal --------------------------

CLEAR, TITLE, CLIPBOARD = "\x1b[2J", "\x1b]0;owned\x07", "\x1b]52;c;ZWNobyBwd25lZA==\x07"


def test_control_sequences_in_a_received_run_are_shown_escaped_never_sent(tmp_path: Path) -> None:
    """A finding message and run.json's error carry clear-screen, window-title and clipboard (OSC 52) sequences:
    explain, report and the console line print them as visible escapes (today they went to the terminal raw)."""
    from harness.core.findings import Finding, Severity
    from harness.core.terminal_text import terminal_text

    out = tmp_path / "run"
    make_run(out, findings=[_finding(message=f"loss was nan {CLEAR}{TITLE}{CLIPBOARD} at step 2")], run_json={
        "attempts": [{"started": 1_700_000_000.0, "resumed_from": None, "start_step": 0, "status": "crashed",
                      "ended": 1_700_000_100.0, "end_step": 2, "error": f"RuntimeError: boom {CLIPBOARD}"}]})
    for args in (("explain", str(out)), ("report", str(out), "--no-plots")):
        done = harness_cli(*args)
        assert done.returncode == 0, done.stderr[-2000:]
        assert "\x1b" not in done.stdout + done.stderr and "\x07" not in done.stdout + done.stderr, args
    assert "\\x1b]52;c;ZWNobyBwd25lZA==\\x07" in harness_cli("explain", str(out)).stdout
    import io

    from harness.core.console import Console

    live = io.StringIO()  # the live console line of a finding made in training (its message quotes the data)
    Console(stream=live).show(Finding(code="X", severity=Severity.WARNING, plugin="p", message=f"bad {TITLE} text", step=1))
    assert "\x1b" not in live.getvalue() and "bad \\x1b]0;owned\\x07 text" in live.getvalue()
    assert terminal_text("tab\tand\nnewline kept\x9b") == "tab\tand\nnewline kept\\x9b"


# -- issue 44 item 2: FIFOs, devices and links in a received run directory neither hang nor feed the readers ----------

def test_fifos_devices_and_linked_folders_are_refused_and_the_commands_exit_0(tmp_path: Path) -> None:
    """steps.jsonl and grad_sync.jsonl are FIFOs, metrics.jsonl and run_card.json links to /dev/zero, captures/step-77
    a link to a folder outside the run: report and explain return at once with notes, list no outside capture and
    read nothing from /dev/zero (today: report, explain and resume-point hang forever on the FIFO; /dev/zero grew them
    to 23 GB)."""
    out = tmp_path / "run"
    run_dir = make_run(out, plugins=["metrics_log", "grad_sync", "run_card"], findings=[_finding()])
    for name in ("steps.jsonl", "grad_sync.jsonl"):
        (run_dir / name).unlink(missing_ok=True)
        os.mkfifo(run_dir / name)
    for name in ("metrics.jsonl", "run_card.json"):
        (run_dir / name).unlink(missing_ok=True)
        (run_dir / name).symlink_to("/dev/zero")
    outside = tmp_path / "elsewhere" / "step-77"
    outside.mkdir(parents=True)
    (outside / "capture.rank-0.json").write_text(json.dumps({"code": "OUTSIDE", "step": 77, "rank": 0, "samples": []}))
    (run_dir / "captures").mkdir()
    (run_dir / "captures" / "step-77").symlink_to(outside)
    report = harness_cli("report", str(out), "--no-plots", timeout=60)
    assert report.returncode == 0, report.stderr[-3000:]
    markdown = (run_dir / "report.md").read_text(encoding="utf-8")
    assert "steps.jsonl is a FIFO: not read" in markdown and "metrics.jsonl is a symbolic link: not followed" in markdown
    assert "OUTSIDE" not in markdown and "step-77" not in markdown
    explain = harness_cli("explain", str(out), timeout=60)
    assert explain.returncode == 0 and "steps.jsonl is a FIFO" in explain.stdout, explain.stderr[-3000:]
    resume = harness_cli("resume-point", str(out), timeout=60)
    assert resume.returncode in (0, 1) and "Traceback" not in resume.stderr, resume.stderr[-3000:]


def test_an_overlong_line_costs_that_line_only(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from harness.core import jsonl

    monkeypatch.setattr(jsonl, "LINE_MAX_BYTES", 1000)
    path = tmp_path / "steps.jsonl"
    path.write_text(json.dumps({"step": 1}) + "\n" + json.dumps({"step": 2, "pad": "x" * 5000}) + "\n" + json.dumps({"step": 3}) + "\n")
    skipped: dict[str, int] = {}
    assert [r["step"] for r in jsonl.read_jsonl(path, skipped)] == [1, 3] and skipped == {"steps.jsonl": 1}


# -- issue 44 item 11: large or deeply nested well-formed input ---------------------------------------------------------

def test_a_run_json_of_many_attempts_or_deep_nesting_is_read_once_or_noted(tmp_path: Path) -> None:
    """run.json with 100,000 attempts (today: report still running after 120 s, each use copied the list) and one nested
    300,000 deep (today: a RecursionError traceback in report, explain and resume-point)."""
    attempt = {"started": 1_700_000_000.0, "resumed_from": None, "start_step": 0, "status": "completed",
               "ended": 1_700_000_100.0, "end_step": 4}
    many = tmp_path / "many"
    make_run(many, findings=[_finding()], run_json={"attempts": [attempt] * 100_000})
    report = harness_cli("report", str(many), "--no-plots", timeout=300)
    assert report.returncode == 0, report.stderr[-3000:]
    assert "run.json records 100,000 train() calls; the attempts table shows the last 100." in (many / "harness" / "report.md").read_text()
    deep = tmp_path / "deep"
    run_dir = make_run(deep, findings=[_finding()])
    (run_dir / "run.json").write_text('{"attempts": ' + "[" * 300_000 + "]" * 300_000 + "}")
    for args in (("report", str(deep), "--no-plots"), ("explain", str(deep)), ("resume-point", str(deep))):
        done = harness_cli(*args, timeout=120)
        assert "Traceback" not in done.stderr and "RecursionError" not in done.stderr, (args, done.stderr[-2000:])
    assert "run.json could not be read (ValueError)" in (run_dir / "report.md").read_text()


def test_a_findings_file_of_gigabytes_is_read_at_its_ends_and_held_per_code(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Issue 44 item 11 (a 1.2 GB findings.jsonl: report 56 s and 4.0 GB, explain 3.9 GB, every finding an object):
    past a size only the file's start and end are read, and past a count per code only the first and last findings
    are held, the rest counted; the report and explain show the counts and say what they left out. Scaled down here
    (thresholds patched) so it runs in milliseconds."""
    from harness.report import record
    from harness.report.build import group_findings
    from harness.report.verdict import verdict_of

    monkeypatch.setattr(record, "FINDINGS_READ_BYTES", 400_000)
    monkeypatch.setattr(record, "KEPT_PER_CODE", 20)
    spikes = [_finding(code="LOSS_SPIKE", severity="warning", plugin="spike_capture", step=s, id=f"s{s:06d}",
                       message=f"loss spiked at step {s}", playbook="loss#loss_spike") for s in range(1, 5001)]
    nan = [_finding(step=s, id=f"n{s:06d}") for s in (3, 2500, 4999)]
    lines = [*spikes[:2], nan[0], *spikes[2:2500], nan[1], *spikes[2500:4997], nan[2], *spikes[4997:]]
    run_dir = make_run(tmp_path / "big", findings=lines)
    size = (run_dir / "findings.jsonl").stat().st_size
    assert size > 1_000_000
    run = record.RunRecord.load(run_dir)
    held = Counter(f.code for f in run.findings)
    assert held["LOSS_SPIKE"] == 20 and sorted(f.step for f in run.findings if f.code == "NONFINITE_LOSS") == [3, 4999]
    (spike,) = [g for g in group_findings(run) if g.code == "LOSS_SPIKE"]
    read_lines = spike.count  # the head and the tail of the file, counted whole although 20 are held
    assert 20 < read_lines < 5000 and spike.left_out == read_lines - 20 and spike.step_range.startswith("1-")
    assert f"{read_lines + 2} finding(s) at warning or above" in verdict_of(run).reason
    notes = " ".join(run.damage_notes())
    assert f"findings.jsonl is {size / 2**20:.1f} MB: its first 0.3 MB and last 0.1 MB were read" in notes
    assert "more than 20 findings of some codes (LOSS_SPIKE" in notes


def test_steps_of_a_very_long_run_are_thinned_evenly_and_its_end_kept_whole(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """steps.jsonl of millions of steps would be read whole into the report's memory: past a size one record in k is
    read (the curves keep their shape) and the file's last part whole (the run's end exact), and the report says so.
    Scaled down (the threshold patched) to 20,000 steps."""
    from harness.report import record

    monkeypatch.setattr(record, "CURVE_READ_BYTES", 200_000)
    run_dir = make_run(tmp_path / "long")
    rows = [{"step": s, "loss": 5.0 - s / 10_000, "grad_norm": 1.0, "lr": 1e-3, "tokens": 128 * s} for s in range(1, 20_001)]
    (run_dir / "steps.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    every = -(-(run_dir / "steps.jsonl").stat().st_size // 200_000)
    run = record.RunRecord.load(run_dir)
    steps = [r["step"] for r in run.steps]
    assert steps[0] == 1 and steps[-1] == 20_000 and steps == sorted(steps)
    thinned = [s for s in steps if s < 15_000]
    assert all(b - a == every for a, b in zip(thinned, thinned[1:]))  # evenly: no hole in the middle of the curve
    assert steps[-200:] == list(range(19_801, 20_001))  # the end whole (its last 25,000 bytes: about 290 records)
    assert len(steps) < 20_000 // every + 2_000
    size = (run_dir / "steps.jsonl").stat().st_size / 2**20
    assert f"steps.jsonl is {size:.1f} MB: one record in {every} was read (the last 0.0 MB whole)" in run.damage_notes()[0]
