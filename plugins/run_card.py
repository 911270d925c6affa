"""run_card: the experiment card, written when training starts and refined once throughput is measured.

The field notes' habit before every run: write down the model size, the
tokens, the compute C = 6ND, what the training state costs in memory under
the chosen precision and ZeRO stage, how long it will take, and what result
counts as success. The card is ``run_card.json`` in the run directory
(rank 0), uploaded to MLflow and shown in the report; the estimates use the
same formulas as ``harness estimate``.

Under FSDP the parameter count is the whole model's (FSDP2's DTensors and
FSDP1's flat parameters hold a rank's shard only), and the memory estimate
is ZeRO-3's: weights, gradients and optimizer state all split over the
shard group.
"""
from __future__ import annotations

import _thread
import logging
import os
import statistics
import threading
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict, Field

from harness.lib.cost import duration, memory_per_device, peak_for
from harness.core.hookspecs import hookimpl
from harness.core.received import read_received_json
from harness.core.plugin import Plugin
from harness.lib.textsafe import counted
from harness.core.strictjson import dumps
from harness.lib.runinfo import run_facts
from harness.lib.sharding import full_parameter_counts, trainer_sharding

log = logging.getLogger(__name__)

CARD_FILE = "run_card.json"


class RunCardOptions(BaseModel):
    """Options of the ``run_card`` plugin."""

    model_config = ConfigDict(extra="forbid")

    acceptance: str | None = Field(None, description="What result counts as success, written on the card (e.g. 'eval_loss < 2.1 on heldout').")
    data_sources: dict[str, float] = Field(
        default_factory=dict, description="Data sources and their mixture weights, for the card (the stage runner fills it from its config).")
    measure_after: int = Field(10, ge=2, description="Steps measured before the card's time estimate is written (the first is left out).")


