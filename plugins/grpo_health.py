"""grpo_health: whether an online RL run (TRL's GRPOTrainer) still has something to learn from, and what it learns.

GRPO's loss is not a progress signal (it is near zero by construction: the
advantages are centred per group), so the health of a run shows in what TRL
logs next to it. The failures users meet most: every completion of a prompt
gets the same reward (``frac_reward_zero_std`` near 1: zero advantages, no
gradient); the policy's token entropy collapses, so the groups stop
exploring; completions run into ``max_completion_length`` and are cut off;
the policy drifts far from the reference (``kl``, logged when ``beta > 0``);
and the reward climbs because the policy found a shortcut (completions
growing without bound, or all alike) rather than a better answer. The plugin
reads those logged values (host floats: no device sync) from ``on_log`` and
is idle outside GRPOTrainer.
"""
from __future__ import annotations

import math
import statistics
from collections import deque
from typing import Any

from pydantic import BaseModel, ConfigDict, Field

from harness.core.findings import FindingCode, Severity
from harness.core.hookspecs import hookimpl
from harness.core.plugin import Plugin
from harness.lib.early_late import EarlyLateMedians

PLAYBOOK = "grpo-health#"
GRPO_REWARD_STD_ZERO = FindingCode("GRPO_REWARD_STD_ZERO", Severity.WARNING,
                                   "almost every group of completions got one reward: zero advantages, no learning signal",
                                   PLAYBOOK + "grpo_reward_std_zero")
GRPO_ENTROPY_COLLAPSE = FindingCode("GRPO_ENTROPY_COLLAPSE", Severity.WARNING, "the policy's token entropy collapsed: the groups stop exploring",
                                    PLAYBOOK + "grpo_entropy_collapse")
GRPO_COMPLETIONS_TRUNCATED = FindingCode("GRPO_COMPLETIONS_TRUNCATED", Severity.WARNING,
                                         "most completions are cut off at max_completion_length", PLAYBOOK + "grpo_completions_truncated")
GRPO_KL_BLOWUP = FindingCode("GRPO_KL_BLOWUP", Severity.WARNING, "the KL to the reference model is large or jumped", PLAYBOOK + "grpo_kl_blowup")
GRPO_REWARD_HACKING_SUSPECT = FindingCode("GRPO_REWARD_HACKING_SUSPECT", Severity.WARNING,
                                          "the reward rises while completions grow much longer or lose diversity",
                                          PLAYBOOK + "grpo_reward_hacking_suspect")

ZERO_STD, CLIPPED, ENTROPY, KL, REWARD, REWARD_STD, LENGTH = (
    "frac_reward_zero_std", "completions/clipped_ratio", "entropy", "kl", "reward", "reward_std", "completions/mean_length")


class GrpoHealthOptions(BaseModel):
    """Options of the ``grpo_health`` plugin."""

    model_config = ConfigDict(extra="forbid")

    min_logs: int = Field(6, ge=3, description="Logged points needed before the early and late medians are compared "
                          "(entropy drop, reward hacking).")
    zero_std_fraction: float = Field(
        0.9, gt=0, le=1, description="GRPO_REWARD_STD_ZERO counts a logged point whose frac_reward_zero_std (the share of prompts "
        "whose completions all got the same reward) is at or above this.")
    zero_std_logs: int = Field(5, ge=1, description="Consecutive logged points at or above `zero_std_fraction` needed for GRPO_REWARD_STD_ZERO.")
    entropy_floor: float = Field(0.05, ge=0, description="GRPO_ENTROPY_COLLAPSE when a logged `entropy` (the policy's mean token "
                                 "entropy over the completions, nats) is below this.")
    entropy_drop: float = Field(0.2, gt=0, lt=1, description="GRPO_ENTROPY_COLLAPSE also when the late median of `entropy` is below "
                                "this fraction of its early median.")
    clipped_ratio: float = Field(
        0.5, gt=0, le=1, description="GRPO_COMPLETIONS_TRUNCATED counts a logged point whose completions/clipped_ratio (the share of "
        "completions cut at max_completion_length) is at or above this.")
    clipped_logs: int = Field(3, ge=1, description="Consecutive logged points at or above `clipped_ratio` needed for GRPO_COMPLETIONS_TRUNCATED.")
    kl_max: float = Field(1.0, gt=0, description="GRPO_KL_BLOWUP when a logged `kl` (the mean per-token KL to the reference model, "
                          "logged when beta > 0) is above this.")
    kl_growth: float = Field(10.0, gt=1, description="GRPO_KL_BLOWUP also when `kl` reaches this many times the median of the "
                             "`kl_window` logged points before it (and at least `kl_growth_floor`).")
    kl_window: int = Field(5, ge=1, description="Logged points before the current one whose median `kl_growth` compares with.")
    kl_growth_floor: float = Field(0.1, ge=0, description="The smallest `kl` that counts as a `kl_growth` jump: KL starts at 0, so "
                                   "small values grow by large factors harmlessly.")
    reward_rise: float = Field(0.5, ge=0, description="GRPO_REWARD_HACKING_SUSPECT needs the late median `reward` above the early "
                               "median by at least this many early-median `reward_std`s.")
    length_growth: float = Field(2.0, gt=1, description="GRPO_REWARD_HACKING_SUSPECT when, with the reward rising, the late median "
                                 "completions/mean_length is at least this many times the early median.")
    diversity_drop: float = Field(0.5, gt=0, lt=1, description="GRPO_REWARD_HACKING_SUSPECT also when, with the reward rising, the "
                                  "late median `entropy` is below this fraction of the early median (the completions grow alike).")


