"""demo_faults: the faults `harness demo` injects on purpose, each announced as a DEMO_FAULT finding.

Demo-only. It breaks a real training run in the ways the field notes
describe — a batch that turns the loss non-finite once (a transient fault)
and one that holds a NaN sample (any rerun reproduces it), infinite gradients, a
batch whose labels are all masked, a corrupted batch that spikes the loss,
a hard crash (``kill -9``) that forces a resume, a learning rate blown up
for the rest of the run (divergence), a packed batch collated by a padding
collator (documents see each other, loss on padding) — so that
the detectors can be seen catching them. Each injection is reported, so the
demo's summary can name every fault next to what the harness made of it.
"""
from __future__ import annotations

import os
import signal
from typing import Any

import torch
from pydantic import BaseModel, ConfigDict, Field

from harness.core.findings import FindingCode, Severity
from harness.core.hookspecs import hookimpl
from harness.core.plugin import Plugin
from harness.testing import EmbeddingPoison, advance_scheduler, corrupt_batch, scale_lr
from harness.testing.rerun_faults import NanBatch

DEMO_FAULT = FindingCode("DEMO_FAULT", Severity.INFO, "A fault injected on purpose by `harness demo`.", "demo#demo_fault")


class DemoFaultOptions(BaseModel):
    model_config = ConfigDict(extra="forbid")

    nan_step: int | None = Field(None, description="Step whose first micro-batch gets NaN embeddings (non-finite loss).")
    nan_batch_step: int | None = Field(
        None, description="Step whose first micro-batch gets a NaN sample (a row any forward turns NaN: a fault in the data, reproduced by a rerun).")
    inf_grad_step: int | None = Field(None, description="Step whose gradients are made infinite while the loss stays finite.")
    spike_step: int | None = Field(None, description="Step whose first micro-batch is replaced by random tokens (loss spike).")
    masked_step: int | None = Field(None, description="Step whose first micro-batch gets every label masked (-100).")
    crash_step: int | None = Field(None, description="Step at which the process kills itself with SIGKILL (once per output dir).")
    diverge_from_step: int | None = Field(None, description="From this step on every update uses the LR times diverge_lr_scale (divergence).")
    diverge_lr_scale: float = Field(30.0, gt=1, description="LR factor of the divergence fault.")
    advance_lr_on_skipped_step: int | None = Field(
        None, description="If this step's update is skipped, step the LR scheduler anyway (a loop that ignores the skip).",
    )
    padding_collator_step: int | None = Field(
        None, description="Step whose first micro-batch looks as a padding collator makes it: an all-ones attention_mask "
        "(which switches the packed mask off) and labels copied from input_ids (loss on padding and document starts).",
    )


class DemoFaults(Plugin):
    """Injects the demo's faults (NaN batch, inf gradients, masked labels, corrupted batch, hard crash) and reports each."""

    name = "demo_faults"
    Options = DemoFaultOptions
    CODES = (DEMO_FAULT,)

    def __init__(self) -> None:
        self.options = DemoFaultOptions()
        self._poison: EmbeddingPoison | None = None
        self._nan_batch: NanBatch | None = None

    @hookimpl
    def on_run_start(self, ctx: Any, trainer: Any) -> None:
        self._poison = EmbeddingPoison(trainer.model)
        self._nan_batch = NanBatch(trainer.model) if self.options.nan_batch_step is not None else None

    @hookimpl
    def inspect_batch(self, ctx: Any, batch: dict[str, Any], step: int, micro_step: int) -> None:
        o = self.options
        if micro_step != 0:
            return
        if step == o.nan_step and self._poison is not None:
            self._poison.arm()
            self.report(DEMO_FAULT.code, f"demo fault: the batch of step {step} makes the loss non-finite (NaN embeddings)", evidence={"fault": "nonfinite_loss"})
        if step == o.nan_batch_step and self._nan_batch is not None:
            self._nan_batch.mark(batch)
            self.report(DEMO_FAULT.code, f"demo fault: the batch of step {step} holds a NaN sample (any forward pass of it is NaN, a rerun's too)",
                        evidence={"fault": "nan_batch"})
        if step == o.inf_grad_step and self._poison is not None:
            self._poison.arm_gradients()
            self.report(DEMO_FAULT.code, f"demo fault: the gradients of step {step} are made infinite (the loss stays finite)", evidence={"fault": "nonfinite_grad"})
        if step == o.masked_step and torch.is_tensor(batch.get("labels")):
            batch["labels"].fill_(-100)
            self.report(DEMO_FAULT.code, f"demo fault: every label of the batch of step {step} is masked (-100)", evidence={"fault": "all_labels_masked"})
        if step == o.spike_step:  # in the data, as real corruption is: a resumed run that replays the step meets it again
            corrupt_batch(batch, None, seed=step)
            self.report(DEMO_FAULT.code, f"demo fault: the batch of step {step} was replaced by random tokens (loss spike)", evidence={"fault": "corrupted_batch"})
        if step == o.padding_collator_step and torch.is_tensor(batch.get("input_ids")):
            batch["attention_mask"] = torch.ones_like(batch["input_ids"])
            batch["labels"] = batch["input_ids"].clone()
            self.report(DEMO_FAULT.code, f"demo fault: the packed batch of step {step} gets an all-ones attention_mask and labels = input_ids "
                       "(a padding collator instead of the packing one)", evidence={"fault": "padding_collator"})
        marker = ctx.run_dir / "demo_crashed"
        if step == o.crash_step and not marker.exists():
            marker.touch()
            self.report(DEMO_FAULT.code, f"demo fault: the process kills itself (SIGKILL) at step {step}; the demo resumes from the last checkpoint", evidence={"fault": "crash"})
            os.kill(os.getpid(), signal.SIGKILL)

    @hookimpl
    def on_step_end(self, ctx: Any, step: int, metrics: dict[str, Any]) -> None:
        if step == self.options.advance_lr_on_skipped_step and metrics.get("skipped"):
            advance_scheduler(ctx.trainer)
            self.report(DEMO_FAULT.code, f"demo fault: the update of step {step} was skipped, but the LR scheduler is stepped anyway",
                       evidence={"fault": "lr_advanced_on_skip"})

    @hookimpl
    def on_before_optimizer_step(self, ctx: Any, step: int, optimizer: Any) -> None:
        start = self.options.diverge_from_step
        if start is None or step < start:
            return
        scale_lr(optimizer, self.options.diverge_lr_scale)
        if step == start:
            self.report(
                DEMO_FAULT.code,
                f"demo fault: from step {step} on every update uses {self.options.diverge_lr_scale:g}x the scheduled learning rate (divergence)",
                evidence={"fault": "divergence"},
            )
