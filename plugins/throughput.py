"""throughput: tokens per second, MFU, the share of each step spent waiting for data, and peak memory.

A run that is correct but slow wastes as much as one that is wrong. Per
optimizer step the plugin takes the bridge's host-clock step and data-loader
times and the token positions of the step's micro-batches (from tensor
shapes: no device sync), and over a sliding window of steps it computes
tokens/s (this rank, and all ranks assuming equal batches), MFU = 6 N x
tokens/s / (devices x peak) when the device's peak is known (a small table,
or the ``peak_tflops`` option), and the data-wait fraction. It logs them as
``throughput/*`` metrics, reports ``DATALOADER_BOUND`` when at least half
the steps of the window waited for data more than a threshold share of their
time, or when the window's wait share without its longest waits is over that
threshold, and ``MEMORY_NEAR_LIMIT`` when the peak
memory (CUDA's reserved peak, or the process's peak RSS on CPU) nears the
device's. Per-rank stragglers are ``grad_sync``'s ``STRAGGLER_RANK``.

Neither rule is the window's plain summed share: with 10 ms steps one or
two host stalls inside the data fetch (a garbage collection, the scheduler
of a loaded machine: tens of milliseconds) outweighed the rest of a 20-step
window and made a clean CPU run "data-loader bound", while one stalled
compute step hid a loader that made every other step wait. A loop that waits
on data either waits in half its steps or more (counted step by step, the
count kept as steps enter and leave the window), or stalls in fewer steps
for long: a loader that waits 1 s every fourth step spends most of the
window waiting, and still does once the longest-waiting tenth of the
window's steps (2 of 20) is left out with their step times, which is what
leaves a clean run's few stalls out.
"""
from __future__ import annotations

import os
import resource
import statistics
from collections import deque
from operator import itemgetter
from typing import Any

from pydantic import BaseModel, ConfigDict, Field

from harness.lib.cost import peak_for
from harness.core.findings import FindingCode, Severity
from harness.core.hookspecs import hookimpl
from harness.core.plugin import Plugin
from harness.lib.tokens import count_parameters

DATALOADER_BOUND = FindingCode(
    "DATALOADER_BOUND", Severity.WARNING, "steps spend much of their time waiting for the data loader", "performance#dataloader_bound"
)
MEMORY_NEAR_LIMIT = FindingCode(
    "MEMORY_NEAR_LIMIT", Severity.WARNING, "peak memory is close to the device's capacity", "performance#memory_near_limit"
)
STEP, WAIT = itemgetter(0), itemgetter(1)  # of a window entry (step seconds, data-wait seconds, tokens)


class ThroughputOptions(BaseModel):
    """Options of the ``throughput`` plugin."""

    model_config = ConfigDict(extra="forbid")

    window: int = Field(20, ge=2, description="Steps averaged for tokens/s, MFU and the data-wait fraction.")
    skip_first: int = Field(3, ge=0, description="Steps left out at the start of each train() call (compilation, warm caches, first batches).")
    log_every: int = Field(10, ge=1, description="Log throughput/* metrics every this many steps.")
    dataloader_bound_fraction: float = Field(
        0.3, gt=0, lt=1, description="DATALOADER_BOUND when in half the steps of the window or more the data-loader wait exceeds this share "
                                     "of the step time, or when it exceeds this share of the window's time without the longest-waiting "
                                     "tenth of its steps.")
    peak_tflops: float | None = Field(
        None, gt=0, description="Dense 16-bit peak per device in TFLOPS for MFU (default: from the CUDA device name; none on CPU).")
    memory_fraction: float = Field(
        0.95, gt=0, le=1, description="MEMORY_NEAR_LIMIT when peak memory exceeds this share of the device's (CUDA) or the machine's (CPU).")
    check_memory_every: int = Field(50, ge=1, description="Read the peak memory at the first measured step and then every this many steps.")