class RunCard(Plugin):
    """Writes run_card.json: parameters, planned tokens, 6ND, memory per device, estimated time, data, acceptance."""

    name = "run_card"
    Options = RunCardOptions
    options: RunCardOptions

    def __init__(self) -> None:
        self.options = RunCardOptions()
        self.card: dict[str, Any] = {}
        self._path: Path | None = None
        self._samples: list[tuple[float, int]] = []

    @hookimpl
    def on_run_start(self, ctx: Any, trainer: Any) -> None:
        self._samples = []
        self.idle_hooks("inspect_batch", "on_step_end", idle=not ctx.is_main)  # rank 0 writes the card; called until it is done
        if not ctx.is_main:
            return
        facts = run_facts(trainer, ctx.world_size, ctx.stage)
        training = facts["training"]
        params, trainable = full_parameter_counts(trainer.model)
        precision, zero = training["precision"], training["deepspeed_zero_stage"] or 0
        sharding = trainer_sharding(trainer)
        shards = ctx.world_size
        if sharding.sharded:  # FSDP FULL_SHARD splits all three like ZeRO-3, over the shard group (HSDP: one replica)
            zero, shards = (3 if sharding.shard_size > 1 else 0), max(sharding.shard_size, 1)
        memory = memory_per_device(params, precision, zero, shards)
        device = trainer.args.device
        peak = None
        if getattr(device, "type", "") == "cuda":
            import torch

            peak = peak_for(torch.cuda.get_device_name(device))
        self.card = {
            "stage": facts["stage"],
            "model": facts["model"].get("class"),
            "parameters": params,
            "trainable_parameters": trainable,
            "world_size": ctx.world_size,
            "precision": precision,
            "zero_stage": zero,
            "sharding": sharding.describe() if sharding.sharded else None,
            "planned_steps": int(trainer.state.max_steps or 0) or training["max_steps"],
            "global_batch_size": training["global_batch_size"],
            "sequence_length": None,
            "planned_tokens": None,
            "compute_flops": None,
            "memory_per_device_bytes": {"weights": memory.weights, "gradients": memory.gradients, "optimizer": memory.optimizer,
                                        "total": memory.total, "note": "training state only; activations come on top"},
            "device": str(device),
            "peak_tflops": peak,
            "measured": None,
            "data_sources": dict(self.options.data_sources),
            "acceptance": self.options.acceptance,
        }
        self._path = ctx.path(CARD_FILE)
        self._write()

    @hookimpl
    def inspect_batch(self, batch: Any, micro_step: int) -> None:
        if self._path is None or self.card.get("sequence_length") is not None:
            self.idle_hooks("inspect_batch")
            return  # the plan needs the first batch's shape only
        if micro_step == 0:
            ids = batch.get("input_ids") if hasattr(batch, "get") else None
            if ids is not None and getattr(ids, "ndim", 0) == 2:
                self._plan(int(ids.shape[-1]))

    def _plan(self, seq_len: int) -> None:
        card = self.card
        card["sequence_length"] = seq_len
        if card["planned_steps"] and card["global_batch_size"]:
            card["planned_tokens"] = card["planned_steps"] * card["global_batch_size"] * seq_len
            card["compute_flops"] = 6.0 * card["parameters"] * card["planned_tokens"]
        self._write()

    @hookimpl
    def on_step_end(self, ctx: Any, step: int, metrics: dict[str, Any]) -> None:
        tokens = int(metrics.get("tokens") or 0)
        if self._path is None or self.card.get("measured") is not None:
            self.idle_hooks("on_step_end")  # measured once per run
            return
        if not metrics.get("step_time"):
            return
        self._samples.append((float(metrics["step_time"]), tokens * ctx.world_size))
        if len(self._samples) < self.options.measure_after:
            return
        measured = self._samples[1:]  # the first step pays for start-up
        step_s = statistics.median(s for s, _ in measured)
        tokens_per_s = sum(t for _, t in measured) / sum(s for s, _ in measured)
        remaining = max(0, (self.card["planned_steps"] or step) - step)
        self.card["measured"] = {
            "after_step": step, "median_step_s": step_s, "tokens_per_s": tokens_per_s,
            "estimated_total_s": step_s * (self.card["planned_steps"] or step), "estimated_remaining_s": step_s * remaining,
            "mfu": (6.0 * self.card["parameters"] * tokens_per_s / (ctx.world_size * self.card["peak_tflops"] * 1e12)) if self.card["peak_tflops"] else None,
        }
        # the estimate's file is written off the training thread (the one write inside the run's steps), by a thread
        # that this step does not wait for: ``Thread.start`` waits until the new thread runs, ~0.4 ms in place; the run
        # end waits for the file instead (the report reads the card)
        written = threading.Event()
        _thread.start_new_thread(self._write_off_thread, (written,))
        self._written = written  # only once the thread runs: the run end waits for it

    def _write_off_thread(self, written: threading.Event) -> None:
        try:
            self._write()
        except Exception:  # noqa: BLE001 - a card that cannot be written costs the card, never the run
            log.warning("run_card: could not write %s", self._path, exc_info=True)
        finally:
            written.set()

    @hookimpl(tryfirst=True)
    def on_run_end(self) -> None:
        written, self._written = getattr(self, "_written", None), None
        if written is not None:
            written.wait(timeout=30)

    def _write(self) -> None:
        if self._path is None:
            return
        tmp = self._path.with_name(f".{CARD_FILE}.tmp")
        tmp.write_text(dumps(self.card, indent=2, default=str), encoding="utf-8")
        os.replace(tmp, self._path)

    @hookimpl
    def report_sections(self, run: Any) -> Any:
        from harness.report.model import ReportSection, md_table

        try:
            card = read_received_json(run.run_dir / CARD_FILE)  # a received run's file: never a link, a FIFO or a device
        except (OSError, ValueError):
            return None
        if not isinstance(card, dict):
            return None
        memory = card.get("memory_per_device_bytes") or {}
        rows = [["parameters", f"{card.get('parameters'):,}"],
                ["planned tokens", f"{card['planned_tokens']:,}" if card.get("planned_tokens") else "-"],
                ["compute C = 6ND", f"{card['compute_flops']:.3g} FLOPs" if card.get("compute_flops") else "-"],
                [f"memory per device ({card.get('precision')}, {card.get('sharding') or 'ZeRO-' + str(card.get('zero_stage'))}, {counted(card.get('world_size'), 'ranks')})",
                 f"{memory.get('total', 0) / 1e9:.3g} GB (weights {memory.get('weights', 0) / 1e9:.3g}, gradients "
                 f"{memory.get('gradients', 0) / 1e9:.3g}, optimizer {memory.get('optimizer', 0) / 1e9:.3g}; activations extra)"]]
        measured = card.get("measured")
        if measured:
            rows.append(["measured after step " + str(measured["after_step"]),
                         f"{measured['tokens_per_s']:,.0f} tokens/s; {measured['median_step_s'] * 1000:.1f} ms per step"])
            rows.append(["estimated time for the planned steps", duration(measured["estimated_total_s"])])
            if measured.get("mfu") is not None:
                rows.append(["MFU", f"{measured['mfu']:.1%}"])
        if card.get("data_sources"):
            rows.append(["data (weight)", ", ".join(f"{k} ({v:g})" for k, v in card["data_sources"].items())])
        rows.append(["acceptance", card.get("acceptance") or "(not set: run_card.acceptance)"])
        return ReportSection("Plan and estimates (run_card)", md_table(["", ""], rows) + f"\n\nThe card: [{CARD_FILE}]({CARD_FILE}).\n")


__all__ = ["RunCard", "RunCardOptions"]
