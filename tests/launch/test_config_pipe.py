"""Issue 44 item 13: a config through a pipe is read once and passed on; a device or a writerless pipe is refused."""
from __future__ import annotations

import os
import shlex
import subprocess
import sys
import threading
from pathlib import Path

import pytest

from conftest import harness_cli
from harness.core import config as config_module
from harness.core.config import read_config_text
from harness.core.errors import ConfigError

YAML = "plugins: [defaults]\nnan_guard: {max_consecutive: 5}\n"


def test_a_pipe_is_read_to_its_end_and_a_device_or_a_huge_file_is_refused(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    fifo = tmp_path / "config.fifo"
    os.mkfifo(fifo)

    def write() -> None:
        with open(fifo, "w") as handle:
            handle.write(YAML)

    writer = threading.Thread(target=write)
    writer.start()
    assert read_config_text(fifo) == YAML
    writer.join()
    with pytest.raises(ConfigError, match="/dev/zero' is not a regular file or a pipe"):
        read_config_text("/dev/zero")
    huge = tmp_path / "huge.yaml"
    huge.write_text("a: 1\n" * 300_000)
    with pytest.raises(ConfigError, match="holds more than 1 MB"):
        read_config_text(huge)
    monkeypatch.setattr(config_module, "CONFIG_READ_S", 0.2)  # a pipe nobody writes: refused, not waited on forever
    with pytest.raises(ConfigError, match="sent no end of file"):
        read_config_text(fifo)


def test_wrap_takes_its_config_from_process_substitution(tmp_path: Path) -> None:
    """``harness wrap --config <(cat h.yaml)``: today refused ('/proc/.../fd/pipe:[...]' does not exist)."""
    (tmp_path / "h.yaml").write_text(YAML)
    job = f"{shlex.quote(sys.executable)} -c \"import os; print('job reads:', open(os.environ['HARNESS_CONFIG']).read().splitlines()[1])\""
    command = f"{shlex.quote(sys.executable)} -m harness.cli wrap --quiet --config <(cat h.yaml) -- {job}"
    done = subprocess.run(["bash", "-c", command], cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    assert "job reads: nan_guard: {max_consecutive: 5}" in done.stdout
    refused = harness_cli("wrap", "--config", "/dev/zero", "--", sys.executable, "-c", "pass")
    assert refused.returncode == 2 and "'/dev/zero' is not a regular file or a pipe" in refused.stderr
