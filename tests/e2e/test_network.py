"""No network by default: the harness's own commands open no socket outside the loopback, even with no *_OFFLINE set.

Each command runs in a subprocess whose ``sitecustomize`` installs an audit
hook (``sys.addaudithook``): ``socket.getaddrinfo`` of a host that is not
local and ``socket.connect`` to an address outside the loopback are written
to a file and refused. The test suite itself runs with ``HF_*_OFFLINE`` set
(conftest.py) and pytest's own variables make MLflow assume CI and turn its
telemetry off, so the subprocess gets an environment without all of them:
what a user's shell looks like.
"""
from __future__ import annotations

import pytest

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import yaml

from conftest import REPO

AUDIT_HOOK = r'''
import os, sys

_LOG = os.environ["NET_AUDIT_LOG"]
_LOCAL_NAMES = {"localhost", "localhost.localdomain", "ip6-localhost", "ip6-loopback"}


def _local(host):
    if host is None:
        return True
    if isinstance(host, (bytes, bytearray)):
        host = host.decode("ascii", "replace")
    host = str(host).strip("[]").lower()
    return host in ("", "::1", "0:0:0:0:0:0:0:1") or host in _LOCAL_NAMES or host.startswith("127.")


def _refuse(event, detail):
    with open(_LOG, "a", encoding="utf-8") as f:
        f.write(f"{os.getpid()} {event} {detail!r}\n")
    raise OSError(f"network refused by the test's audit hook: {event} {detail!r}")


def _hook(event, args):
    if event == "socket.getaddrinfo" and not _local(args[0]):
        _refuse(event, args[0])
    elif event == "socket.connect":
        address = args[1]
        if isinstance(address, tuple) and not _local(address[0]):  # AF_UNIX paths are str/bytes: local
            _refuse(event, address)


sys.addaudithook(_hook)
'''

# Variables that switch the opt-outs on before the harness does: the *_OFFLINE ones, the MLflow ones, and those
# that make MLflow's telemetry believe it runs in CI or under pytest (mlflow/telemetry/utils.py, _is_ci_env_or_testing).
UNSET = (
    "HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE", "TRANSFORMERS_OFFLINE", "MLFLOW_DISABLE_TELEMETRY", "DO_NOT_TRACK",
    "MLFLOW_TRACKING_URI", "PYTEST_CURRENT_TEST", "PYTEST_XDIST_WORKER", "GITHUB_ACTIONS", "CI", "CIRCLECI", "GITLAB_CI",
    "JENKINS_URL", "TRAVIS", "TF_BUILD", "BITBUCKET_BUILD_NUMBER", "CODEBUILD_BUILD_ARN", "BUILDKITE", "TEAMCITY_VERSION",
    "CLOUD_RUN_EXECUTION", "RUNBOT_HOST_URL", "RUNBOT_BUILD_NAME", "RUNBOT_WORKER_ID",
)


def _audited_cli(tmp_path: Path, *args: str, cwd: Path, timeout: float = 600) -> tuple[subprocess.CompletedProcess[str], list[str]]:
    """``python -m harness.cli ARGS`` under the audit hook; (result, the refused calls)."""
    hook_dir = tmp_path / "audit"
    hook_dir.mkdir(exist_ok=True)
    (hook_dir / "sitecustomize.py").write_text(AUDIT_HOOK, encoding="utf-8")
    log = tmp_path / "network.log"
    env = {k: v for k, v in os.environ.items() if k not in UNSET and not k.startswith("PYTEST_")}
    env["PYTHONPATH"] = os.pathsep.join([str(hook_dir), *[p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p]])
    env["NET_AUDIT_LOG"] = str(log)
    result = subprocess.run([sys.executable, "-m", "harness.cli", *args], cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)
    refused = log.read_text(encoding="utf-8").splitlines() if log.exists() else []
    return result, refused


@pytest.mark.slow  # a subprocess run (`harness wrap` or the runner): CI runs it, the quick tier does not
def test_run_opens_no_socket_outside_loopback(tmp_path: Path) -> None:
    """`harness run pretrain` on examples/pretrain.yaml (2 steps, a .jsonl source added: `datasets` loads it)."""
    config: dict[str, Any] = yaml.safe_load((REPO / "examples" / "pretrain.yaml").read_text(encoding="utf-8"))
    corpus = REPO / "harness" / "data" / "corpus.txt"
    lines = [line for line in corpus.read_text(encoding="utf-8").splitlines() if line.strip()]
    records = tmp_path / "extra.jsonl"
    records.write_text("".join(json.dumps({"text": line}) + "\n" for line in lines[:64]), encoding="utf-8")
    config["output_dir"] = str(tmp_path / "out")
    config["data"]["sources"] = [{**config["data"]["sources"][0], "path": str(corpus)}, {"path": str(records), "weight": 0.5}]
    config["training"].update(max_steps=2, save_strategy="no")
    config["training"].pop("save_steps", None)
    path = tmp_path / "pretrain.yaml"
    path.write_text(yaml.safe_dump(config), encoding="utf-8")

    result, refused = _audited_cli(tmp_path, "run", "pretrain", "--config", str(path), cwd=tmp_path)
    assert result.returncode == 0, result.stderr[-4000:]
    assert (tmp_path / "out" / "harness" / "findings.jsonl").exists()
    assert (tmp_path / "out" / "harness" / "mlflow").is_dir()  # the mlflow plugin ran (the runner turns it on)
    assert refused == [], "harness run reached for the network:\n" + "\n".join(refused)


def test_replay_missing_checkpoint_is_an_error_not_a_hub_id(tmp_path: Path) -> None:
    import torch

    from harness.lib.capture import _rng_state

    capture = tmp_path / "run" / "harness" / "captures" / "step-5"
    capture.mkdir(parents=True)
    meta = {"code": "LOSS_SPIKE", "step": 5, "rank": 0, "weights_from_step": 4, "output_dir": str(tmp_path / "run"),
            "model": {"dtype": "float32", "training_mode": True, "device_type": "cpu", "autocast": None},
            "micro_batches": [{"micro_batch": 0, "trainer_loss": 1.0, "keys": ["input_ids", "labels"]}], "samples": []}
    (capture / "capture.rank-0.json").write_text(json.dumps(meta), encoding="utf-8")
    ids = torch.arange(16).reshape(2, 8)
    torch.save({"micro_batches": [{"input_ids": ids, "labels": ids}], "micro_batch_index": [0], "rng": _rng_state(), "losses": [None]},
               capture / "batch.rank-0.pt")
    typo = "run/chekpoint-4"  # relative, and shaped like a hub id (namespace/name)

    result, refused = _audited_cli(tmp_path, "replay", str(capture), "--checkpoint", typo, cwd=tmp_path)
    assert result.returncode == 2, result.stdout[-2000:] + result.stderr[-2000:]
    assert typo in result.stderr and "does not exist" in result.stderr and "Traceback" not in result.stderr, result.stderr[-2000:]
    assert refused == [], "harness replay looked the path up online:\n" + "\n".join(refused)
