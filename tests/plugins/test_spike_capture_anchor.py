"""spike_capture's absolute anchor, eval trend and earlier-finding causes, step by step without a Trainer (milliseconds).

The curves are the ones outside users met: a GPT-2 from scratch at learning
rate 1.0 (4.58, 4.57, 4.19, then 13.4 at step 4), a fine-tune that starts at
1.04 and jumps to 8.41 at step 2. Before the anchor both were "healthy": the
baseline formed on the ruined level, or never filled and was silently rebuilt.
"""
from __future__ import annotations

import math
import random
from types import SimpleNamespace
from typing import Any

import pytest

from harness.core.findings import Severity
from harness.lib.untrained_loss import of_labels, of_token_loss
from harness.plugins.spike_capture import SpikeCapture, SpikeCaptureOptions
from harness.plugins.spike_capture.anchor import LossAnchor
from harness.plugins.spike_capture.causes import EarlierFindings
from harness.plugins.spike_capture.evals import EvalTrend

from test_spike_capture_baseline import Findings, warmup_curve

GPT2_FROM_SCRATCH = [4.58, 4.57, 4.19, 13.4, 40.1, 62.5, 55.0, 60.2, 58.3, 61.0, 63.3, 63.8] + [40.0 - i for i in range(18)]
FINE_TUNE = [1.04, 8.41, 6.9, 5.2, 4.29] + [4.29 - 0.045 * i for i in range(55)]  # ends at 1.8: never back at 1.04


class Main(Findings):
    is_main = True
    step = 0


def _plugin(untrained: Any = None, **options: Any) -> tuple[SpikeCapture, Main]:
    plugin, ctx = SpikeCapture(), Main()
    plugin.configure(ctx, SpikeCaptureOptions(**options))
    if untrained is not None:
        plugin._set_untrained(untrained)
    return plugin, ctx


def _feed(plugin: SpikeCapture, ctx: Main, losses: list[float], start: int = 1) -> None:
    for step, loss in enumerate(losses, start):
        ctx.step = step
        plugin.on_before_optimizer_step(ctx, step, 1.0, loss, [loss])
        plugin.on_step_end(ctx, step, {"grad_norm": 1.0})


def test_a_gpt2_from_scratch_that_explodes_at_step_4_is_above_its_start_within_two_steps_and_diverging() -> None:
    plugin, ctx = _plugin(of_token_loss(104))  # ln 104 = 4.64
    _feed(plugin, ctx, GPT2_FROM_SCRATCH)
    plugin.on_run_end(ctx, "completed")
    (above,) = [f for f in ctx.made if f["code"] == "LOSS_ABOVE_START"]
    assert above["step"] in (4, 5, 6) and above["step"] <= 4 + 2
    assert "ln(vocab=104)=4.644" in above["message"] and above["evidence"]["untrained_level"] == pytest.approx(math.log(104))
    (diverged,) = [f for f in ctx.made if f["code"] == "LOSS_DIVERGENCE"]  # no silent "rebuilding from the new level"
    assert diverged["evidence"]["over_ceiling"] is True and diverged["evidence"]["since_step"] == 4
    (ended,) = [f for f in ctx.made if f["code"] == "LOSS_NOT_RECOVERED"]
    assert ended["evidence"]["start"] == pytest.approx(4.57) and ended["evidence"]["breached"] is True
    assert 13.4 not in plugin.loss_base.values  # the baseline never formed on the ruined level


def test_a_fine_tune_that_jumps_over_ln_vocab_at_step_2_is_found_by_step_4_and_said_not_recovered_at_its_end() -> None:
    plugin, ctx = _plugin(of_token_loss(300))  # ln 300 = 5.70
    _feed(plugin, ctx, FINE_TUNE)
    plugin.on_run_end(ctx, "completed")
    (above,) = [f for f in ctx.made if f["code"] == "LOSS_ABOVE_START"]
    assert above["step"] <= 4 and above["evidence"]["start"] == pytest.approx(1.04)  # the start is the healthy step 1
    (ended,) = [f for f in ctx.made if f["code"] == "LOSS_NOT_RECOVERED"]
    assert "1.04" in ended["message"] and ended["evidence"]["level"] > 1.5


