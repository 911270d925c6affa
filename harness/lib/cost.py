"""The training-cost formulas: compute (C = 6ND), time at a utilisation, memory per device.

The same formulas serve ``harness estimate`` and the ``run_card`` plugin, so a
plan made before a run and the card written at its start agree.

Memory counts what training state costs per parameter, before activations:
mixed precision (bf16/fp16) keeps 16-bit weights and gradients (2 + 2 bytes)
and an fp32 master copy with Adam's two moments (4 + 4 + 4 bytes); fp32 keeps
4 + 4 bytes plus the two moments (8). ZeRO stage 1 shards the optimizer
state over the data-parallel devices, stage 2 the gradients too, stage 3
the weights as well.
"""
from __future__ import annotations

import re
from dataclasses import dataclass

SECONDS_PER_DAY = 86_400.0

# dense 16-bit tensor peak per device, TFLOPS (vendor datasheets, without sparsity)
PEAK_TFLOPS: dict[str, float] = {
    "H200": 989.0,
    "H100": 989.0,
    "H100 PCIE": 756.0,
    "H100 NVL": 835.0,
    "H800": 989.0,
    "GH200": 989.0,
    "B200": 2250.0,
    "A100": 312.0,
    "A800": 312.0,
    "L40S": 362.0,
    "L4": 121.0,
    "A10": 125.0,
    "V100": 125.0,
}


@dataclass(frozen=True)
class Memory:
    """Bytes per device of the training state (no activations)."""

    weights: float
    gradients: float
    optimizer: float

    @property
    def total(self) -> float:
        return self.weights + self.gradients + self.optimizer


@dataclass(frozen=True)
class Estimate:
    params: float
    tokens: float
    devices: int
    peak_tflops: float | None
    mfu: float
    zero: int
    precision: str
    memory: Memory

    @property
    def flops(self) -> float:
        """Training compute, C = 6 N D (forward 2ND, backward 4ND)."""
        return 6.0 * self.params * self.tokens

    @property
    def seconds(self) -> float | None:
        """Wall time at ``mfu`` of the devices' peak (None without a peak)."""
        if not self.peak_tflops:
            return None
        return self.flops / (self.devices * self.peak_tflops * 1e12 * self.mfu)

    @property
    def device_days(self) -> float | None:
        return self.seconds * self.devices / SECONDS_PER_DAY if self.seconds is not None else None


def state_bytes_per_param(precision: str) -> tuple[float, float, float]:
    """(weights, gradients, optimizer state) bytes per parameter for Adam-style training."""
    if precision in ("bf16", "fp16"):
        return 2.0, 2.0, 12.0
    if precision == "fp32":
        return 4.0, 4.0, 8.0
    raise ValueError(f"unknown precision '{precision}'; use bf16, fp16 or fp32")


def memory_per_device(params: float, precision: str = "bf16", zero: int = 0, devices: int = 1) -> Memory:
    """The training state one device holds under ZeRO ``zero`` over ``devices`` data-parallel devices."""
    if zero not in (0, 1, 2, 3):
        raise ValueError(f"unknown ZeRO stage {zero}; use 0, 1, 2 or 3")
    weights, gradients, optimizer = (params * b for b in state_bytes_per_param(precision))
    shards = max(devices, 1)
    return Memory(
        weights=weights / shards if zero >= 3 else weights,
        gradients=gradients / shards if zero >= 2 else gradients,
        optimizer=optimizer / shards if zero >= 1 else optimizer,
    )


def estimate(params: float, tokens: float, devices: int = 1, peak_tflops: float | None = None, mfu: float = 0.4,
             zero: int = 0, precision: str = "bf16") -> Estimate:
    if params <= 0 or tokens <= 0 or devices < 1:
        raise ValueError("params and tokens must be positive and devices at least 1")
    if not 0 < mfu <= 1:
        raise ValueError(f"mfu {mfu} must be in (0, 1]: a fraction of the peak, e.g. 0.4")
    return Estimate(params, tokens, devices, peak_tflops, mfu, zero, precision, memory_per_device(params, precision, zero, devices))


def peak_for(device_name: str) -> float | None:
    """The dense 16-bit peak of a device from its name (``torch.cuda.get_device_name()``), if known.

    A known name must stand as a whole word in it ("NVIDIA L40" is not an L4,
    "NVIDIA H100 PCIe" is the PCIe card, not the SXM one); longer names first.
    """
    name = " ".join(device_name.upper().replace("-", " ").split())
    for key in sorted(PEAK_TFLOPS, key=len, reverse=True):  # "GH200" before "H200", "H100 PCIE" before "H100" ...
        if re.search(rf"(?<![A-Z0-9]){re.escape(key)}(?![A-Z0-9])", name):
            return PEAK_TFLOPS[key]
    return None


def human(value: float, unit: str = "") -> str:
    """1.2e22 -> '1.20e+22', 3.1e9 bytes -> '3.10 GB' style numbers for people."""
    if unit == "B":
        for name, scale in (("TB", 1e12), ("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
            if value >= scale:
                return f"{value / scale:.3g} {name}"
        return f"{value:.0f} B"
    return f"{value:.3g}"


def duration(seconds: float) -> str:
    """Seconds in the unit people plan in."""
    if seconds < 120:
        return f"{seconds:.3g} s"
    if seconds < 2 * 3600:
        return f"{seconds / 60:.3g} min"
    if seconds < 2 * SECONDS_PER_DAY:
        return f"{seconds / 3600:.3g} h"
    return f"{seconds / SECONDS_PER_DAY:.3g} days"


def describe(result: Estimate) -> list[tuple[str, str]]:
    """The estimate as (label, value) rows, the way the CLI and the run card show it."""
    rows = [
        ("parameters (N)", human(result.params)),
        ("training tokens (D)", human(result.tokens)),
        ("compute C = 6ND", f"{result.flops:.3g} FLOPs"),
    ]
    if result.seconds is not None:
        rows += [
            ("devices x peak x MFU", f"{result.devices} x {result.peak_tflops:g} TFLOPS x {result.mfu * 100:.3g}%"),
            ("time", f"{duration(result.seconds)} ({result.device_days:.3g} device-days)"),
        ]
    memory = result.memory
    rows += [
        (f"memory per device ({result.precision}, ZeRO-{result.zero}, {result.devices} device{'' if result.devices == 1 else 's'})", human(memory.total, "B")),
        ("  weights / gradients / optimizer state", f"{human(memory.weights, 'B')} / {human(memory.gradients, 'B')} / {human(memory.optimizer, 'B')}"),
    ]
    return rows
