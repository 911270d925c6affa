"""``run.json``: what the run was (the run card's facts) and how each ``train()`` call ended.

Written by rank 0 when training starts and again when it ends, atomically, so
a report rebuilt after ``kill -9`` still knows the model, the world size and
that the last attempt never reached its end. One entry per ``train()`` call
("attempt"): a crash, a resume or a rollback adds one.
"""
from __future__ import annotations

import os
import platform
import socket
import time
from pathlib import Path
from typing import Any

from harness.core.received import RefusedFile, read_received_json
from harness.core.strictjson import dumps
from harness.lib.tokens import count_parameters
from harness.lib.trainer_kind import NOT_TOKEN_LOSS

RUN_FILE = "run.json"
INTERRUPTED = "interrupted"  # the status of a train() call ended by Ctrl-C / SIGINT (KeyboardInterrupt): no crash of training
RUN_FORMAT = "train-harness-run/1"  # run.json's "format": marks a run directory written by this harness


UNREADABLE = f"{RUN_FILE} could not be read"  # the start of the problem read_run_info notes for a damaged file


def read_run_info(run_dir: Path, problems: list[str] | None = None) -> dict[str, Any]:
    """The run's ``run.json`` (an empty record when missing or unreadable; ``problems`` is told of an unreadable one)."""
    path = Path(run_dir) / RUN_FILE
    try:
        data = read_received_json(path)  # never a link, a FIFO or a device; capped
    except FileNotFoundError:
        return {"attempts": []}
    except (OSError, ValueError) as exc:
        if problems is not None:
            why = str(exc) if isinstance(exc, RefusedFile) else type(exc).__name__
            problems.append(f"{UNREADABLE} ({why}): the attempts and the run card are not known.")
        return {"attempts": []}
    if not isinstance(data, dict):
        return {"attempts": []}
    if not isinstance(data.get("attempts"), list):
        data["attempts"] = []
    data["attempts"] = [a for a in data["attempts"] if isinstance(a, dict)]  # a damaged entry costs itself, not the report
    return data


def write_run_info(run_dir: Path, data: dict[str, Any]) -> None:
    """Replace ``run.json`` atomically: a kill leaves the old or the new file, never half of one."""
    path = Path(run_dir) / RUN_FILE
    tmp = path.with_name(f".{RUN_FILE}.{os.getpid()}.tmp")
    data = {"format": RUN_FORMAT, **{k: v for k, v in data.items() if k != "format"}}  # the marker `harness report` trusts
    tmp.write_text(dumps(data, indent=2, default=str), encoding="utf-8")  # strict JSON: a non-finite number as "nan", "inf"
    os.replace(tmp, path)


def start_attempt(run_dir: Path, facts: dict[str, Any], resumed_from: str | None, start_step: int) -> int:
    """Record the facts of the run and open a new attempt marked ``running``; its index."""
    data = read_run_info(run_dir)
    data.update(facts)
    data["attempts"].append(
        {"started": time.time(), "resumed_from": resumed_from, "start_step": start_step, "status": "running", "host": socket.gethostname()}
    )
    write_run_info(run_dir, data)
    return len(data["attempts"]) - 1


def status_of(status: str, error: BaseException | str | None) -> str:
    """How an attempt ended as run.json says it: a crash whose error is a KeyboardInterrupt (Ctrl-C, SIGINT; the
    exception, or its recorded text, as older versions wrote it with status ``crashed``) is ``interrupted``."""
    if status != "crashed":
        return status
    interrupted = isinstance(error, KeyboardInterrupt) or (isinstance(error, str) and error.strip().rstrip(":").strip() == "KeyboardInterrupt")
    return INTERRUPTED if interrupted else status


def end_attempt(run_dir: Path, status: str, end_step: int, error: BaseException | None, attempt_index: int | None,
                ranks: list[dict[str, Any]] | None = None) -> None:
    """Close attempt ``attempt_index`` with how it ended (``completed``, ``stopped``, ``crashed`` or ``interrupted``).

    ``ranks``: with several processes, how each rank that did not complete
    ended (``harness.lib.rank_markers.RankEnd.as_dict``: rank, status, short
    error, end time, step), rank 0 included; ``error`` stays rank 0's own.

    None: this train() call failed before it could open one (a bad checkpoint
    path, say); a closed entry is added, so an earlier attempt that was killed
    keeps its ``running`` mark.
    """
    data = read_run_info(run_dir)
    attempts = data["attempts"]
    if attempt_index is None or attempt_index >= len(attempts) or not isinstance(attempts[attempt_index], dict):
        attempts.append({"started": None, "resumed_from": None, "start_step": None})
        attempt_index = len(attempts) - 1
    attempt = attempts[attempt_index]
    attempt.update({"status": status, "ended": time.time(), "end_step": end_step})
    if error is not None:
        attempt["error"] = (f"{type(error).__name__}: {error}" if str(error) else type(error).__name__)[:2000]
    if ranks:
        attempt["ranks"] = ranks
    write_run_info(run_dir, data)