def test_without_an_untrained_level_several_times_the_first_losses_is_the_ceiling() -> None:
    """A contrastive or regression loss: 3x its start (the median of its first three losses)."""
    plugin, ctx = _plugin()
    _feed(plugin, ctx, [2.4, 2.3, 2.2, 2.0, 7.5, 8.0, 8.1])
    (above,) = [f for f in ctx.made if f["code"] == "LOSS_ABOVE_START"]
    assert above["step"] == 6 and above["evidence"]["first_step_above"] == 5  # two steps over the line (7.5 is not 1.5x it)
    assert above["evidence"]["untrained_level"] is None and above["evidence"]["start"] == pytest.approx(2.3)


@pytest.mark.parametrize("noise", [0.0, 0.01, 0.03, 0.08])
def test_clean_warm_ups_never_reach_the_ceiling(noise: float) -> None:
    for seed in range(5):
        plugin, ctx = _plugin(of_token_loss(512))
        _feed(plugin, ctx, warmup_curve(200, seed=seed, noise=noise))
        plugin.on_run_end(ctx, "completed")
        assert [f["code"] for f in ctx.made if f["code"] in ("LOSS_ABOVE_START", "LOSS_NOT_RECOVERED", "LOSS_DIVERGENCE")] == []


def test_a_noisy_clean_classifier_around_ln_3_stays_under_its_ceiling() -> None:
    """Small batches of a 3-class classifier: the step loss wanders around ln 3 = 1.10 at first, then falls."""
    for seed in range(20):
        rng = random.Random(seed)
        curve = [max(0.05, (0.3 + 0.8 * math.exp(-s / 30)) * (1 + rng.gauss(0, 0.05))) for s in range(120)]
        plugin, ctx = _plugin(of_labels(3))
        _feed(plugin, ctx, curve)
        plugin.on_run_end(ctx, "completed")
        assert [f["code"] for f in ctx.made] == [], seed


def test_one_noisy_step_over_the_line_waits_for_the_next_and_a_far_one_does_not() -> None:
    anchor = LossAnchor(untrained=5.0, basis="ln(vocab=148)")
    assert anchor.observe(1, 5.0) is None and anchor.ceiling() == pytest.approx(5.5)
    assert anchor.observe(2, 5.6) is None and anchor.above_run == 1  # one step over: wait
    assert anchor.observe(3, 4.9) is None and anchor.above_run == 0  # back under: nothing
    assert anchor.observe(4, 5.6) is None
    breach = anchor.observe(5, 5.7)
    assert breach is not None and breach.first_above == 4 and breach.steps_above == 2
    fresh = LossAnchor(untrained=5.0)
    fresh.observe(1, 5.0)
    assert fresh.observe(2, 9.0) is not None  # 1.5x the ceiling: at once


def test_the_anchor_survives_a_checkpoint() -> None:
    plugin, ctx = _plugin(of_token_loss(300))
    _feed(plugin, ctx, FINE_TUNE[:3])
    state = plugin.checkpoint_state(ctx, 3)
    resumed, ctx2 = _plugin(of_token_loss(300))
    ctx2.step = 3
    resumed.on_resume(ctx2, state)
    _feed(resumed, ctx2, FINE_TUNE[3:], start=4)
    resumed.on_run_end(ctx2, "completed")
    (ended,) = [f for f in ctx2.made if f["code"] == "LOSS_NOT_RECOVERED"]
    assert ended["evidence"]["start"] == pytest.approx(1.04)  # the start of the run, not of the resumed process


def test_a_preference_loss_has_no_anchor() -> None:
    plugin, ctx = _plugin(of_token_loss(300))
    plugin._judge_loss = False  # what on_run_start sets for DPO, GRPO, KTO, reward trainers
    _feed(plugin, ctx, [0.69, 3.0, 4.0, 5.0, 6.0])
    plugin.on_run_end(ctx, "completed")
    assert [f["code"] for f in ctx.made] == []


