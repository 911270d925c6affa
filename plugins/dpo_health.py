"""dpo_health: how a preference run (TRL's DPOTrainer) and its SFT counterpart are really going.

DPO's loss falls in almost every run, also in bad ones, so the loss says
little. What users of TRL learn the hard way: the chosen answers' own
log-probabilities can fall while the margin grows (the model unlearns both
answers, the rejected one faster); accuracy near 1.0 early with exploding
margins means pairs too easy to teach anything (or memorised); a chosen
answer that is nearly always the longer one teaches length, not quality.
The plugin reads TRL's logged ``rewards/*`` and ``logps/*`` (host floats:
no device sync) and, once at the start, the lengths of the tokenised pairs.
For SFT it checks how much of a batch the loss sees: most tokens masked out
(prompts far longer than completions) leaves little to learn from; the
counts are queued with ``defer`` and read in the step guard's one transfer.
"""
from __future__ import annotations

import math
import statistics
from collections.abc import Mapping
from typing import Any

import torch
from pydantic import BaseModel, ConfigDict, Field

from harness.core.findings import FindingCode, Severity
from harness.lib.early_late import EarlyLateMedians
from harness.lib.hashing import dataset_rows
from harness.core.hookspecs import hookimpl
from harness.core.plugin import Plugin

PLAYBOOK = "dpo-health#"
DPO_CHOSEN_LOGPS_FALLING = FindingCode("DPO_CHOSEN_LOGPS_FALLING", Severity.WARNING,
                                       "the chosen answers' log-probability falls while the margin grows", PLAYBOOK + "dpo_chosen_logps_falling")
DPO_ACCURACY_SATURATED = FindingCode("DPO_ACCURACY_SATURATED", Severity.WARNING,
                                     "reward accuracy near 1.0 early with growing margins", PLAYBOOK + "dpo_accuracy_saturated")
DPO_LENGTH_BIAS = FindingCode("DPO_LENGTH_BIAS", Severity.WARNING, "the chosen answer is systematically the longer one", PLAYBOOK + "dpo_length_bias")
DPO_NONFINITE_REWARDS = FindingCode("DPO_NONFINITE_REWARDS", Severity.ERROR, "DPO rewards or log-probabilities are NaN or Inf",
                                    PLAYBOOK + "dpo_nonfinite_rewards")
SFT_FEW_LABEL_TOKENS = FindingCode("SFT_FEW_LABEL_TOKENS", Severity.WARNING, "most tokens of an SFT batch are masked out of the loss",
                                   PLAYBOOK + "sft_few_label_tokens")
DPO_KEYS = ("rewards/chosen", "rewards/rejected", "rewards/margins", "rewards/accuracies", "logps/chosen", "logps/rejected")


class DpoHealthOptions(BaseModel):
    """Options of the ``dpo_health`` plugin."""

    model_config = ConfigDict(extra="forbid")

    min_logs: int = Field(6, ge=3, description="Logged points needed before trends are judged (logps falling).")
    chosen_reward_drop: float = Field(
        2.0, gt=0, description="DPO_CHOSEN_LOGPS_FALLING when the late median of rewards/chosen (beta x the chosen answers' log-prob "
        "change against the reference, on the same samples) is below minus this, falling, while the margin grew.")
    saturated_accuracy: float = Field(0.98, gt=0.5, le=1, description="Reward accuracy that counts as saturated.")
    saturated_logs: int = Field(3, ge=1, description="Consecutive logged points at saturated accuracy needed for DPO_ACCURACY_SATURATED.")
    early_fraction: float = Field(0.3, gt=0, le=1, description="Saturation counts as early before this share of the planned steps.")
    length_bias_fraction: float = Field(0.8, gt=0.5, le=1, description="DPO_LENGTH_BIAS when the chosen answer is longer in this share of the pairs whose lengths differ.")
    min_pairs: int = Field(20, ge=2, description="Pairs with different lengths needed to judge length bias.")
    max_pairs: int = Field(20_000, ge=10, description="Pairs read from the start of the dataset for the length check.")
    min_label_fraction: float = Field(0.05, gt=0, lt=1, description="SFT_FEW_LABEL_TOKENS when fewer than this share of a batch's tokens carry a label.")
    label_batches: int = Field(8, ge=1, description="SFT micro-batches checked at the start (each check counts the labels on the device, read with the step's other values); then one per `every` steps.")
    every: int = Field(200, ge=1, description="Steps between SFT label checks after the first `label_batches`.")