def run_facts(trainer: Any, world_size: int, stage: str | None) -> dict[str, Any]:
    """The run card's facts, read from the trainer at train start (cheap: no data is touched)."""
    args = trainer.args
    model = getattr(trainer, "model", None)
    facts: dict[str, Any] = {
        "stage": stage or _stage_of(trainer),
        "trainer": type(trainer).__name__,
        "world_size": world_size,
        "python": platform.python_version(),
        "output_dir": str(args.output_dir),
    }
    try:
        import torch
        import transformers

        facts["versions"] = {"torch": torch.__version__, "transformers": transformers.__version__}
    except Exception:  # noqa: BLE001 - versions are nice to have
        pass
    facts["model"] = _model_facts(model)
    per_device = int(getattr(args, "per_device_train_batch_size", 0) or 0)
    accumulation = int(getattr(args, "gradient_accumulation_steps", 1) or 1)
    facts["training"] = {
        "max_steps": int(args.max_steps) if getattr(args, "max_steps", -1) and args.max_steps > 0 else None,
        "num_train_epochs": float(getattr(args, "num_train_epochs", 0) or 0),
        "per_device_train_batch_size": per_device,
        "gradient_accumulation_steps": accumulation,
        "global_batch_size": per_device * accumulation * world_size,
        "learning_rate": float(getattr(args, "learning_rate", 0.0) or 0.0),
        "lr_scheduler_type": str(getattr(getattr(args, "lr_scheduler_type", None), "value", getattr(args, "lr_scheduler_type", None))),
        "warmup_steps": getattr(args, "warmup_steps", None),
        "max_grad_norm": getattr(args, "max_grad_norm", None),
        "weight_decay": getattr(args, "weight_decay", None),
        "precision": "bf16" if getattr(args, "bf16", False) else "fp16" if getattr(args, "fp16", False) else "fp32",
        "seed": getattr(args, "seed", None),
        "deepspeed_zero_stage": _zero_stage(args),
        "train_rows": _length(getattr(trainer, "train_dataset", None)),
        "eval_rows": _length(getattr(trainer, "eval_dataset", None)),
    }
    return facts


def _stage_of(trainer: Any) -> str:
    """``dpo``, ``grpo``, ``sft``, another TRL trainer's name (``kto`` ...) when its loss is no token loss, else causal-lm."""
    names = [cls.__name__ for cls in type(trainer).__mro__]
    if "DPOTrainer" in names:
        return "dpo"
    if "GRPOTrainer" in names:
        return "grpo"
    if "SFTTrainer" in names:
        return "sft"
    other = next((name for name in names if name in NOT_TOKEN_LOSS), None)
    return other[: -len("Trainer")].lower() if other else "causal-lm"


def _model_facts(model: Any) -> dict[str, Any]:
    if model is None:
        return {}
    facts: dict[str, Any] = {"class": type(model).__name__}
    try:
        facts["parameters"], facts["trainable_parameters"] = count_parameters(model)
        first = next(iter(model.parameters()), None)
        facts["dtype"] = str(first.dtype).replace("torch.", "") if first is not None else None
    except Exception:  # noqa: BLE001
        pass
    config = getattr(model, "config", None)
    for key in ("model_type", "vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads", "max_position_embeddings"):
        value = getattr(config, key, None)
        if value is not None:
            facts[key] = value
    return facts


def _zero_stage(args: Any) -> int | None:
    plugin = getattr(args, "hf_deepspeed_config", None)
    config = getattr(plugin, "config", None)
    if not isinstance(config, dict):
        return None
    stage = config.get("zero_optimization", {}).get("stage")
    return int(stage) if isinstance(stage, int) else None


def _length(dataset: Any) -> int | None:
    try:
        return len(dataset) if dataset is not None else None
    except Exception:  # noqa: BLE001 - an iterable dataset has no length, and some raise more than TypeError
        return None
