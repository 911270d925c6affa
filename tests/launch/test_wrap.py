"""`harness wrap`: unmodified scripts, exit codes (75 after a harness stop), config errors before launch, kill -9 durability, TRL's own script."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from conftest import EXAMPLE, FAULTS, REPO, findings_of, harness_cli, read_jsonl, write_yaml

PY = sys.executable


def test_wrap_runs_unmodified_script_and_keeps_its_exit_code(tmp_path: Path) -> None:
    out = tmp_path / "run"
    result = harness_cli("wrap", "--", PY, str(EXAMPLE), "--output_dir", str(out), "--max_steps", "3", "--exit_code", "3")
    assert result.returncode == 3, result.stderr[-3000:]
    assert (out / "harness" / "findings.jsonl").exists()
    assert findings_of(out) == []
    assert len(read_jsonl(out / "harness" / "metrics.jsonl")) >= 3
    assert "metrics_log" in (out / "harness" / "config.yaml").read_text()
    assert "[harness] step" not in result.stderr  # a clean run prints no finding line
    summary = result.stderr[result.stderr.index(f"harness wrap: summary of {out / 'harness'}"):]
    assert "verdict: healthy: training completed at step 3" in summary and "findings: none" in summary
    assert f"report: {out / 'harness' / 'report.html'}" in summary and f"next: harness explain {out}" in summary


def test_wrap_says_so_when_the_command_produced_no_run() -> None:
    result = harness_cli("wrap", "--", PY, "-c", "pass")
    assert result.returncode == 0
    assert result.stderr.strip().splitlines()[-1].startswith("harness wrap: no harness run directory was produced")


@pytest.mark.slow  # one more process start; the quick tier has the summary of a clean run
def test_wrap_summarises_a_run_whose_trainer_failed_before_its_first_step(tmp_path: Path) -> None:
    """The Trainer cannot load the checkpoint it was asked to resume from: it raises inside train() before any callback.
    Before: the summary said no harness run directory was produced, though the harness had recorded the crash there."""
    out = tmp_path / "run"
    result = harness_cli("wrap", "--", PY, str(EXAMPLE), "--output_dir", str(out), "--max_steps", "3",
                         "--resume_from_checkpoint", str(tmp_path / "no-such-checkpoint"))
    assert result.returncode == 1, result.stderr[-3000:]
    summary = result.stderr[result.stderr.index(f"harness wrap: summary of {out / 'harness'}"):]
    assert "verdict: failed: training crashed" in summary and "Can't find a valid checkpoint" in summary, summary


@pytest.mark.parametrize(("script_status", "wrap_status"), [(0, 75), pytest.param(3, 3, marks=pytest.mark.slow)])
def test_a_harness_stop_exits_75_unless_the_script_failed_otherwise(tmp_path: Path, script_status: int, wrap_status: int) -> None:
    """The stop marker tells wrap; a script that ignored the stop (0) gives 75, a script's own failure (3) wins.

    A NaN planted at step 1 is printed on the console within its step (before step 2's stop), and the closing
    summary counts the codes and names the report."""
    out = tmp_path / "run"
    config = write_yaml(tmp_path / "h.yaml", {"fault_injector": {"stop_at_step": 2, "nonfinite_loss_at_steps": [1]}})
    private = tmp_path / "tmp"
    private.mkdir()
    result = harness_cli("wrap", "--config", str(config), "--plugins", FAULTS, "--", PY, str(EXAMPLE), "--output_dir", str(out),
                         "--max_steps", "4", "--exit_code", str(script_status), env={"TMPDIR": str(private)})
    assert result.returncode == wrap_status, result.stderr[-3000:]
    (stop,) = findings_of(out, "PLUGIN_STOP")
    assert stop["step"] == 2
    assert "HARNESS STOPPED TRAINING" in result.stderr and "at step 2 (attempt 1) after PLUGIN_STOP" in result.stderr
    summary = result.stderr[result.stderr.index("harness wrap: the harness stopped"):]
    assert ("exit status 75 (the command itself exited 0)" in summary) is (wrap_status == 75)
    assert ("the command's own exit status 3 is kept" in summary) is (wrap_status == 3)
    assert not list(private.glob("harness-wrap-*"))  # wrap removed its private marker folder
    nan_line = result.stderr.index("[harness] step 1 NONFINITE_LOSS error: loss is nan at step 1")
    assert nan_line < result.stderr.index("[harness] step 2 PLUGIN_STOP error:") < result.stderr.index("HARNESS STOPPED TRAINING")
    closing = result.stderr[result.stderr.index(f"harness wrap: summary of {out / 'harness'}"):]
    assert "verdict: failed: the harness stopped training at step 2 after PLUGIN_STOP" in closing
    assert "findings: NONFINITE_LOSS x1 (error), PLUGIN_STOP x1 (error)" in closing
    assert f"report: {out / 'harness' / 'report.html'}" in closing


@pytest.mark.slow  # a subprocess run (`harness wrap` or the runner): CI runs it, the quick tier does not
def test_wrap_passes_config_and_plugins_to_the_script(tmp_path: Path) -> None:
    out = tmp_path / "run"
    config = write_yaml(tmp_path / "h.yaml", {"fault_injector": {"report_at_step": 2}, "severity": {"TEST_FAULT": "error"}})
    result = harness_cli(
        "wrap", "--quiet", "--config", str(config), "--plugins", FAULTS, "--", PY, str(EXAMPLE), "--output_dir", str(out), "--max_steps", "3"
    )
    assert result.returncode == 0, result.stderr[-3000:]
    (finding,) = findings_of(out, "TEST_FAULT")
    assert finding["step"] == 2 and finding["severity"] == "error"
    assert "[harness]" not in result.stderr and "harness wrap:" not in result.stderr  # --quiet: no line, no summary


@pytest.mark.slow  # a subprocess run (`harness wrap`): CI runs it, the quick tier does not
def test_wrap_only_runs_exactly_the_plugins_named(tmp_path: Path) -> None:
    """`--only nan_guard` runs that one plugin and none of the defaults (run.json lists what ran; that `--plugins`
    adds to the defaults instead is tests/core/test_config.py's `harness plugins --plugins` case)."""
    out = tmp_path / "run"
    result = harness_cli("wrap", "--quiet", "--only", "nan_guard", "--", PY, str(EXAMPLE), "--output_dir", str(out), "--max_steps", "2")
    assert result.returncode == 0, result.stderr[-3000:]
    run = json.loads((out / "harness" / "run.json").read_text())
    assert run["plugins"] == ["nan_guard"] and list(run["plugin_classes"]) == ["nan_guard"]
    assert not (out / "harness" / "metrics.jsonl").exists()  # metrics_log, on by default, did not run


@pytest.mark.slow  # a subprocess run (`harness wrap`): CI runs it, the quick tier does not
def test_wrap_says_a_config_note_once(tmp_path: Path) -> None:
    """A disabled plugin's section is noted by wrap's own check before the job; the attach inside the job does not
    say it again (it did, through a second reading of the config in the wrapped process)."""
    out = tmp_path / "run"
    config = write_yaml(tmp_path / "h.yaml", {"layer_stats": {"interval": 5}})
    result = harness_cli("wrap", "--config", str(config), "--", PY, str(EXAMPLE), "--output_dir", str(out), "--max_steps", "1")
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stderr.count("the plugin 'layer_stats' is not enabled") == 1, result.stderr[-3000:]


def test_wrap_rejects_a_bad_config_before_starting_the_job(tmp_path: Path) -> None:
    config = write_yaml(tmp_path / "bad.yaml", {"plugins": ["metrics_lgo"]})
    marker = tmp_path / "started"
    result = harness_cli("wrap", "--config", str(config), "--", PY, "-c", f"open({str(marker)!r}, 'w')")
    assert result.returncode == 2
    assert "unknown plugin 'metrics_lgo'" in result.stderr and "Traceback" not in result.stderr
    assert not marker.exists()


def test_wrap_reports_a_missing_command() -> None:
    result = harness_cli("wrap", "--", "no-such-command-xyz")
    assert result.returncode == 2 and "command not found" in result.stderr


def test_kill_9_keeps_findings_already_made(tmp_path: Path) -> None:
    out = tmp_path / "run"
    config = write_yaml(tmp_path / "h.yaml", {"plugins": [FAULTS], "fault_injector": {"report_at_step": 2, "hang_at_step": 3}})
    env = dict(os.environ)
    proc = subprocess.Popen(
        [PY, "-m", "harness.cli", "wrap", "--config", str(config), "--", PY, str(EXAMPLE), "--output_dir", str(out), "--max_steps", "6"],
        env=env, cwd=REPO, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True,
    )
    deadline = time.time() + 300
    while not (out / "harness" / "hanging.rank-0").exists():
        assert proc.poll() is None and time.time() < deadline, "the run ended before reaching the hang"
        time.sleep(0.5)
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait(timeout=60)
    (finding,) = findings_of(out, "TEST_FAULT")
    assert finding["step"] == 2


@pytest.mark.slow
def test_trl_sft_script_through_wrap(tmp_path: Path) -> None:
    """TRL's own `python -m trl.scripts.sft` on a local tiny model and local data, untouched."""
    from harness.lib.tiny import save_tiny_model_dir, write_tiny_sft_jsonl

    model_dir = save_tiny_model_dir(tmp_path / "model", vocab_size=256)
    data_dir = write_tiny_sft_jsonl(tmp_path / "data", n_rows=32).parent
    out = tmp_path / "sft"
    result = harness_cli(
        "wrap", "--plugins", FAULTS, "--", PY, "-m", "trl.scripts.sft",
        "--model_name_or_path", str(model_dir), "--dataset_name", str(data_dir),
        "--output_dir", str(out), "--max_steps", "3", "--per_device_train_batch_size", "2",
        "--report_to", "none", "--logging_steps", "1", "--save_strategy", "no", "--use_cpu", "true",
        "--max_length", "64",
    )
    assert result.returncode == 0, result.stderr[-4000:]
    assert (out / "harness" / "findings.jsonl").exists()
    assert findings_of(out) == []
    assert len(read_jsonl(out / "harness" / "metrics.jsonl")) >= 3


@pytest.mark.slow  # a subprocess run (`harness wrap` or the runner): CI runs it, the quick tier does not
def test_settings_survive_a_launcher_that_forwards_only_python_variables(tmp_path: Path) -> None:
    """DeepSpeed's multi-node launcher forwards PYTHON* variables only: the carrier restores the rest."""
    from harness.launch.wrap import wrap_environment

    out = tmp_path / "run"
    env = wrap_environment(None, [FAULTS])
    for key in ("HARNESS_WRAP", "HARNESS_CONFIG", "HARNESS_PLUGINS"):
        env.pop(key, None)
    result = subprocess.run(
        [PY, str(EXAMPLE), "--output_dir", str(out), "--max_steps", "2"], env=env, cwd=REPO, capture_output=True, text=True, timeout=300
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert "fault_injector" in (out / "harness" / "config.yaml").read_text()


SUBCLASS_SCRIPT = '''
import sys
from transformers import Trainer, TrainingArguments
from harness.lib.tiny import build_tiny_llama, corpus_lines, lm_dataset, train_tokenizer

class CountingTrainer(Trainer):
    bodies = 0
    def train(self, *args, **kwargs):
        type(self).bodies += 1
        return super().train(*args, **kwargs)

tok = train_tokenizer(corpus_lines(), 256)
args = TrainingArguments(output_dir=sys.argv[1], max_steps=2, report_to="none", use_cpu=True, save_strategy="no")
trainer = CountingTrainer(model=build_tiny_llama(tok), args=args, train_dataset=lm_dataset(tok, seq_len=32, n_rows=16))
trainer.train()
trainer.train()
print("BODIES", CountingTrainer.bodies)
'''


@pytest.mark.slow  # a run through `harness wrap` (a subprocess): CI runs it, the quick tier does not
def test_wrap_runs_a_subclass_train_body_once_per_call(tmp_path: Path) -> None:
    script = tmp_path / "subclass_train.py"
    script.write_text(SUBCLASS_SCRIPT, encoding="utf-8")
    out = tmp_path / "run"
    result = harness_cli("wrap", "--", PY, str(script), str(out))
    assert result.returncode == 0, result.stderr[-3000:]
    assert "BODIES 2" in result.stdout
    assert (out / "harness" / "findings.jsonl").exists()


# -- the selection inherited from the shell: HARNESS_CONFIG / HARNESS_PLUGINS / HARNESS_ONLY ----------------------------

def test_an_inherited_selection_is_checked_before_the_command_and_shown_by_harness_plugins(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    from harness.cli import main as harness_main
    from harness.launch.wrap import wrap_environment

    ran = tmp_path / "ran"
    monkeypatch.setenv("HARNESS_PLUGINS", "nan_gaurd")  # a typo in the shell's environment
    assert harness_main(["wrap", "--", sys.executable, "-c", f"open({str(ran)!r}, 'w')"]) == 2
    err = " ".join(capsys.readouterr().err.split())
    assert "unknown plugin 'nan_gaurd'" in err and "from the environment: HARNESS_PLUGINS" in err, err
    assert not ran.exists()  # refused before the command started, not inside it

    monkeypatch.delenv("HARNESS_PLUGINS")
    monkeypatch.setenv("HARNESS_ONLY", "nan_guard")
    assert harness_main(["plugins"]) == 0  # what a wrapped run would get: exactly HARNESS_ONLY's plugins
    out = capsys.readouterr().out
    assert [line.split()[0] for line in out.splitlines() if line.split()[1:2] == ["on"]] == ["nan_guard"], out
    assert "(with HARNESS_ONLY from the environment)" in out
    monkeypatch.delenv("HARNESS_ONLY")
    monkeypatch.setenv("HARNESS_PLUGINS", "layer_stats")
    assert harness_main(["plugins", "--plugins", "mlflow"]) == 0  # the flag replaces the inherited list, and says so
    captured = capsys.readouterr()
    on = [line.split()[0] for line in captured.out.splitlines() if line.split()[1:2] == ["on"]]
    assert "mlflow" in on and "layer_stats" not in on
    assert "note: HARNESS_PLUGINS=layer_stats from the environment is not used" in captured.err

    # the job's environment holds exactly the selection wrap checked: --only with HARNESS_PLUGINS inherited is not a clash
    env = wrap_environment(None, [], base={"HARNESS_PLUGINS": "layer_stats", "PATH": os.environ.get("PATH", "")}, only=["nan_guard"])
    assert env["HARNESS_ONLY"] == "nan_guard" and "HARNESS_PLUGINS" not in env
