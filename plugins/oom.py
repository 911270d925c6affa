"""oom: an out-of-memory error that ends a run becomes OUT_OF_MEMORY, with the batch, the memory and the likely causes.

Every step, at the first micro-batch, the plugin reads host-side memory
counters (CUDA: the caching allocator's allocated/reserved/peak counters;
CPU: RSS through one ``pread`` of ``/proc/self/statm``) and keeps a
reference to each micro-batch of the step (shapes are metadata): no device
read, no collective, a few microseconds per step. On CUDA it also records
the allocator's history (Python stacks of every allocation) during the
first ``history_steps`` steps of each ``train()`` call, then turns it off.

When ``train()`` ends with an out-of-memory error (``torch.OutOfMemoryError``,
a RuntimeError saying "out of memory", MemoryError), ``on_run_end`` reports
OUT_OF_MEMORY (critical) with the step and micro-batch, where the allocation
failed (from the traceback), the batch's shapes and sequence lengths, the
memory before the step and at the failure, the largest allocations (CUDA: an
allocator snapshot summarised to ``oom/snapshot.rank-<r>.json``; every
device: the largest tensors alive, named when they are parameters, gradients
or optimizer state), a capture of the step's micro-batches and the likely
causes ranked (:mod:`harness.lib.oom_causes`). Cost only after the OOM: the
snapshot, a walk over the garbage collector's objects (about a second in a
big process) and one read of the attention masks. The error still reaches
the caller.
"""
from __future__ import annotations

import logging
import statistics
from collections import deque
from typing import Any

import torch
from pydantic import BaseModel, ConfigDict, Field

from harness.core.findings import FindingCode, Severity
from harness.core.hookspecs import hookimpl
from harness.core.plugin import Plugin
from harness.core.strictjson import dumps
from harness.lib.capture import strict_json, write_capture
from harness.lib.memory_stats import capacity, device_of, gib, largest_tensors, memory_counters, tensor_names
from harness.lib.oom_batch import describe_micro_batch, padded_shape, training_setup
from harness.lib.oom_causes import OomFacts, message_numbers, oom_error, phase_of, rank_causes
from harness.lib.oom_snapshot import start_history, stop_history, summarise_snapshot, take_snapshot

log = logging.getLogger("harness.oom")
CPU_RSS_EVERY = 10  # on CPU the RSS is read at every step up to this one, then every this many steps

OUT_OF_MEMORY = FindingCode(
    "OUT_OF_MEMORY",
    Severity.CRITICAL,
    "Training ended with an out-of-memory error; the finding holds the batch, the memory and the likely causes.",
    "memory#out_of_memory",
)
LENGTHS_KEPT = 512  # the latest steps' longest padded lengths, for "longer than usual"


class OomOptions(BaseModel):
    """Options of the ``oom`` plugin."""

    model_config = ConfigDict(extra="forbid")

    history_steps: int = Field(
        3, ge=0, description="CUDA only: record the allocator's history (a Python stack per allocation) during the first this many "
        "steps of each train() call, so that an OOM there names the code behind each large block; 0 turns it off.")
    max_entries: int = Field(
        10_000, ge=1, description="CUDA only: allocator events the history keeps (a ring buffer of a few KB each; the frames of live "
        "blocks are kept apart from it, so a small ring still names what holds the memory).")
    top: int = Field(20, ge=1, description="How many allocations (CUDA snapshot) and tensors (every device) the OOM files list.")
    scan_tensors: bool = Field(
        True, description="After an OOM, walk the garbage collector's objects for the largest tensors alive (about a second in a big "
        "process; CPU runs have no allocator snapshot, so this is their list of what held the memory).")