class GrpoHealth(Plugin):
    """GRPO: rewards without spread, entropy collapse, truncated completions, KL blow-up, suspected reward hacking."""

    name = "grpo_health"
    Options = GrpoHealthOptions
    CODES = (GRPO_REWARD_STD_ZERO, GRPO_ENTROPY_COLLAPSE, GRPO_COMPLETIONS_TRUNCATED, GRPO_KL_BLOWUP, GRPO_REWARD_HACKING_SUSPECT)
    options: GrpoHealthOptions

    def __init__(self) -> None:
        self.options = GrpoHealthOptions()
        self._active = False
        self._reset()

    def _reset(self) -> None:
        """Per-run state: streaks and windows are bounded; the medians keep one float per logged point."""
        o = self.options
        self._zero_streak: deque[tuple[int, float]] = deque(maxlen=o.zero_std_logs)
        self._clipped_streak: deque[tuple[int, float]] = deque(maxlen=o.clipped_logs)
        self._kl_window: deque[float] = deque(maxlen=o.kl_window)
        self._series = {key: EarlyLateMedians() for key in (ENTROPY, REWARD, REWARD_STD, LENGTH)}
        self._per_function: dict[str, EarlyLateMedians] = {}  # rewards/<name>/mean, for the hacking evidence
        self._first_step: dict[str, int] = {}

    def setup(self, ctx: Any) -> None:
        """The windows' sizes come from the options just set."""
        self._reset()

    @hookimpl
    def on_run_start(self, trainer: Any) -> None:
        self._active = "GRPOTrainer" in {cls.__name__ for cls in type(trainer).__mro__}
        self.idle_hooks("on_log", idle=not self._active)  # outside GRPO: no call per log
        self._reset()

    def _report_once(self, code: FindingCode, message: str, step: int, evidence: dict[str, Any]) -> None:
        """Once per run: a run that hits a code keeps hitting it at every log."""
        self.report(code.code, message, step=step, evidence=evidence, limit=1)

    @hookimpl
    def on_log(self, ctx: Any, step: int, logs: dict[str, Any]) -> None:
        """TRL has already averaged its metrics over the logging interval into host floats: nothing to sync."""
        if not self._active or not ctx.is_main:
            return
        values = {k: float(v) for k, v in logs.items() if isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)}
        if not any(k in values for k in (ZERO_STD, CLIPPED, ENTROPY, KL, REWARD, LENGTH)):
            return  # not a training log of GRPO (eval keys carry an eval_ prefix; the run summary has none of these)
        for key, series in self._series.items():
            if key in values:
                series.add(values[key])
                self._first_step.setdefault(key, step)
        for key, value in values.items():
            if key.startswith("rewards/") and key.endswith("/mean"):
                self._per_function.setdefault(key, EarlyLateMedians()).add(value)
        self._check_zero_std(step, values)
        self._check_truncated(step, values)
        self._check_entropy(step, values)
        self._check_kl(step, values)
        self._check_hacking(step)

    def _check_zero_std(self, step: int, values: dict[str, float]) -> None:
        """A streak, not one point: single batches without spread are normal when some prompts are easy."""
        o = self.options
        if ZERO_STD not in values or self.reported(GRPO_REWARD_STD_ZERO.code):
            return
        if values[ZERO_STD] < o.zero_std_fraction:
            self._zero_streak.clear()
            return
        self._zero_streak.append((step, values[ZERO_STD]))
        if len(self._zero_streak) < o.zero_std_logs:
            return
        steps, fractions = [s for s, _ in self._zero_streak], [f for _, f in self._zero_streak]
        self._report_once(
            GRPO_REWARD_STD_ZERO,
            f"for {len(steps)} logged points (steps {steps[0]}-{step}) at least {o.zero_std_fraction:.0%} of the prompts had all their "
            f"completions scored alike (frac_reward_zero_std {min(fractions):.2f}-{max(fractions):.2f}, reward {values.get(REWARD, float('nan')):.3g}, "
            f"reward_std {values.get(REWARD_STD, float('nan')):.3g}): GRPO's advantages are zero there and the policy learns nothing. "
            "Check that the reward functions return varied scores (not a constant, not always 0 because of a parsing or format mismatch), "
            "and that the prompts are neither all solved nor all failed; raise num_generations or the sampling temperature for more spread.",
            step, {"steps": steps, "frac_reward_zero_std": fractions, "reward": values.get(REWARD), "reward_std": values.get(REWARD_STD)},
        )

    def _check_truncated(self, step: int, values: dict[str, float]) -> None:
        """A streak, not one point: one batch of long answers is noise, several in a row are a length limit."""
        o = self.options
        if CLIPPED not in values or self.reported(GRPO_COMPLETIONS_TRUNCATED.code):
            return
        if values[CLIPPED] < o.clipped_ratio:
            self._clipped_streak.clear()
            return
        self._clipped_streak.append((step, values[CLIPPED]))
        if len(self._clipped_streak) < o.clipped_logs:
            return
        steps, ratios = [s for s, _ in self._clipped_streak], [r for _, r in self._clipped_streak]
        self._report_once(
            GRPO_COMPLETIONS_TRUNCATED,
            f"for {len(steps)} logged points (steps {steps[0]}-{step}) at least {o.clipped_ratio:.0%} of the completions ended without EOS "
            f"at max_completion_length (completions/clipped_ratio {min(ratios):.2f}-{max(ratios):.2f}, mean length "
            f"{values.get(LENGTH, float('nan')):.1f} tokens): cut-off answers are scored half-written. Raise max_completion_length, "
            "check that the tokenizer's EOS (and the chat template's end-of-turn token) is what generation stops on, or set "
            "mask_truncated_completions=True so cut-off completions do not count in the loss.",
            step, {"steps": steps, "clipped_ratio": ratios, "mean_length": values.get(LENGTH),
                   "mean_terminated_length": values.get("completions/mean_terminated_length")},
        )

    def _check_entropy(self, step: int, values: dict[str, float]) -> None:
        """An absolute floor catches a collapse from the start (low temperature); the early/late ratio one during training."""
        o = self.options
        if ENTROPY not in values or self.reported(GRPO_ENTROPY_COLLAPSE.code):
            return
        series = self._series[ENTROPY]
        trend = len(series) >= o.min_logs
        early, late = (series.early(), series.late()) if trend else (None, None)
        if values[ENTROPY] < o.entropy_floor:
            why = f"the logged entropy {values[ENTROPY]:.3g} is below the floor {o.entropy_floor:.3g}"
        elif early is not None and late is not None and early > 0 and late < o.entropy_drop * early:
            why = (f"the median entropy fell from {early:.3g} (first third of {len(series)} logged points) to {late:.3g} (last third), "
                   f"below {o.entropy_drop:.0%} of where it started")
        else:
            return
        self._report_once(
            GRPO_ENTROPY_COLLAPSE,
            f"at step {step} {why} (nats per completion token): the policy samples nearly the same tokens every time, so the groups "
            "stop exploring and the advantages vanish. Lower the learning rate, raise the sampling temperature, use "
            "epsilon_high > epsilon (clip-higher, as in DAPO), or add an entropy bonus (entropy_coef); check that a reward is not "
            "paying for one fixed answer.",
            step, {"entropy": values[ENTROPY], "early_entropy": early, "late_entropy": late, "logged_points": len(series),
                   "first_step": self._first_step.get(ENTROPY), "floor": o.entropy_floor},
        )

    def _check_kl(self, step: int, values: dict[str, float]) -> None:
        """Against the points just before, not the first ones: KL starts at 0, so any growth from the start is infinite."""
        o = self.options
        if KL not in values:
            return
        kl = values[KL]
        before = list(self._kl_window)  # the points before this one, in order
        self._kl_window.append(kl)
        if self.reported(GRPO_KL_BLOWUP.code):
            return
        median = statistics.median(before) if before else None
        if kl > o.kl_max:
            why = f"kl {kl:.3g} is above {o.kl_max:.3g}"
        elif median is not None and len(before) == o.kl_window and kl >= o.kl_growth_floor and kl >= o.kl_growth * median:
            times = f"{kl / median:.1f}x" if median > 0 else "far above"
            why = f"kl {kl:.3g} is {times} the median {median:.3g} of the {len(before)} logged points before it"
        else:
            return
        self._report_once(
            GRPO_KL_BLOWUP,
            f"at step {step} {why}: the policy is moving away from the reference model fast, which usually precedes degenerate "
            "completions. Lower the learning rate, raise beta, check that the reference model is the starting checkpoint (same "
            "weights and precision), and look at recent completions for repetition or gibberish.",
            step, {"kl": kl, "previous_median": median, "previous": before, "kl_max": o.kl_max, "kl_growth": o.kl_growth},
        )

    def _check_hacking(self, step: int) -> None:
        """Neither a rising reward nor longer completions alone is a problem; together they are worth a look."""
        o = self.options
        reward, spread, length, entropy = (self._series[k] for k in (REWARD, REWARD_STD, LENGTH, ENTROPY))
        if self.reported(GRPO_REWARD_HACKING_SUSPECT.code) or len(reward) < o.min_logs:
            return
        early, late = reward.early(), reward.late()
        scale = spread.early() if len(spread) else 0.0
        if late <= early or late - early < o.reward_rise * scale:
            return
        evidence: dict[str, Any] = {"early_reward": early, "late_reward": late, "early_reward_std": scale,
                                    "first_step": self._first_step.get(REWARD), "logged_points": len(reward)}
        reasons = []
        if len(length) >= o.min_logs and length.early() > 0 and length.late() >= o.length_growth * length.early():
            reasons.append(f"completions/mean_length grew from {length.early():.1f} to {length.late():.1f} tokens "
                           f"({length.late() / length.early():.1f}x)")
            evidence.update(early_mean_length=length.early(), late_mean_length=length.late())
        if len(entropy) >= o.min_logs and entropy.early() > 0 and entropy.late() < o.diversity_drop * entropy.early():
            reasons.append(f"the entropy fell from {entropy.early():.3g} to {entropy.late():.3g}")
            evidence.update(early_entropy=entropy.early(), late_entropy=entropy.late())
        if not reasons:
            return
        functions = {k: [s.early(), s.late()] for k, s in self._per_function.items() if len(s) >= o.min_logs}
        evidence["rewards_per_function_early_late"] = functions
        rising = max(functions, key=lambda k: functions[k][1] - functions[k][0]) if functions else None
        self._report_once(
            GRPO_REWARD_HACKING_SUSPECT,
            f"the median reward rose from {early:.3g} to {late:.3g} (first vs last third of {len(reward)} logged points, steps "
            f"{self._first_step.get(REWARD)}-{step}) while " + " and ".join(reasons)
            + (f"; {rising} rose the most" if rising else "")
            + ": the policy may have found a shortcut the reward pays for (length, repetition, a format token) rather than better "
            "answers. Read completions from the start and from now side by side; if they are longer or more alike without being "
            "better, fix the reward (cap or penalise length, make sure the format check cannot be gamed by repetition) and keep a "
            "loss_type that is not length-biased ('dapo' or 'dr_grpo', not 'grpo').",
            step, evidence,
        )


__all__ = ["GrpoHealth", "GrpoHealthOptions"]
