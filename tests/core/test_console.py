"""Live console lines: format, level, per-code limit, rank 0 only, HARNESS_QUIET, a broken stderr tolerated; and the run context prints them."""
from __future__ import annotations

import io
from pathlib import Path

import pytest

from harness.core.codes import CORE_CODES
from harness.core.console import QUIET_ENV, Console, ConsoleOptions, finding_line, shorten
from harness.core.distributed import DistInfo
from harness.core.findings import Finding, FindingCode, Severity
from harness.core.config import Catalog, resolve_config
from harness.core.context import RunContext
from harness.core.errors import ConfigError
from harness.core.manager import HarnessPluginManager


def finding(code: str = "LOSS_SPIKE", severity: Severity = Severity.WARNING, message: str = "loss 7.1 vs median 2.3 (6.2 MAD)",
            step: int | None = 40, rank: int = 0) -> Finding:
    return Finding(code=code, severity=severity, plugin="loss_spike", message=message, step=step, rank=rank)


def lines(stream: io.StringIO) -> list[str]:
    return stream.getvalue().splitlines()


def test_the_line_names_step_code_severity_message_and_the_playbook_command() -> None:
    assert finding_line(finding()) == ("[harness] step 40 LOSS_SPIKE warning: loss 7.1 vs median 2.3 (6.2 MAD) "
                                       "-> harness playbook LOSS_SPIKE")
    assert finding_line(finding(rank=3, step=None)).startswith("[harness] rank 3 LOSS_SPIKE warning: ")


def test_a_code_of_another_package_points_at_its_own_playbook() -> None:
    """`harness playbook CODE` prints only the shipped playbooks: a plugin's own code names where its playbook is."""
    shipped = Finding(code="LOSS_SPIKE", severity=Severity.WARNING, plugin="spike_capture", message="m", step=4,
                      playbook="numeric-health#loss_spike")
    theirs = Finding(code="LOSS_ABOVE_CEILING", severity=Severity.ERROR, plugin="myplug", message="m", step=4,
                     playbook="my-playbook#loss")
    assert finding_line(shipped).endswith("-> harness playbook LOSS_SPIKE")
    assert finding_line(theirs).endswith("-> playbook my-playbook#loss")


def test_a_long_message_is_one_short_line() -> None:
    text = "word " * 100 + "\nsecond line"
    short = shorten(text)
    assert "\n" not in short and len(short) <= 205 and short.endswith(" ...")
    assert shorten("a\n  b") == "a b"
    assert len(shorten("x" * 500)) <= 205  # no space to cut at


def test_level_per_code_limit_and_info_silence() -> None:
    out = io.StringIO()
    console = Console(ConsoleOptions(per_code=2), stream=out, env={})
    console.show(finding(severity=Severity.INFO, code="ACTION_TAKEN"))
    for step in range(5):
        console.show(finding(step=step))
    console.show(finding(code="NONFINITE_LOSS", severity=Severity.ERROR, step=9))
    got = lines(out)
    assert [line.split(" ")[2] for line in got[:2]] == ["0", "1"]
    assert got[2] == "[harness] further LOSS_SPIKE lines are held back (2 shown; every finding is in findings.jsonl and the report)"
    assert got[3].startswith("[harness] step 9 NONFINITE_LOSS error: ") and len(got) == 4  # info never printed

    strict = io.StringIO()
    console = Console(ConsoleOptions(level="error"), stream=strict, env={})
    console.show(finding())
    console.show(finding(severity=Severity.CRITICAL, code="SKIP_NOT_APPLIED"))
    assert [line.split(" ")[3] for line in lines(strict)] == ["SKIP_NOT_APPLIED"]


@pytest.mark.parametrize("how", ["off", "quiet env", "other rank"])
def test_silenced(how: str) -> None:
    out = io.StringIO()
    console = Console(ConsoleOptions(level="off" if how == "off" else "warning"), is_main=how != "other rank", stream=out,
                      env={QUIET_ENV: "1"} if how == "quiet env" else {})
    console.show(finding(severity=Severity.CRITICAL))
    assert out.getvalue() == "" and not console.enabled
    assert Console(stream=out, env={QUIET_ENV: "0"}).enabled


class Broken(io.StringIO):
    def write(self, text: str) -> int:
        raise OSError(32, "Broken pipe")


def test_a_broken_or_closed_stderr_never_raises() -> None:
    closed = io.StringIO()
    closed.close()
    for stream in (Broken(), closed):
        console = Console(stream=stream, env={})
        for _ in range(5):
            console.show(finding())


def test_the_option_is_validated_with_its_values(tmp_path: Path) -> None:
    catalog = Catalog.build(autoload=False)
    assert resolve_config({"console": {"level": "error", "per_code": 1}}, catalog).model.console.per_code == 1
    with pytest.raises(ConfigError) as info:
        resolve_config({"console": {"level": "loud"}}, catalog)
    assert "console.level" in str(info.value)


def test_the_run_context_prints_its_own_and_other_ranks_findings(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(QUIET_ENV, raising=False)
    catalog = Catalog.build(autoload=False)
    codes = {c.code: c for c in CORE_CODES}
    codes["PROBE_FAULT"] = FindingCode("PROBE_FAULT", Severity.WARNING, "probe", "harness-core#plugin_stop")
    ctx = RunContext(resolve_config({"plugins": []}, catalog), codes, HarnessPluginManager(), tmp_path / "harness",
                     DistInfo(rank=0, world_size=1, local_rank=0))
    ctx.step = 7
    ctx.report("PROBE_FAULT", "a probe\nfired", plugin="probe")
    ctx.report("ACTION_TAKEN", "skipped", plugin="probe")  # info: no line
    ctx._announce(finding(code="PROBE_FAULT", rank=1, step=7, message="on rank 1"))  # as collect_findings hands it over
    ctx.close()
    err = capsys.readouterr().err.splitlines()
    assert err == ["[harness] step 7 PROBE_FAULT warning: a probe fired -> harness playbook PROBE_FAULT",
                   "[harness] step 7 rank 1 PROBE_FAULT warning: on rank 1 -> harness playbook PROBE_FAULT"]