# -- evaluations ------------------------------------------------------------------------------------


def test_an_eval_loss_that_climbs_while_the_training_loss_falls_is_overfitting() -> None:
    plugin, ctx = _plugin(of_token_loss(300))
    train = [3.0 - 0.02 * s for s in range(100)]
    evals = {20: 2.9, 40: 2.7, 60: 2.75, 80: 2.95, 100: 3.2}
    for step, loss in enumerate(train, 1):
        ctx.step = step
        plugin.on_before_optimizer_step(ctx, step, 1.0, loss, [loss])
        if step in evals:
            plugin.on_evaluate(ctx, step, {"eval_loss": evals[step], "eval_runtime": 0.1, "epoch": 1.0})
    (rising,) = [f for f in ctx.made if f["code"] == "EVAL_LOSS_RISING"]
    assert rising["step"] == 80 and rising["evidence"]["best_step"] == 40  # rose at 60 and 80, 9% over its best
    assert "training loss fell" in rising["message"] and "overfitting" in rising["message"]
    assert rising["severity"] == Severity.INFO and rising["evidence"]["overfitting"]  # what many epochs do: information


def test_an_eval_loss_that_climbs_with_an_exploding_training_loss_says_so() -> None:
    plugin, ctx = _plugin(of_token_loss(104))
    for step, loss in enumerate(GPT2_FROM_SCRATCH, 1):
        ctx.step = step
        plugin.on_before_optimizer_step(ctx, step, 1.0, loss, [loss])
        if step % 3 == 0:
            plugin.on_evaluate(ctx, step, {"eval_loss": [4.5, 9.0, 30.0, 50.0][min(step // 3 - 1, 3)]})
    (rising,) = [f for f in ctx.made if f["code"] == "EVAL_LOSS_RISING"]
    assert rising["step"] == 9 and "training loss exploded" in rising["message"] and rising.get("severity") is None  # a warning


def test_eval_noise_and_a_single_rise_are_silent() -> None:
    trend = EvalTrend(rises=2, min_rise=0.05)
    values = [3.0, 2.5, 2.2, 2.25, 2.1, 2.12, 2.13, 2.0]  # rose twice in a row (2.1 -> 2.12 -> 2.13) but within 5% of its best
    assert [r for i, v in enumerate(values) for r in trend.observe(i * 10, {"eval_loss": v}, None)] == []


# -- the run's own earlier findings come first ----------------------------------------------------------


def test_a_spike_after_the_harness_reported_the_learning_rate_names_it_before_the_resume() -> None:
    """The demo's step-47 spike once said 'suspect the checkpoint restore first', though LR_SCHEDULE_MISMATCH came at 46."""
    plugin, ctx = _plugin(of_token_loss(512))
    rng = random.Random(0)
    ctx.step = 30
    plugin.on_resume(ctx, None)
    curve = [2.0 * (1 + rng.gauss(0, 0.01)) for _ in range(16)]
    _feed(plugin, ctx, curve, start=31)
    plugin.on_finding(SimpleNamespace(code="LR_SCHEDULE_MISMATCH", step=46, rank=0, message="the update of step 46 used 300x the LR"))
    _feed(plugin, ctx, [4.0], start=47)
    (spike,) = [f for f in ctx.made if f["code"] == "LOSS_SPIKE"]
    assert "the run found LR_SCHEDULE_MISMATCH at step 46, 1 step(s) before" in spike["message"]
    assert spike["message"].index("LR_SCHEDULE_MISMATCH") < spike["message"].index("after a resume")
    assert "suspect the checkpoint restore first" not in spike["message"]
    assert spike["evidence"]["earlier_findings"][0]["code"] == "LR_SCHEDULE_MISMATCH"


def test_earlier_findings_are_bounded_and_only_causes() -> None:
    seen = EarlierFindings()
    for step in range(100):
        seen.note(SimpleNamespace(code="DATA_REPEATED", step=step, rank=0, message="x"))
        seen.note(SimpleNamespace(code="DUPLICATE_SAMPLES", step=step, rank=0, message="not a cause"))
    assert [c.code for c in seen.before(99)] == ["DATA_REPEATED"] and seen.before(99)[0].step == 99
    assert seen.before(10) == []  # only the last 32 are kept


def test_a_batch_s_own_finding_explains_its_own_step_only_and_a_skipped_step_nothing() -> None:
    """The demo's spike of step 31 (a corrupted batch) once named the padding collator of step 20 and the masked batch of 17."""
    seen = EarlierFindings()
    for code, step in (("ALL_LABELS_MASKED", 17), ("PACKING_LOSS_ON_PADDING", 20), ("NONFINITE_GRAD", 11), ("LR_SCHEDULE_MISMATCH", 25)):
        seen.note(SimpleNamespace(code=code, step=step, rank=0, message=""))
    assert [c.code for c in seen.before(20)] == ["PACKING_LOSS_ON_PADDING"]
    assert [c.code for c in seen.before(31)] == ["LR_SCHEDULE_MISMATCH"]


# -- losses over few terms: a classifier's batch of four -------------------------------------------------


def _classifier_curve(seed: int, steps: int = 60, batch: int = 4, labels: int = 2) -> list[float]:
    """A healthy classifier's step losses: each the mean of ``batch`` per-row cross-entropies of a model learning slowly
    from chance, so that one batch of four often scores far above ln(labels)."""
    rng = random.Random(seed)
    curve = []
    for s in range(steps):
        p_true = min(0.95, 1 / labels + 0.4 * s / steps)  # the mean probability of the right label
        rows = [-math.log(min(0.999, max(0.02, rng.betavariate(8 * p_true, 8 * (1 - p_true))))) for _ in range(batch)]
        curve.append(sum(rows) / batch)
    return curve


def _batches(rows: int) -> list[tuple[int, dict[str, Any]]]:
    import torch

    return [(0, {"input_ids": torch.zeros(rows, 16, dtype=torch.long), "labels": torch.zeros(rows, dtype=torch.long)})]


def _feed_rows(plugin: SpikeCapture, ctx: Main, losses: list[float], rows: int) -> None:
    ctx.step_batches = _batches(rows)
    for step, loss in enumerate(losses, 1):
        ctx.step = step
        plugin.on_before_optimizer_step(ctx, step, 1.0, loss, [loss])
        plugin.on_step_end(ctx, step, {"grad_norm": 1.0})


@pytest.mark.parametrize("labels", [2, 3])
def test_a_healthy_classifier_with_batches_of_four_is_silent(labels: int) -> None:
    """Single batches of four reach 1.5-1.8x ln(labels) on healthy runs (seen on BERT, GPT-2, Llama and Qwen3 heads): neither
    the anchor nor a one-step spike may fire on them."""
    for seed in range(30):
        curve = _classifier_curve(seed, labels=labels)
        assert max(curve[1:]) > 1.2 * math.log(labels) or seed  # the noise the test is about (seed 0 shows it)
        plugin, ctx = _plugin(of_labels(labels))
        _feed_rows(plugin, ctx, curve, rows=4)
        plugin.on_run_end(ctx, "completed")
        assert [f["code"] for f in ctx.made if f.get("severity") != Severity.INFO] == [], (seed, ctx.made[:1])
        assert plugin.anchor.window == 16  # 64 terms: sixteen steps of four rows


def test_a_classifier_that_blows_up_at_step_2_is_found_within_two_steps_despite_its_noise() -> None:
    plugin, ctx = _plugin(of_labels(2))
    _feed_rows(plugin, ctx, [0.70, 6.5, 7.9, 5.2, 8.8, 6.1] + [6.0] * 20, rows=4)
    (above,) = [f for f in ctx.made if f["code"] == "LOSS_ABOVE_START"]
    assert above["step"] <= 4 and above["evidence"]["averaged_steps"] == above["step"]  # the mean so far, every step in
    assert f"mean loss of the {above['step']} steps to step {above['step']} on rank 0" in above["message"]


def test_a_resumed_classifier_keeps_judging_its_steps_as_few_rows() -> None:
    """The terms come back with the checkpoint's state: a resumed 4-row classifier must not judge single steps again."""
    plugin, ctx = _plugin(of_labels(2))
    _feed_rows(plugin, ctx, _classifier_curve(1, steps=12), rows=4)
    state = plugin.checkpoint_state(ctx, 12)
    resumed, ctx2 = _plugin(of_labels(2))
    ctx2.step = 12
    resumed.on_resume(ctx2, state)
    assert resumed._few_terms() and resumed._row_loss() and resumed.anchor.window == 16
    curve = _classifier_curve(1, steps=60)[12:]
    curve[20] = 2.5  # one batch of four far above its level: noise for four rows, a spike for a token loss
    ctx2.step_batches = _batches(4)
    for step, loss in enumerate(curve, 13):
        resumed.on_before_optimizer_step(ctx2, step, 1.0, loss, [loss])
        resumed.on_step_end(ctx2, step, {"grad_norm": 1.0})
    assert [f["code"] for f in ctx2.made if f.get("severity") != Severity.INFO] == []


def test_one_step_losses_of_many_tokens_keep_their_single_step_judgement() -> None:
    plugin, ctx = _plugin(of_token_loss(512))
    ctx.step_batches = [(0, {"input_ids": __import__("torch").zeros(4, 64, dtype=__import__("torch").long),
                             "labels": __import__("torch").zeros(4, 64, dtype=__import__("torch").long)})]
    _feed(plugin, ctx, [6.2, 6.1, 6.0])
    assert plugin.anchor.terms == 256 and plugin.anchor.window == 1 and not plugin._few_terms()


def test_an_eval_loss_of_forty_examples_near_chance_is_no_trend() -> None:
    """Forty eval rows of a classifier at chance: +14% over the best is within two standard errors (2/sqrt(40) = 32%)."""
    trend = EvalTrend(rises=2, min_rise=0.05)
    found = [r for step, v in ((10, 0.683), (20, 0.709), (30, 0.779), (40, 0.762))
             for r in trend.observe(step, {"eval_loss": v}, None, {"eval_loss": 40})]
    assert found == []
    big = EvalTrend(rises=2, min_rise=0.05)
    found = [r for step, v in ((10, 0.683), (20, 0.709), (30, 0.779)) for r in big.observe(step, {"eval_loss": v}, None, {"eval_loss": 5000})]
    assert [r.step for r in found] == [30]


def test_words_never_call_a_rise_of_many_sds_noise() -> None:
    """TRL's reward trainer once read "11.2 robust SDs ... within its usual step-to-step noise" (its loss is not judged)."""
    from harness.lib.robust import Judgement
    from harness.plugins.spike_capture.notes import loss_context

    words, moved, _ = loss_context(Judgement(1.5, 1.0, 0.045, 11.2, 30), spiked=False, elevated=False, min_rise=0.1, fall_z=3.0)
    assert moved and "noise" not in words and "not an outlier by the rules" in words
    words, _, _ = loss_context(Judgement(1.15, 1.0, 0.1, 1.5, 30), spiked=False, elevated=False, min_rise=0.1, fall_z=3.0)
    assert "within its usual step-to-step noise" in words


def test_a_grad_norm_after_steps_without_gradient_is_not_called_infinitely_many_sds() -> None:
    plugin, ctx = _plugin(of_token_loss(512), grad_warmup_steps=0, min_history=3)
    for step in range(1, 12):
        plugin.on_before_optimizer_step(ctx, step, 0.0, 2.0, [2.0])
    plugin.on_before_optimizer_step(ctx, 12, 5.0, 2.0, [2.0])
    (grad,) = [f for f in ctx.made if f["code"] == "GRAD_NORM_SPIKE"]
    assert "above a running median of 0" in grad["message"] and "inf" not in grad["message"]
