"""``harness estimate``: the training-cost formulas (:mod:`harness.lib.cost`) on a planned run, as a table.

The formulas live in ``harness.lib.cost`` because the ``run_card`` and ``throughput`` plugins use them too;
their names are re-exported here. This module adds reading a ``harness run`` stage config.
"""
from __future__ import annotations

import math

from dataclasses import dataclass

from harness.lib.cost import (  # noqa: F401 - re-exported
    describe,
    duration,
    Estimate,
    estimate,
    human,
    Memory,
    memory_per_device,
    peak_for,
    PEAK_TFLOPS,
    SECONDS_PER_DAY,
    state_bytes_per_param,
)


@dataclass(frozen=True)
class PlannedRun:
    """What a stage config plans: parameters, tokens, precision and ZeRO stage."""

    params: float
    tokens: float | None
    precision: str
    zero: int


def plan_from_config(path: str, devices: int) -> PlannedRun:
    """Read a stage config (``harness run`` YAML): the model's parameter count (built on the meta device, no
    weights), tokens = max_steps x per-device batch x accumulation x devices x seq_len, precision, ZeRO stage."""
    import json
    from pathlib import Path

    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    from harness.core.errors import ConfigError
    from harness.stages.config import RunConfig, read_yaml
    from harness.lib.tiny import tiny_llama_config

    source = Path(path).resolve()
    data = read_yaml(source)
    try:
        config = RunConfig.model_validate(data)
    except Exception as exc:  # noqa: BLE001 - pydantic's message names the key
        raise ConfigError([f"run config error in {source}: {exc}. Fix: check the file against examples/*.yaml."]) from None
    if config.model.path:
        model_dir = source.parent / config.model.path if not Path(config.model.path).is_absolute() else Path(config.model.path)
        if not (model_dir / "config.json").is_file():  # never a Hub id: nothing is downloaded
            raise ConfigError([f"run config {source}: model.path {config.model.path} ({model_dir}) holds no config.json. "
                               "Fix: point model.path at a saved model folder, or pass --params instead."])
        model_config = AutoConfig.from_pretrained(model_dir, local_files_only=True)
    else:
        model_config = tiny_llama_config(config.tokenizer.vocab_size, **config.model.overrides)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(model_config)
    params = float(sum(p.numel() for p in model.parameters()))
    training = config.training
    steps = training.get("max_steps")
    tokens = None
    if isinstance(steps, int) and steps > 0:
        per_device = int(training.get("per_device_train_batch_size", 8))
        accumulation = int(training.get("gradient_accumulation_steps", 1))
        seq_len = int(training.get("max_length") or config.data.seq_len)
        tokens = float(steps * per_device * accumulation * devices * seq_len)
    precision = "bf16" if training.get("bf16") else "fp16" if training.get("fp16") else "fp32"
    zero = 0
    deepspeed = config.deepspeed
    if isinstance(deepspeed, str):
        deepspeed = json.loads((source.parent / deepspeed).read_text(encoding="utf-8"))
    if isinstance(deepspeed, dict):
        zero = int(deepspeed.get("zero_optimization", {}).get("stage", 0) or 0)
    return PlannedRun(params, tokens, precision, zero)


def print_estimate(params: float | None, tokens: float | None, devices: int, peak_tflops: float | None, device: str | None,
                   mfu: float, zero: int | None, precision: str | None, from_config: str | None) -> int:
    """``harness estimate``: compute, time and memory per device, as a table."""
    from harness.core.errors import HarnessError

    if from_config:
        plan = plan_from_config(from_config, devices)
        params = params or plan.params
        tokens = tokens or plan.tokens
        precision = precision or plan.precision
        zero = plan.zero if zero is None else zero
    if params is None or tokens is None:
        raise HarnessError("harness estimate needs --params and --tokens (or --from-config with max_steps set). "
                           "Fix: e.g. `harness estimate --params 7e9 --tokens 1e12 --devices 1024 --peak-tflops 989 --mfu 0.4`.")
    for flag, value in (("--params", params), ("--tokens", tokens), ("--peak-tflops", peak_tflops)):
        if value is not None and not (math.isfinite(value) and value > 0):
            raise HarnessError(f"harness estimate: {flag} {value:g} is not a positive number. Fix: pass a count above 0, "
                               "e.g. 7e9 (write a negative as --params=-7e9 to get this message instead of argparse's).")
    if peak_tflops is not None and device:
        raise HarnessError(f"harness estimate: --peak-tflops {peak_tflops:g} and --device {device} both give the peak. "
                           "Fix: pass one of them.")
    if peak_tflops is None and device:
        peak_tflops = peak_for(device)
        if peak_tflops is None:
            raise HarnessError(f"no peak known for device '{device}'. Fix: pass --peak-tflops, or one of: {', '.join(PEAK_TFLOPS)}.")
    try:
        result = estimate(params, tokens, devices, peak_tflops, mfu, zero or 0, precision or "bf16")
    except ValueError as exc:
        raise HarnessError(f"harness estimate: {exc}.") from None
    width = max(len(label) for label, _ in describe(result))
    for label, value in describe(result):
        print(f"{label:<{width}}  {value}")
    if device and (precision or "bf16") == "fp32":
        print(f"note: --device {device} gives its dense 16-bit peak; an fp32 run reaches a fraction of it (TF32 about half, "
              "plain fp32 less). Pass --peak-tflops for the precision you train in.")
    if result.seconds is None:
        print("time: pass --peak-tflops (or --device H100) to estimate it")
    return 0