class DpoHealth(Plugin):
    """DPO: chosen log-probs, accuracy saturation, length bias, non-finite rewards; SFT: batches with few labelled tokens."""

    name = "dpo_health"
    Options = DpoHealthOptions
    CODES = (DPO_CHOSEN_LOGPS_FALLING, DPO_ACCURACY_SATURATED, DPO_LENGTH_BIAS, DPO_NONFINITE_REWARDS, SFT_FEW_LABEL_TOKENS)
    options: DpoHealthOptions

    def __init__(self) -> None:
        self.options = DpoHealthOptions()
        self._kind: str | None = None
        self._history: list[tuple[int, dict[str, float]]] = []
        self._trend = _ChosenTrend()  # the points that carry rewards/chosen and rewards/margins, their thirds kept sorted
        self._max_steps = 0
        self._checked_batches = 0
        self._label_checks: list[tuple[int, int]] = []  # (step, micro_step) of the counts deferred this step

    @hookimpl
    def on_run_start(self, trainer: Any) -> None:
        names = {cls.__name__ for cls in type(trainer).__mro__}
        self._kind = "dpo" if "DPOTrainer" in names else "sft" if "SFTTrainer" in names else None
        # outside TRL's trainers: no per-step call; the SFT label check needs its batches, the DPO check its logs
        self.idle_hooks("inspect_batch", "on_before_optimizer_step", idle=self._kind != "sft")
        self.idle_hooks("on_log", idle=self._kind != "dpo")
        self._history = []
        self._trend = _ChosenTrend()
        self._checked_batches = 0
        self._label_checks = []
        self._max_steps = int(trainer.state.max_steps or trainer.args.max_steps or 0)

    def _report_once(self, ctx: Any, code: FindingCode, message: str, step: int, evidence: dict[str, Any]) -> None:
        self.report(code.code, message, step=step, evidence=evidence, limit=1)

    # -- DPO ---------------------------------------------------------------------------------------------------------

    @hookimpl
    def inspect_dataset(self, ctx: Any, dataset: Any, split: str) -> None:
        if self._kind != "dpo" or split != "train" or not ctx.is_main:
            return
        try:
            size = min(len(dataset), self.options.max_pairs)
        except TypeError:
            return
        chosen, rejected = dataset_rows(dataset, "chosen_ids", range(size)), dataset_rows(dataset, "rejected_ids", range(size))
        if chosen is None or rejected is None:
            return
        pairs = [(len(c), len(r)) for c, r in zip(chosen, rejected) if len(c) != len(r)]
        if len(pairs) < self.options.min_pairs:
            return
        longer = sum(1 for c, r in pairs if c > r) / len(pairs)
        if longer < self.options.length_bias_fraction:
            return
        mean_chosen, mean_rejected = statistics.fmean(len(c) for c in chosen), statistics.fmean(len(r) for r in rejected)
        self._report_once(
            ctx, DPO_LENGTH_BIAS,
            f"in {longer:.0%} of the {len(pairs)} training pairs whose answers differ in length the chosen answer is the longer one "
            f"(mean {mean_chosen:.1f} vs {mean_rejected:.1f} tokens over {size} pairs): DPO can learn 'longer is better' instead of quality.",
            0, {"chosen_longer_fraction": round(longer, 4), "pairs_compared": len(pairs), "pairs_read": size,
                "mean_chosen_tokens": mean_chosen, "mean_rejected_tokens": mean_rejected},
        )

    @hookimpl
    def on_log(self, ctx: Any, step: int, logs: dict[str, float]) -> None:
        if self._kind != "dpo" or not ctx.is_main or not any(k in logs for k in DPO_KEYS):
            return
        values = {k: float(logs[k]) for k in DPO_KEYS if isinstance(logs.get(k), (int, float))}
        bad = {k: v for k, v in values.items() if not math.isfinite(v)}
        if bad:
            self._report_once(ctx, DPO_NONFINITE_REWARDS, f"TRL logged non-finite DPO values at step {step}: "
                              + ", ".join(f"{k}={v}" for k, v in bad.items()) + " (the policy or reference model produced NaN/Inf log-probs).",
                              step, {"values": {k: str(v) for k, v in bad.items()}})
            return
        self._history.append((step, values))
        if len(self._history) > 2 * self.options.saturated_logs:  # the saturation check reads the last saturated_logs points only
            del self._history[:-self.options.saturated_logs]
        self._trend.add(step, values)
        self._check_saturation(ctx, step)
        self._check_chosen_logps(ctx, step)

    def _check_saturation(self, ctx: Any, step: int) -> None:
        o = self.options
        recent = self._history[-o.saturated_logs:]
        if len(recent) < o.saturated_logs or (self._max_steps and step > o.early_fraction * self._max_steps):
            return
        accuracies = [v.get("rewards/accuracies", 0.0) for _, v in recent]
        margins = [v.get("rewards/margins", 0.0) for _, v in recent]
        if min(accuracies) < o.saturated_accuracy or not all(b > a for a, b in zip(margins, margins[1:])):
            return
        self._report_once(
            ctx, DPO_ACCURACY_SATURATED,
            f"reward accuracy stayed at or above {o.saturated_accuracy:.0%} for {len(recent)} logged points up to step {step} "
            f"({step / self._max_steps if self._max_steps else 0:.0%} of the run) while the margin grew {margins[0]:.3g} -> {margins[-1]:.3g}: "
            "the pairs are too easy to teach anything, or the model memorises them.",
            step, {"accuracies": accuracies, "margins": margins, "steps": [s for s, _ in recent]},
        )

    def _check_chosen_logps(self, ctx: Any, step: int) -> None:
        """rewards/chosen, not logps/chosen: the reward compares the same samples with the reference, so batch-to-batch
        differences in answer length cancel out."""
        trend = self._trend  # medians of the first and last third of the points, kept sorted: O(log n) per log, not O(n log n)
        if len(trend.chosen) < self.options.min_logs:
            return
        chosen_early, chosen_late = trend.chosen.early(), trend.chosen.late()
        margin_early, margin_late = trend.margins.early(), trend.margins.late()
        if chosen_late < -self.options.chosen_reward_drop and chosen_late < chosen_early and margin_late > margin_early:
            logps = trend.logps_first_last
            self._report_once(
                ctx, DPO_CHOSEN_LOGPS_FALLING,
                f"the chosen answers lost probability against the reference: rewards/chosen fell from a median {chosen_early:.3g} to "
                f"{chosen_late:.3g} (steps {trend.first_step}-{step}) while the reward margin grew "
                f"{margin_early:.3g} -> {margin_late:.3g}: "
                "the model pushes the rejected answers down faster than it keeps the chosen ones up, and can drift from both.",
                step, {"early_rewards_chosen": chosen_early, "late_rewards_chosen": chosen_late, "early_margin": margin_early,
                       "late_margin": margin_late, "logps_chosen_first_last": logps},
            )

    # -- SFT -----------------------------------------------------------------------------------------------------------

    @hookimpl
    def inspect_batch(self, ctx: Any, batch: Any, step: int, micro_step: int) -> None:
        if self._kind != "sft" or not isinstance(batch, Mapping) or batch.get("labels") is None:
            return
        due = self._checked_batches < self.options.label_batches or (micro_step == 0 and step % self.options.every == 0)
        if not due:
            return
        self._checked_batches += 1
        labels = batch["labels"]
        mask = batch.get("attention_mask")
        # counted on the device and read in the guard's one transfer (torch.full: no host-built tensor in the device's batch)
        self.defer("tokens", mask.sum() if mask is not None else torch.full((), labels.numel(), device=labels.device))
        self.defer("labelled", (labels != -100).sum())
        self._label_checks.append((step, micro_step))

    @hookimpl
    def on_before_optimizer_step(self, ctx: Any) -> None:
        checks, self._label_checks = self._label_checks, []
        for (step, micro_step), tokens, labelled in zip(checks, self.deferred("tokens"), self.deferred("labelled")):
            self._check_labels(ctx, step, micro_step, int(tokens), int(labelled))

    def _check_labels(self, ctx: Any, step: int, micro_step: int, tokens: int, labelled: int) -> None:
        if tokens and 0 < labelled < self.options.min_label_fraction * tokens:
            self._report_once(
                ctx, SFT_FEW_LABEL_TOKENS,
                f"only {labelled} of the {tokens} tokens of micro-batch {micro_step} at step {step} ({labelled / tokens:.1%}) carry a label: "
                "the loss learns from a sliver of each batch (prompts far longer than completions, or masking wider than intended).",
                step, {"labelled_tokens": labelled, "tokens": tokens, "fraction": round(labelled / tokens, 4), "micro_batch": micro_step},
            )


class _ChosenTrend:
    """What the chosen-logps check needs of the logged points that carry rewards/chosen and rewards/margins."""

    def __init__(self) -> None:
        self.chosen = EarlyLateMedians()
        self.margins = EarlyLateMedians()
        self.first_step: int | None = None
        self.logps_first_last: list[float] | None = None  # logps/chosen of the first and the latest point that logged it

    def add(self, step: int, values: dict[str, float]) -> None:
        if "rewards/chosen" not in values or "rewards/margins" not in values:
            return
        self.chosen.add(values["rewards/chosen"])
        self.margins.add(values["rewards/margins"])
        self.first_step = step if self.first_step is None else self.first_step
        if "logps/chosen" in values:
            first = self.logps_first_last[0] if self.logps_first_last else values["logps/chosen"]
            self.logps_first_last = [first, values["logps/chosen"]]


__all__ = ["DpoHealth", "DpoHealthOptions"]
