"""A real `mlflow server` on 127.0.0.1 for the tests (tests/plugins/test_mlflow.py, tests/e2e/test_client_mlflow.py)."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path
from typing import Any, Iterator

import pytest

from conftest import free_port

PY = sys.executable


class MlflowServer:
    """A real `mlflow server` on 127.0.0.1 with a SQLite backend; stoppable and restartable on the same port."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.port = free_port()
        self.uri = f"http://127.0.0.1:{self.port}"
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self, timeout: float = 120) -> None:
        log = open(self.root / "server.log", "ab")
        self.proc = subprocess.Popen(
            [str(Path(PY).parent / "mlflow"), "server", "--host", "127.0.0.1", "--port", str(self.port), "--workers", "1",
             "--backend-store-uri", f"sqlite:///{self.root / 'server.db'}", "--artifacts-destination", str(self.root / "artifacts")],
            stdout=log, stderr=log, start_new_session=True, cwd=self.root,
        )
        deadline = time.time() + timeout
        while time.time() < deadline:
            assert self.proc.poll() is None, (self.root / "server.log").read_text()[-3000:]
            try:
                with urllib.request.urlopen(f"{self.uri}/health", timeout=2) as response:
                    if response.status == 200:
                        return
            except OSError:
                time.sleep(0.5)
        raise TimeoutError("mlflow server did not come up")

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait(timeout=30)


def mlflow_client(uri: str) -> Any:
    from mlflow.tracking import MlflowClient

    return MlflowClient(tracking_uri=uri)


def all_runs(uri: str) -> list[Any]:
    """Every run of every experiment in the store: what "one job makes one run" counts."""
    client = mlflow_client(uri)
    return client.search_runs([e.experiment_id for e in client.search_experiments()])


def metric_steps(uri: str, run_id: str, key: str) -> list[int]:
    return sorted(m.step for m in mlflow_client(uri).get_metric_history(run_id, key))


@pytest.fixture
def mlflow_server(tmp_path: Path) -> Iterator[MlflowServer]:
    """A real server for one test, stopped after it."""
    root = tmp_path / "server"
    root.mkdir()
    server = MlflowServer(root)
    server.start()
    try:
        yield server
    finally:
        server.stop()
