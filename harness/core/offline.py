"""No network by default: the documented opt-outs, set once before Hugging Face or MLflow are imported.

The harness itself needs no network: models, tokenizers and data come from
local paths, and the MLflow store is a local SQLite file unless configured
otherwise. Left alone, the libraries still reach out: MLflow sends usage
telemetry (resolving its telemetry host on ``import mlflow``), ``datasets``
sends a HEAD request to the Hub while loading a local ``.jsonl``/``.parquet``
file, and ``from_pretrained`` of a mistyped local path asks the Hub for a
model of that name. Every entry point of the command line calls
:func:`apply` first; a variable the user has set, to any value, is kept.

These libraries read the variables when they are imported, hence "before".
"""
from __future__ import annotations

import os
from typing import MutableMapping

# mlflow/telemetry/utils.py: is_telemetry_disabled() reads MLFLOW_DISABLE_TELEMETRY (and DO_NOT_TRACK)
TELEMETRY_OFF = {"MLFLOW_DISABLE_TELEMETRY": "true"}
# huggingface_hub reads HF_HUB_OFFLINE (or TRANSFORMERS_OFFLINE), datasets HF_DATASETS_OFFLINE (default: the hub's)
HUB_OFFLINE = {"HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1"}
# commands whose every load is the harness's own: telemetry off and the Hub offline
OWN_LOADS = frozenset({"run", "demo", "replay", "scan", "report", "explain", "estimate"})


def disable_telemetry(env: MutableMapping[str, str] | None = None) -> None:
    """MLflow usage telemetry off, unless the user chose (MLFLOW_DISABLE_TELEMETRY or DO_NOT_TRACK set)."""
    env = os.environ if env is None else env
    if "MLFLOW_DISABLE_TELEMETRY" not in env and "DO_NOT_TRACK" not in env:
        env.update(TELEMETRY_OFF)


def hub_offline(env: MutableMapping[str, str] | None = None) -> None:
    """The Hugging Face Hub offline for the harness's own loads, unless the user set the variables."""
    env = os.environ if env is None else env
    if "HF_HUB_OFFLINE" not in env and "TRANSFORMERS_OFFLINE" not in env:
        env["HF_HUB_OFFLINE"] = HUB_OFFLINE["HF_HUB_OFFLINE"]
    if "HF_DATASETS_OFFLINE" not in env:
        env["HF_DATASETS_OFFLINE"] = HUB_OFFLINE["HF_DATASETS_OFFLINE"]


def apply(command: str) -> None:
    """The opt-outs for one ``harness`` subcommand (called by the CLI before the command imports anything heavy).

    ``wrap`` runs the user's own script: only MLflow telemetry is turned off
    there; the script's own Hub and ``datasets`` loads behave as without the harness.
    """
    disable_telemetry()
    if command in OWN_LOADS:
        hub_offline()
