"""spike_capture's judgement, step by step without a Trainer (milliseconds): robust from the first steps, honest messages.

The plugin is fed host floats as the step guard hands them over
(``on_before_optimizer_step``'s loss and grad norm); findings are collected by
a stand-in for the run context's ``report``.
"""
from __future__ import annotations

import math
import random
from typing import Any

from harness.lib.robust import judge
from harness.plugins.spike_capture import SpikeCapture, SpikeCaptureOptions


class Findings:
    """Just what the plugin uses of a run context for a judgement: its rank, ``report`` and ``deferred`` (no batches here)."""

    rank = 0

    def __init__(self) -> None:
        self.made: list[dict[str, Any]] = []
        self.step_batches: list[tuple[int, dict[str, Any]]] = []  # the loop's micro-batches of the step: none here

    def report(self, code: str, message: str, **kw: Any) -> None:
        self.made.append({"code": code, "message": message, **kw})

    def deferred(self, key: str, owner: str) -> list[Any]:
        return []

    def codes(self) -> list[tuple[str, int]]:
        return [(f["code"], f["step"]) for f in self.made]


def _plugin(**options: Any) -> tuple[SpikeCapture, Findings]:
    plugin, ctx = SpikeCapture(), Findings()
    plugin.configure(ctx, SpikeCaptureOptions(**options))
    return plugin, ctx


def warmup_curve(steps: int, seed: int = 0, noise: float = 0.01, tau: float = 12) -> list[float]:
    """A loss falling steeply from ln(512) towards 1.5, with multiplicative step noise: a warm-up as real runs have it."""
    rng = random.Random(seed)
    return [(1.5 + (math.log(512) - 1.5) * math.exp(-s / tau)) * (1 + rng.gauss(0, noise)) for s in range(steps)]


def _feed(plugin: SpikeCapture, ctx: Findings, losses: list[float], norms: list[float] | None = None) -> None:
    for step, loss in enumerate(losses, 1):
        norm = norms[step - 1] if norms else 1.0
        plugin.on_before_optimizer_step(ctx, step, norm, loss, [loss])
        plugin.on_step_end(ctx, step, {"grad_norm": norm})


def test_a_steep_clean_warm_up_is_silent() -> None:
    """From a fall that halves the loss in three steps to a slow one, smooth or noisy: no finding, and no level locked out."""
    rng = random.Random(7)
    for tau in (3, 5, 8, 12, 40):
        for noise in (0.0, 0.002, 0.01, 0.03, 0.08):
            for seed in range(2):
                plugin, ctx = _plugin()
                _feed(plugin, ctx, warmup_curve(200, seed, noise, tau), [2.0 * (1 + rng.gauss(0, 0.05)) for _ in range(200)])
                assert ctx.made == [], (tau, noise, seed, ctx.codes())


def test_a_spike_in_the_warm_up_is_never_admitted_and_the_first_spike_after_the_window_is_flagged() -> None:
    losses = warmup_curve(40)
    losses[4] *= 1.8  # step 5: the window is not full, so no finding, but the value must not enter it
    losses[13] *= 1.6  # step 14: the first poisoned step after the window (min_history 10) filled
    plugin, ctx = _plugin()
    _feed(plugin, ctx, losses[:13])
    assert ctx.made == [] and losses[4] not in plugin.loss_base.values and len(plugin.loss_base) == 12
    _feed_from(plugin, ctx, losses, 14)
    assert ctx.codes() == [("LOSS_SPIKE", 14)]
    spike = ctx.made[0]
    assert spike["evidence"]["loss"] == losses[13] and spike["evidence"]["window"] == 12
    assert spike["evidence"]["median"] <= losses[12]  # the level follows the fall: not above the last admitted loss


def test_the_level_follows_the_fall_so_a_spike_in_the_warm_up_is_not_swallowed() -> None:
    """The plain median of the last 10 steps lags above a steep fall: +25% on the curve sits below it."""
    losses = warmup_curve(30, noise=0.005)
    losses[15] *= 1.25
    plugin, ctx = _plugin()
    _feed(plugin, ctx, losses)
    assert ctx.codes() == [("LOSS_SPIKE", 16)]
    lagging = judge(losses[15], losses[:15], 3, 10)  # what the level was before it followed the fall
    assert lagging is not None and lagging.rise < 0


def _feed_from(plugin: SpikeCapture, ctx: Findings, losses: list[float], first: int) -> None:
    for step in range(first, len(losses) + 1):
        plugin.on_before_optimizer_step(ctx, step, 1.0, losses[step - 1], [losses[step - 1]])


