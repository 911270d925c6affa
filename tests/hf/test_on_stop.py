"""`attach` on a real Trainer: a harness stop prints the banner, and `on_stop: raise` makes train() raise HarnessStopped."""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Callable

import pytest

import harness
from conftest import FAULTS


def _attach(make_trainer: Callable[..., Any], out: Path, **core: Any) -> Any:
    trainer = make_trainer(output_dir=out)
    harness.attach(trainer, config={"plugins": ["defaults", FAULTS], "fault_injector": {"stop_at_step": 2}, **core})
    return trainer


def test_on_stop_raise_raises_harness_stopped_after_the_report(make_trainer: Callable[..., Any], tmp_path: Path,
                                                                 capfd: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "out"
    trainer = _attach(make_trainer, out, on_stop="raise")
    with pytest.raises(harness.HarnessStopped) as raised:
        trainer.train()
    stop = raised.value
    assert isinstance(stop, harness.core.errors.HarnessError)
    assert (stop.step, stop.code, stop.attempt, stop.action, stop.output_dir) == (2, "PLUGIN_STOP", 1, "stop", str(out))
    assert f"harness explain {out}" in str(stop) and "on_stop: return" in str(stop)
    assert trainer.state.global_step == 2  # the Trainer returned from the stop; then the harness raised
    attempt = json.loads((out / "harness" / "run.json").read_text())["attempts"][-1]
    assert attempt["status"] == "stopped" and attempt["end_step"] == 2 and "error" not in attempt
    assert "stopped training at step 2 after PLUGIN_STOP (attempt 1)" in (out / "harness" / "report.md").read_text()
    assert "HARNESS STOPPED TRAINING" in capfd.readouterr().err


def test_on_stop_return_returns_and_says_so_twice(make_trainer: Callable[..., Any], tmp_path: Path, capfd: pytest.CaptureFixture[str]) -> None:
    trainer = _attach(make_trainer, tmp_path / "out")
    result = trainer.train()  # today's behaviour: train() returns as if it had finished
    assert result.global_step == 2
    err = capfd.readouterr().err
    assert err.count("HARNESS STOPPED TRAINING") == 1 and "at step 2 (attempt 1) after PLUGIN_STOP" in err
    assert "train() returns as if it had finished (on_stop: return)" in err


def test_a_clean_run_prints_no_banner(make_trainer: Callable[..., Any], tmp_path: Path, capfd: pytest.CaptureFixture[str]) -> None:
    trainer = make_trainer(output_dir=tmp_path / "out", max_steps=3)
    harness.attach(trainer, config={"on_stop": "raise"})
    trainer.train()  # no stop: nothing raised
    assert "HARNESS" not in capfd.readouterr().err


def test_on_stop_accepts_only_return_or_raise() -> None:
    from harness.core.errors import ConfigError

    with pytest.raises(ConfigError, match="on_stop"):
        from harness.core.config import Catalog, load_config

        load_config({"on_stop": "exit"}, Catalog.build())


def test_the_banner_starts_on_a_line_of_its_own_under_the_progress_bar(make_trainer: Callable[..., Any], tmp_path: Path,
                                                                     capfd: pytest.CaptureFixture[str]) -> None:
    """The Trainer's tqdm bar is on stderr without a line break: the banner is written through tqdm, never after it."""
    trainer = make_trainer(output_dir=tmp_path / "out", disable_tqdm=False)
    harness.attach(trainer, config={"plugins": ["defaults", FAULTS], "fault_injector": {"stop_at_step": 2}})
    trainer.train()
    err = capfd.readouterr().err
    at = err.index("HARNESS STOPPED TRAINING")
    line = err[: at].replace("\r", "\n").rsplit("\n", 1)[-1]  # what the banner's line holds before its title
    assert set(line.rstrip(" ")) == {"="}, repr(err[max(0, at - 300) : at + 40])