class OomForensics(Plugin):
    """Turns an out-of-memory crash into OUT_OF_MEMORY with the batch shape, memory before the step and the likely causes."""

    name = "oom"
    Options = OomOptions
    CODES = (OUT_OF_MEMORY,)
    options: OomOptions

    def __init__(self) -> None:
        self.options = OomOptions()
        self._device: Any = None  # a torch.device from on_run_start; none at construction (validation loads no torch)
        self._trainer: Any = None
        self._recording = False
        self._reset()

    def _reset(self) -> None:
        self._step: int | None = None
        self._micro: int | None = None
        self._batches: list[tuple[int, Any]] = []  # the step's micro-batches so far
        self._before: dict[str, int | None] = {}
        self._previous: dict[str, int | None] = {}
        self._in_step = False
        self._steps_done = 0
        self._lengths: deque[int] = deque(maxlen=LENGTHS_KEPT)  # each earlier step's longest padded length
        self._step_length = 0  # the longest padded length of the step in flight
        self._longest: int | None = None

    # -- every step: host counters and references only ---------------------------------------------

    @hookimpl
    def on_run_start(self, ctx: Any, trainer: Any) -> None:
        self._reset()
        self._trainer = trainer
        self._device = device_of(getattr(trainer, "model", None))
        if self._device.type == "cuda" and self.options.history_steps > 0:
            self._recording = start_history(self.options.max_entries)

    @hookimpl
    def inspect_batch(self, batch: dict[str, Any], step: int, micro_step: int) -> None:
        if micro_step == 0:
            if self._step_length:  # the finished step's longest padded length joins the run's history
                self._lengths.append(self._step_length)
                self._longest = max(self._longest or 0, self._step_length)
            self._step_length = 0
            if self._device.type != "cpu" or step <= CPU_RSS_EVERY or step % CPU_RSS_EVERY == 0:
                # CUDA: the allocator's host counters, every step; CPU: the RSS is a read of /proc, slow and slowly moving:
                # every step for the first CPU_RSS_EVERY steps, then every CPU_RSS_EVERY-th (the last read stands for the step)
                self._previous, self._before = self._before, memory_counters(self._device, peak=False)
            self._batches = []
        self._step, self._micro, self._in_step = step, micro_step, True
        self._batches.append((micro_step, batch))
        shape = padded_shape(batch)  # tensor metadata only
        if shape is not None and shape[1] > self._step_length:
            self._step_length = shape[1]

    @hookimpl
    def on_step_end(self, step: int) -> None:
        self._in_step = False
        self._steps_done += 1
        if self._recording and self._steps_done >= self.options.history_steps:
            stop_history()
            self._recording = False

    # -- the end of the run ---------------------------------------------------------------------------

    @hookimpl
    def on_run_end(self, ctx: Any, status: str, error: BaseException | None) -> None:
        try:
            found = oom_error(error) if status == "crashed" else None
            if found is not None:
                try:
                    self._forensics(ctx, found)
                except Exception as exc:  # noqa: BLE001 - the finding must survive a failure of the forensics
                    log.exception("harness oom: the forensics failed")
                    self.report(OUT_OF_MEMORY.code, f"out of memory at step {self._step} ({type(found).__name__}: {str(found)[:300]}); "
                                f"the forensics failed ({type(exc).__name__}: {exc})", step=self._step or 0,
                                evidence={"error": str(found)[:600], "forensics_error": f"{type(exc).__name__}: {exc}",
                                          "memory_before_step": self._before})
        finally:
            if self._recording:
                stop_history()
                self._recording = False
            self._batches = []  # the batches of a failed step are not kept past the run

    def _forensics(self, ctx: Any, error: BaseException) -> None:
        phase, where = phase_of(error)
        if phase == "unknown" and self._in_step:
            phase = "step"  # inside a training step, the frames name no pass
        step, micro = self._step, self._micro if self._in_step else None
        setup = training_setup(self._trainer)
        batches = [describe_micro_batch(m, b) for m, b in self._batches] if self._in_step else []
        failing = batches[-1] if batches else {}
        device = self._device if self._device is not None else torch.device("cpu")
        at_oom, room = memory_counters(device), capacity(device)
        numbers = message_numbers(str(error))
        files: dict[str, str] = {}
        snapshot = self._snapshot(ctx, files)
        unallocated, reserved = numbers["reserved_unallocated"], None
        if snapshot is not None:
            unallocated, reserved = snapshot["reserved_unallocated_bytes"] / 2**30, snapshot["reserved_bytes"] / 2**30
        elif unallocated is not None and numbers["allocated"] is not None:
            reserved = numbers["allocated"] + unallocated
        tensors = self._tensors() if self.options.scan_tensors else None
        facts = OomFacts(
            step=step, phase=phase if phase != "step" else "unknown", steps_done=self._steps_done,
            rows=failing.get("rows"), seq_len=failing.get("longest"), longest_before=self._longest,
            median_before=statistics.median(self._lengths) if self._lengths else None, reserved_unallocated=unallocated, reserved=reserved,
            gradient_checkpointing=setup["gradient_checkpointing"], attn_implementation=setup["attn_implementation"],
            sharding=setup["sharding"], eval_batch=setup["per_device_eval_batch_size"], train_batch=setup["per_device_train_batch_size"],
        )
        causes = rank_causes(facts)
        capture = self._capture(ctx, step, phase, causes)
        evidence: dict[str, Any] = {
            "step": step, "micro_batch": micro, "phase": phase, "failed_at": where, "in_training_step": self._in_step,
            "steps_completed": self._steps_done, "error": f"{type(error).__name__}: {str(error)[:600]}",
            "oom_message_gib": numbers, "batch": failing or None, "micro_batches": batches,
            "longest_padded_length_before": self._longest, "memory_before_step": self._before,
            "memory_previous_step": self._previous, "memory_at_oom": at_oom, "device_memory": room,
            "device": str(self._device), "setup": setup, "causes": causes,
            "largest_tensors": (tensors or {}).get("tensors", [])[:10], "snapshot": snapshot and {
                k: snapshot[k] for k in ("reserved_bytes", "allocated_bytes", "reserved_unallocated_bytes", "largest_free_block_bytes")},
            "capture": str(capture) if capture else None, **files,
        }
        files["forensics"] = str(self._write(ctx, "oom", {**evidence, "largest_tensors": tensors, "snapshot": snapshot}))
        evidence.update(files)
        message = self._message(step, micro, phase, failing, at_oom, causes, files, tensors)
        log.error("harness oom: %s", message)
        self.report(OUT_OF_MEMORY.code, message, step=step if step is not None else 0, evidence=strict_json(evidence))

    def _snapshot(self, ctx: Any, files: dict[str, str]) -> dict[str, Any] | None:
        if self._device is None or self._device.type != "cuda":
            return None
        raw = take_snapshot()
        if raw is None:
            return None
        summary = summarise_snapshot(raw, self._device.index, top=self.options.top)
        files["snapshot_file"] = str(self._write(ctx, "snapshot", summary))
        return summary

    def _tensors(self) -> dict[str, Any] | None:
        try:
            names = tensor_names(getattr(self._trainer, "model", None), getattr(self._trainer, "optimizer", None))
            return largest_tensors(self.options.top, names)
        except Exception as exc:  # noqa: BLE001 - the finding matters more than the list
            log.warning("harness oom: the tensor scan failed (%s: %s)", type(exc).__name__, exc)
            return None

    def _capture(self, ctx: Any, step: int | None, phase: str, causes: list[dict[str, Any]]) -> Any:
        """The step's micro-batches as a capture (no forward pass: memory ran out), unless the OOM was outside the step."""
        if not self._in_step or not self._batches or step is None or phase in ("evaluation", "checkpoint"):
            return None
        try:
            result = write_capture(
                ctx, step=step, code=OUT_OF_MEMORY.code, reason=f"out of memory in the {phase} of step {step}, micro-batch {self._micro}",
                micro_batches=[(m, b, None) for m, b in self._batches], context={"oom_causes": [c["cause"] for c in causes]},
                no_recompute="out of memory: no forward pass",
            )
            return result.json_path
        except Exception as exc:  # noqa: BLE001
            log.warning("harness oom: the capture failed (%s: %s)", type(exc).__name__, exc)
            return None

    def _write(self, ctx: Any, kind: str, data: dict[str, Any]) -> Any:
        path = ctx.path("oom", f"{kind}.rank-{ctx.rank}.json")
        path.write_text(dumps(data, indent=1, default=str), encoding="utf-8")
        return path

    def _message(self, step: int | None, micro: int | None, phase: str, failing: dict[str, Any], at_oom: dict[str, Any],
                 causes: list[dict[str, Any]], files: dict[str, str], tensors: dict[str, Any] | None) -> str:
        where = f"step {step}, micro-batch {micro}" if micro is not None else f"after step {step}" if step else "before the first step"
        parts = [f"out of memory at {where} ({phase})"]
        if failing.get("rows"):
            lengths = f", sequence lengths {failing['shortest']}..{failing['longest']}" if failing.get("sequence_lengths") else ""
            longest = f", the longest before was {self._longest}" if self._longest else ""
            parts.append(f"micro-batch {failing['rows']}x{failing['padded_length']} tokens{lengths}{longest}")
        parts.append(f"memory before the step: {self._memory_text(self._before)}; at the OOM: {self._memory_text(at_oom)}")
        top = causes[0]
        parts.append(f"likely cause: {top['title']} ({top['evidence'][0]}), then {', '.join(c['cause'] for c in causes[1:3])}")
        biggest = (tensors or {}).get("tensors") or []
        if biggest:
            t = biggest[0]
            parts.append(f"largest tensor {t['name'] or 'unnamed'} {t['shape']} {t['dtype']} ({gib(t['bytes'])})")
        if files.get("snapshot_file"):
            parts.append(f"top allocations in {files['snapshot_file']}")
        return "; ".join(parts)

    @staticmethod
    def _memory_text(counters: dict[str, Any]) -> str:
        if not counters:
            return "not read"
        if "allocated" in counters:
            return (f"allocated {gib(counters['allocated'])}, reserved {gib(counters['reserved'])}, "
                    f"peak allocated {gib(counters['peak_allocated'])}")
        peak = f" (peak {gib(counters['peak_rss'])})" if counters.get("peak_rss") is not None else ""
        return f"RSS {gib(counters.get('rss'))}{peak}"


__all__ = ["OUT_OF_MEMORY", "OomForensics", "OomOptions"]