def test_a_grad_spike_never_says_the_loss_was_unmoved_when_it_moved() -> None:
    rng = random.Random(1)
    losses = [3.0 * (1 + rng.gauss(0, 0.3)) for _ in range(30)]  # a very noisy loss
    norms = [1.0 + 0.02 * rng.random() for _ in range(30)]
    losses[24], norms[24] = 6.0 * 1.7, 5.0  # step 25: the loss 3.4x its median, the grad norm 5x
    plugin, ctx = _plugin(loss_z=20.0)  # so that the loss is elevated but not a spike
    _feed(plugin, ctx, losses, norms)
    assert ctx.codes() == [("GRAD_NORM_SPIKE", 25)]
    grad = ctx.made[0]
    assert "unmoved" not in grad["message"] and "usual range" not in grad["message"]
    assert "the loss rose with it (+" in grad["message"]
    assert grad["severity"].value == "warning" and grad["evidence"]["loss_moved"] and grad["evidence"]["loss_rise"] > 2


def test_a_grad_spike_with_a_flat_loss_says_so_and_is_information() -> None:
    rng = random.Random(2)
    losses = [3.0 + 0.01 * rng.random() for _ in range(30)]
    norms = [1.0 + 0.02 * rng.random() for _ in range(30)]
    norms[24] = 5.0
    plugin, ctx = _plugin()
    _feed(plugin, ctx, losses, norms)
    assert ctx.codes() == [("GRAD_NORM_SPIKE", 25)]
    grad = ctx.made[0]
    assert "with the loss within its usual range" in grad["message"] and grad["severity"].value == "info"
    assert not grad["evidence"]["loss_moved"]


def test_a_level_shift_before_the_window_filled_rebuilds_the_baseline_without_a_finding() -> None:
    losses = [4.0, 3.9, 3.8] + [6.0 + 0.01 * (i % 3) for i in range(60)]  # the loss jumps up at step 4 and stays there
    losses[49] *= 1.5
    plugin, ctx = _plugin()
    _feed(plugin, ctx, losses)
    assert ctx.codes() == [("LOSS_SPIKE", 50)]  # no divergence from a baseline of three steps; later spikes still found


def test_a_grad_norm_that_moves_to_a_new_level_becomes_the_baseline_and_later_spikes_are_found() -> None:
    """Outliers never enter the window, so a lasting shift must rebuild it, or every later grad spike goes unseen."""
    rng = random.Random(3)
    plugin, ctx = _plugin(grad_warmup_steps=0)
    losses = [2.0 * (1 + rng.gauss(0, 0.005)) for _ in range(120)]
    norms = [0.5 * (1 + rng.gauss(0, 0.02)) for _ in range(30)] + [1.5 * (1 + rng.gauss(0, 0.02)) for _ in range(89)] + [30.0]
    _feed(plugin, ctx, losses, norms)
    grad_spikes = [step for code, step in ctx.codes() if code == "GRAD_NORM_SPIKE"]
    assert grad_spikes[0] == 31 and grad_spikes[-1] == 120, ctx.codes()  # the shift once, then the real spike on the new level
    assert len(plugin.grad_base) > 10 and abs(plugin.grad_base.median() - 1.5) < 0.1


def test_a_grad_spike_names_the_rows_of_its_step_whether_the_norm_came_at_the_guard_or_at_step_end() -> None:
    """DeepSpeed computes the grad norm inside its own step: the guard sees none and the judgement waits for step end,
    with the step's micro-batches kept for it. Either way the finding names the spiking step's rows, not another step's."""
    from harness.lib.sample_rows import DATASET_INDEX_KEY

    for norm_at_guard in (True, False):
        rng = random.Random(3)
        losses = [3.0 + 0.01 * rng.random() for _ in range(30)]
        norms = [1.0 + 0.02 * rng.random() for _ in range(30)]
        norms[24] = 5.0
        plugin, ctx = _plugin(max_captures=0)
        for step, (loss, norm) in enumerate(zip(losses, norms), 1):
            ctx.step_batches = [(0, {DATASET_INDEX_KEY: [2 * step, 2 * step + 1]})]
            plugin.on_before_optimizer_step(ctx, step, norm if norm_at_guard else None, loss, [loss])
            ctx.step_batches = [(0, {DATASET_INDEX_KEY: [-1, -1]})]  # the loop moved on: a later look must not see these
            plugin.on_step_end(ctx, step, {"grad_norm": norm})
        assert ctx.codes() == [("GRAD_NORM_SPIKE", 25)], norm_at_guard
        assert ctx.made[0]["evidence"]["dataset_indices"] == [[50, 51]], norm_at_guard