class Throughput(Plugin):
    """tokens/s, MFU and data-wait share per window of steps; DATALOADER_BOUND and MEMORY_NEAR_LIMIT."""

    name = "throughput"
    Options = ThroughputOptions
    CODES = (DATALOADER_BOUND, MEMORY_NEAR_LIMIT)
    options: ThroughputOptions

    def __init__(self) -> None:
        self.options = ThroughputOptions()
        self._window: deque[tuple[float, float, int]] = deque()
        self._waiting = 0  # steps of the window whose wait exceeded dataloader_bound_fraction of the step
        self._seen = 0
        self._params = 0
        self._peak: float | None = None
        self._device: Any = None
        self._bound_reported = False
        self._memory_reported = False

    @hookimpl
    def on_run_start(self, trainer: Any) -> None:
        self._window = deque(maxlen=self.options.window)
        self._waiting = 0
        self._seen = 0
        self._params = count_parameters(trainer.model)[0]
        self._device = trainer.args.device
        self._peak = self.options.peak_tflops
        if self._peak is None and getattr(self._device, "type", "") == "cuda":
            import torch

            self._peak = peak_for(torch.cuda.get_device_name(self._device))

    @hookimpl
    def on_step_end(self, ctx: Any, step: int, metrics: dict[str, Any]) -> None:
        tokens = int(metrics.get("tokens") or 0)
        self._seen += 1
        step_time, data_time = metrics.get("step_time"), metrics.get("data_time")
        if self._seen <= self.options.skip_first or not step_time:
            return
        window, entry = self._window, (float(step_time), float(data_time or 0.0), tokens)
        if len(window) == window.maxlen:
            self._waiting -= self._waits(window[0])
        window.append(entry)
        self._waiting += self._waits(entry)
        if self._seen % self.options.check_memory_every == 0 or self._seen == self.options.skip_first + 1:
            self._check_memory(ctx, step)
        if len(window) < self.options.window:
            return
        logging = self._seen % self.options.log_every == 0
        trimmed = None
        if not self._bound_reported and self._waiting:  # no step waited: no share without the longest waits can be over
            trimmed = self._trimmed_share()
        bound = trimmed is not None and (2 * self._waiting >= len(window) or trimmed > self.options.dataloader_bound_fraction)
        if not (logging or bound):
            return
        seconds = sum(w[0] for w in window)
        wait = sum(w[1] for w in window) / seconds if seconds > 0 else 0.0
        if logging:
            ctx.log_metrics(self.rates(ctx.world_size) | {"throughput/data_wait_fraction": wait}, step=step)
        if bound:
            assert trimmed is not None
            self._bound_reported = True
            self._report_bound(ctx, step, wait, trimmed)

    def _waits(self, entry: tuple[float, float, int]) -> int:
        """1 when this step waited for data more than ``dataloader_bound_fraction`` of its time."""
        return int(entry[1] > self.options.dataloader_bound_fraction * entry[0])

    def _trimmed(self) -> int:
        """How many of the window's longest waits the trimmed share leaves out: a tenth of its steps, at least one."""
        return max(1, round(len(self._window) / 10))

    def _trimmed_share(self) -> float:
        """The window's data-wait share without its longest waits and their steps' times (a clean run's host stalls in
        the fetch are rare: they go; a loader that stalls every few steps keeps most of its stalls)."""
        kept = sorted(self._window, key=WAIT)[: len(self._window) - self._trimmed()]
        seconds = sum(map(STEP, kept))
        return sum(map(WAIT, kept)) / seconds if seconds > 0 else 0.0

    def _report_bound(self, ctx: Any, step: int, wait: float, trimmed: float) -> None:
        window, threshold = self._window, self.options.dataloader_bound_fraction
        median_wait, median_step = statistics.median(w[1] for w in window), statistics.median(w[0] for w in window)
        on_cpu = getattr(self._device, "type", "cpu") == "cpu"
        effect = ("the training loop waits on data while batches are made (on CPU the loader and the model share the cores)"
                  if on_cpu else "the accelerator idles while batches are made")
        self.report(
            DATALOADER_BOUND.code,
            f"over the {len(window)} steps to step {step}, rank {ctx.rank} waited for the data loader for more than "
            f"{threshold:.0%} of the step in {self._waiting} of them, {wait:.0%} of the window's time ({trimmed:.0%} "
            f"without its {self._trimmed()} longest waits; median wait {median_wait * 1000:.1f} ms of a median step of "
            f"{median_step * 1000:.1f} ms): {effect}.",
            step=step,
            evidence={"wait_fraction": round(wait, 4), "trimmed_wait_fraction": round(trimmed, 4), "trimmed_steps": self._trimmed(),
                      "steps_waiting": self._waiting, "window_steps": len(window),
                      "median_wait_s": median_wait, "median_step_s": median_step,
                      "threshold": threshold, "device": str(getattr(self._device, "type", "cpu"))},
        )

    def rates(self, world_size: int) -> dict[str, float]:
        """The window's tokens/s (this rank, all ranks) and MFU when the peak is known."""
        seconds = sum(w[0] for w in self._window)
        tokens = sum(w[2] for w in self._window)
        if seconds <= 0:
            return {}
        per_rank = tokens / seconds
        out = {"throughput/tokens_per_s": per_rank * world_size, "throughput/tokens_per_s_per_rank": per_rank}
        if self._peak and self._params:
            out["throughput/mfu"] = 6.0 * self._params * per_rank / (self._peak * 1e12)
        return out

    def _check_memory(self, ctx: Any, step: int) -> None:
        if self._memory_reported:
            return
        peak, limit, what = peak_memory(self._device)
        if not peak or not limit:
            return
        ctx.log_metrics({"throughput/peak_memory_gb": peak / 1e9}, step=step)
        if peak / limit > self.options.memory_fraction:
            self._memory_reported = True
            self.report(
                MEMORY_NEAR_LIMIT.code,
                f"peak memory on rank {ctx.rank} reached {peak / 1e9:.2f} GB of {limit / 1e9:.2f} GB ({peak / limit:.0%}, {what}) by step "
                f"{step}: a longer batch or an evaluation can run out of memory.",
                step=step,
                evidence={"peak_bytes": peak, "limit_bytes": limit, "fraction": round(peak / limit, 4), "measure": what,
                          "threshold": self.options.memory_fraction},
            )

    @hookimpl
    def report_sections(self, run: Any) -> Any:
        """Tokens/s and data wait from the step records; MFU when the run's card knows the parameters and a peak."""
        from harness.report.model import ReportSection, md_table
        from harness.report.record import as_float

        rows = [(as_float(r.get("step_tokens")), as_float(r.get("step_time")), as_float(r.get("data_time"))) for r in run.steps]
        rows = [(t, s, d or 0.0) for t, s, d in rows if t and s and s > 0]
        if len(rows) < 2:
            return None
        rates = sorted(t / s for t, s, _ in rows)
        waits = sorted(d / s for _, s, d in rows)
        table = [["tokens/s, all ranks (median)", f"{statistics.median(rates):,.0f}"],
                 ["tokens/s, 10th-90th percentile", f"{rates[len(rates) // 10]:,.0f} - {rates[(9 * len(rates)) // 10]:,.0f}"],
                 ["data-loader wait (median share of a step)", f"{statistics.median(waits):.1%}"],
                 ["steps measured", str(len(rows))]]
        return ReportSection("Throughput", md_table(["", ""], table) + "\n")


def peak_memory(device: Any) -> tuple[int | None, int | None, str]:
    """(peak bytes, capacity bytes, what was measured) for the training device."""
    if getattr(device, "type", "") == "cuda":
        import torch

        peak = int(torch.cuda.max_memory_reserved(device))
        limit = int(torch.cuda.get_device_properties(device).total_memory)
        return peak, limit, "CUDA reserved peak"
    try:
        peak = int(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss) * 1024  # kilobytes on Linux
        limit = int(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"))
    except (ValueError, OSError, AttributeError):
        return None, None, ""
    return peak, limit, "process peak RSS of machine memory"


__all__ = ["Throughput", "ThroughputOptions", "peak_memory"]
