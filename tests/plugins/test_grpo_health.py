"""grpo_health: each code from synthetic GRPO logs (what TRL 1.16 logs, fed through a real run context), then real GRPOTrainer runs.

The unit tests drive the plugin's ``on_log`` through the plugin manager with
log dicts shaped like GRPOTrainer's; the real runs train a tiny Llama with
toy reward functions on CPU: a constant reward with completions cut at 4
tokens, a reward that pays for length, a narrow reward at a learning rate far
too high (KL and entropy), and a random reward that is clean.
"""
from __future__ import annotations

import json
import math
import random
import statistics
from pathlib import Path
from typing import Any

import pytest

import harness
from conftest import findings_of, read_jsonl
from harness.core.config import Catalog, load_config
from harness.core.context import RunContext
from harness.core.distributed import DistInfo
from harness.core.manager import HarnessPluginManager

CODES = ("GRPO_REWARD_STD_ZERO", "GRPO_ENTROPY_COLLAPSE", "GRPO_COMPLETIONS_TRUNCATED", "GRPO_KL_BLOWUP", "GRPO_REWARD_HACKING_SUSPECT")


class GRPOTrainer:
    """Stands in for trl's GRPOTrainer: grpo_health tells the trainer by its class name."""


class Trainer:
    """Any other trainer."""


def _grpo_health(run_dir: Path, options: dict[str, Any] | None = None, trainer: Any = None) -> tuple[RunContext, Any]:
    catalog = Catalog.build(autoload=False)
    resolved = load_config({"plugins": ["grpo_health"], "grpo_health": options or {}}, catalog)
    manager = HarnessPluginManager(resolved.model.max_plugin_errors)
    for name in resolved.enabled:
        manager.register(catalog.entries[name])
    ctx = RunContext(resolved, catalog.codes, manager, run_dir, DistInfo(rank=0, world_size=1, local_rank=0))
    for name in manager.names:
        manager.hooks.configure(name, ctx, resolved.options_for(name))
    plugin = manager.plugin("grpo_health")
    plugin.on_run_start(GRPOTrainer() if trainer is None else trainer)
    return ctx, plugin


def _healthy(i: int) -> dict[str, Any]:
    """One logged point of a run that learns: reward rising, lengths and entropy steady, KL creeping up, few groups without spread."""
    wobble = ((i * 7919) % 13 - 6) / 6  # deterministic noise in [-1, 1]
    return {
        "loss": 0.0, "learning_rate": 1e-6, "num_tokens": 1000.0 * i,
        "completions/mean_length": 200 + 30 * wobble, "completions/clipped_ratio": 0.05 + 0.03 * wobble,
        "completions/mean_terminated_length": 190 + 20 * wobble,
        "rewards/correct/mean": 0.3 + 0.004 * i + 0.05 * wobble, "rewards/correct/std": 0.4,
        "rewards/format/mean": None,  # TRL logs None when a reward function scored nothing in the interval
        "reward": 0.3 + 0.004 * i + 0.05 * wobble, "reward_std": 0.4, "frac_reward_zero_std": 0.3 + 0.2 * wobble,
        "entropy": 0.5 - 0.001 * i + 0.05 * wobble, "kl": 0.0005 * i, "epoch": i / 100,
    }


def _feed(ctx: RunContext, points: list[dict[str, Any]], first_step: int = 1) -> None:
    for step, logs in enumerate(points, start=first_step):
        ctx.manager.hooks.on_log(ctx, step, logs)


def _only(ctx: RunContext, code: str) -> Any:
    assert [f.code for f in ctx.findings] == [code]
    return ctx.findings[0]


def test_a_healthy_run_whose_reward_rises_is_silent_and_so_is_another_trainer(tmp_path: Path) -> None:
    ctx, _ = _grpo_health(tmp_path / "grpo")
    _feed(ctx, [_healthy(i) for i in range(1, 101)])
    _feed(ctx, [{"train_runtime": 10.0, "train_loss": 0.0}, {"eval_reward": 0.0, "eval_frac_reward_zero_std": 1.0}], first_step=100)
    assert ctx.findings == []
    other, _ = _grpo_health(tmp_path / "other", trainer=Trainer())
    _feed(other, [{**_healthy(i), "frac_reward_zero_std": 1.0, "completions/clipped_ratio": 1.0, "kl": 5.0} for i in range(1, 11)])
    assert other.findings == []


def test_groups_without_reward_spread_for_five_points_in_a_row(tmp_path: Path) -> None:
    ctx, _ = _grpo_health(tmp_path)
    points = [_healthy(i) for i in range(1, 11)]
    points += [{**_healthy(i), "frac_reward_zero_std": 1.0, "reward_std": 0.0} for i in range(11, 15)]  # 4 in a row: not yet
    points += [{**_healthy(15), "frac_reward_zero_std": 0.5}]
    points += [{**_healthy(i), "frac_reward_zero_std": 0.95, "reward_std": 0.01} for i in range(16, 30)]
    _feed(ctx, points)
    finding = _only(ctx, "GRPO_REWARD_STD_ZERO")
    assert finding.step == 20 and finding.severity.value == "warning"
    assert finding.evidence["steps"] == [16, 17, 18, 19, 20] and finding.evidence["frac_reward_zero_std"] == [0.95] * 5
    assert "no learning signal" in finding.message or "learns nothing" in finding.message
    assert "reward functions" in finding.message


def test_most_completions_cut_at_max_length_for_three_points(tmp_path: Path) -> None:
    ctx, _ = _grpo_health(tmp_path)
    points = [_healthy(i) for i in range(1, 5)] + [{**_healthy(i), "completions/clipped_ratio": 0.8, "completions/mean_length": 256.0}
                                                    for i in range(5, 12)]
    _feed(ctx, points)
    finding = _only(ctx, "GRPO_COMPLETIONS_TRUNCATED")
    assert finding.step == 7 and finding.evidence["clipped_ratio"] == [0.8] * 3 and finding.evidence["mean_length"] == 256.0
    assert "max_completion_length" in finding.message


def test_entropy_below_the_floor(tmp_path: Path) -> None:
    ctx, _ = _grpo_health(tmp_path)
    _feed(ctx, [_healthy(1), _healthy(2), _healthy(3), {**_healthy(4), "entropy": 0.01}])
    finding = _only(ctx, "GRPO_ENTROPY_COLLAPSE")
    assert finding.step == 4 and finding.evidence["entropy"] == 0.01 and finding.evidence["late_entropy"] is None


def _decaying_entropy(i: int) -> float:
    return 0.6 * 0.93 ** i


def _first_drop_step(count: int, fraction: float = 0.2) -> int | None:
    """The step the entropy drop fires at, from the whole history at every point (statistics.median over the thirds)."""
    values: list[float] = []
    for i in range(1, count + 1):
        values.append(_decaying_entropy(i))
        third = max(2, len(values) // 3)
        if len(values) >= 6 and statistics.median(values[-third:]) < fraction * statistics.median(values[:third]):
            return i
    return None


def test_entropy_falling_far_below_where_it_started(tmp_path: Path) -> None:
    ctx, _ = _grpo_health(tmp_path)
    _feed(ctx, [{**_healthy(i), "entropy": _decaying_entropy(i)} for i in range(1, 61)])
    finding = _only(ctx, "GRPO_ENTROPY_COLLAPSE")
    expected = _first_drop_step(60)
    assert expected is not None and finding.step == expected and _decaying_entropy(expected) > 0.05  # the drop, before the floor
    values = [_decaying_entropy(i) for i in range(1, expected + 1)]
    third = max(2, expected // 3)
    assert finding.evidence["early_entropy"] == statistics.median(values[:third])
    assert finding.evidence["late_entropy"] == statistics.median(values[-third:]) < 0.2 * finding.evidence["early_entropy"]


def test_kl_above_the_ceiling_and_kl_jumping(tmp_path: Path) -> None:
    ceiling, _ = _grpo_health(tmp_path / "ceiling")
    _feed(ceiling, [_healthy(i) for i in range(1, 8)] + [{**_healthy(i), "kl": 1.5} for i in range(8, 12)])
    finding = _only(ceiling, "GRPO_KL_BLOWUP")
    assert finding.step == 8 and finding.evidence["kl"] == 1.5 and "raise beta" in finding.message
    jump, _ = _grpo_health(tmp_path / "jump")
    _feed(jump, [{**_healthy(i), "kl": 0.01} for i in range(1, 11)] + [{**_healthy(11), "kl": 0.2}])
    finding = _only(jump, "GRPO_KL_BLOWUP")
    assert finding.step == 11 and finding.evidence["previous"] == [0.01] * 5 and finding.evidence["previous_median"] == 0.01
    assert "20.0x" in finding.message


def _hacked(i: int) -> dict[str, Any]:
    """Reward and completion length climbing together (the reward pays for length)."""
    return {**_healthy(i), "reward": 0.2 + 0.02 * i, "rewards/correct/mean": 0.3, "rewards/length/mean": 0.02 * i,
            "completions/mean_length": 100.0 + 10 * i}


def _first_hacking_step(count: int) -> int:
    rewards, spreads, lengths = [], [], []
    for i in range(1, count + 1):
        point = _hacked(i)
        rewards.append(point["reward"]), spreads.append(point["reward_std"]), lengths.append(point["completions/mean_length"])
        third = max(2, i // 3)
        med = statistics.median
        if (i >= 6 and med(rewards[-third:]) - med(rewards[:third]) >= 0.5 * med(spreads[:third])
                and med(lengths[-third:]) >= 2 * med(lengths[:third])):
            return i
    raise AssertionError("never")


def test_reward_rising_while_completions_run_away(tmp_path: Path) -> None:
    ctx, _ = _grpo_health(tmp_path)
    _feed(ctx, [_hacked(i) for i in range(1, 61)])
    finding = _only(ctx, "GRPO_REWARD_HACKING_SUSPECT")
    expected = _first_hacking_step(60)
    assert finding.step == expected
    evidence = finding.evidence
    assert evidence["late_reward"] > evidence["early_reward"] and evidence["late_mean_length"] >= 2 * evidence["early_mean_length"]
    functions = evidence["rewards_per_function_early_late"]
    length, correct = functions["rewards/length/mean"], functions["rewards/correct/mean"]
    assert length[1] > length[0] and correct == [0.3, 0.3] and "rewards/length/mean rose the most" in finding.message


def test_reward_rising_while_diversity_falls(tmp_path: Path) -> None:
    ctx, _ = _grpo_health(tmp_path, {"entropy_drop": 0.1})
    _feed(ctx, [{**_healthy(i), "reward": 0.2 + 0.02 * i, "entropy": 0.6 * 0.97 ** i} for i in range(1, 61)])
    finding = _only(ctx, "GRPO_REWARD_HACKING_SUSPECT")
    assert finding.evidence["late_entropy"] < 0.5 * finding.evidence["early_entropy"] and "early_mean_length" not in finding.evidence


# -- real GRPOTrainer runs ------------------------------------------------------------------------------------------------


def _prompts(n: int = 32) -> list[dict[str, str]]:
    from harness.lib.tiny import corpus_lines

    return [{"prompt": line.split(".")[0][:40]} for line in corpus_lines()[:n]]


def _grpo(out: Path, tokenizer: Any, reward: Any, *, max_steps: int, max_completion_length: int, eos_logit: float = 0.0,
          eos_sampling_bias: float = 0.0, learning_rate: float = 1e-3, beta: float = 0.0, config: dict[str, Any] | None = None) -> Path:
    """A real GRPOTrainer on a tiny Llama (an untrained one says EOS 1 time in 256, so it never ends a completion).

    ``eos_logit`` gives the model's output layer a bias on EOS (the policy ends completions early and can unlearn it);
    ``eos_sampling_bias`` raises EOS at sampling only (the model stays as built, so the reference model that
    ``beta > 0`` loads from the policy's path is the same). ``config`` is the harness config (grpo_health alone unless given).
    """
    import torch
    from datasets import Dataset
    from trl import GRPOConfig, GRPOTrainer as TrlGRPOTrainer

    from harness.lib.tiny import build_tiny_llama

    model = build_tiny_llama(tokenizer)
    if eos_logit:
        head = torch.nn.Linear(model.lm_head.in_features, model.lm_head.out_features, bias=True)
        with torch.no_grad():
            head.weight.copy_(model.lm_head.weight)
            head.bias.zero_()
            head.bias[tokenizer.eos_token_id] = eos_logit
        model.lm_head = head
    if beta:  # GRPOTrainer loads its reference model from the policy's path
        model.save_pretrained(out / "model")
        model.config._name_or_path = str(out / "model")
    generation = {"sequence_bias": [[[tokenizer.eos_token_id], eos_sampling_bias]]} if eos_sampling_bias else None
    args = GRPOConfig(output_dir=str(out), max_steps=max_steps, per_device_train_batch_size=8, num_generations=4,
                      max_completion_length=max_completion_length, learning_rate=learning_rate, beta=beta, generation_kwargs=generation,
                      report_to="none", logging_steps=1, use_cpu=True, save_strategy="no", disable_tqdm=True, dataloader_num_workers=0,
                      seed=0, log_level="error")
    trainer = TrlGRPOTrainer(model=model, reward_funcs=[reward], args=args, train_dataset=Dataset.from_list(_prompts()),
                             processing_class=tokenizer)
    harness.attach(trainer, config={"plugins": ["grpo_health"]} if config is None else config)
    trainer.train()
    return out


def _grpo_codes(out: Path) -> list[tuple[str, int]]:
    return [(f["code"], f["step"]) for f in findings_of(out) if f["code"].startswith("GRPO_")]


@pytest.mark.slow
def test_a_constant_reward_with_completions_cut_at_four_tokens(tmp_path: Path, tokenizer: Any) -> None:
    def constant_reward(completions: list[Any], **kwargs: Any) -> list[float]:
        return [1.0] * len(completions)

    out = _grpo(tmp_path, tokenizer, constant_reward, max_steps=6, max_completion_length=4)  # no EOS bias: ~1/256 per token
    assert sorted(_grpo_codes(out)) == [("GRPO_COMPLETIONS_TRUNCATED", 3), ("GRPO_REWARD_STD_ZERO", 5)]
    (zero,) = findings_of(out, "GRPO_REWARD_STD_ZERO")
    assert zero["evidence"]["frac_reward_zero_std"] == [1.0] * 5 and zero["evidence"]["reward_std"] == 0.0
    (cut,) = findings_of(out, "GRPO_COMPLETIONS_TRUNCATED")
    assert min(cut["evidence"]["clipped_ratio"]) >= 0.5 and cut["evidence"]["mean_length"] <= 4


@pytest.mark.slow
def test_a_reward_that_pays_for_length_is_suspected(tmp_path: Path, tokenizer: Any) -> None:
    def length_reward(completion_ids: list[list[int]], **kwargs: Any) -> list[float]:
        return [len(ids) / 16 for ids in completion_ids]

    # EOS likely at first (mean length ~2 of 16): the policy learns to hold it back because longer completions pay more,
    # and then runs into max_completion_length
    out = _grpo(tmp_path, tokenizer, length_reward, max_steps=10, max_completion_length=16, eos_logit=5.5, learning_rate=3e-2)
    codes = dict(_grpo_codes(out))
    assert {"GRPO_REWARD_HACKING_SUSPECT", "GRPO_COMPLETIONS_TRUNCATED"} <= set(codes), codes
    (hack,) = findings_of(out, "GRPO_REWARD_HACKING_SUSPECT")
    evidence = hack["evidence"]
    assert 6 <= hack["step"] <= 9 and evidence["late_reward"] > evidence["early_reward"] + 0.5 * evidence["early_reward_std"]
    assert evidence["late_mean_length"] >= 2 * evidence["early_mean_length"]
    assert "rewards/length_reward/mean" in evidence["rewards_per_function_early_late"]


@pytest.mark.slow
def test_a_learning_rate_far_too_high_on_a_narrow_reward_blows_up_the_kl_and_collapses_the_entropy(
        tmp_path: Path, tokenizer: Any) -> None:
    """A reward for 32 of the 512 token ids at lr 5e-2 (50x the usual) with beta 0.04: the policy runs from its
    reference (kl past 1 by step 7 here) and onto those tokens (entropy from 6.2 nats to under a fifth of it)."""
    def few_tokens(completions: list[Any], completion_ids: list[list[int]], **kwargs: Any) -> list[float]:
        return [sum(1 for t in ids if 10 <= t < 42) / max(len(ids), 1) for ids in completion_ids]

    out = _grpo(tmp_path, tokenizer, few_tokens, max_steps=16, max_completion_length=8, learning_rate=5e-2, beta=0.04,
                eos_sampling_bias=4.5)
    found = dict(_grpo_codes(out))
    assert 5 <= found["GRPO_KL_BLOWUP"] <= 10 and 8 <= found["GRPO_ENTROPY_COLLAPSE"] <= 16, found
    (kl,) = findings_of(out, "GRPO_KL_BLOWUP")
    assert kl["evidence"]["kl"] > 1.0
    (entropy,) = findings_of(out, "GRPO_ENTROPY_COLLAPSE")
    assert entropy["evidence"]["late_entropy"] < 0.2 * entropy["evidence"]["early_entropy"]


@pytest.mark.slow
def test_a_clean_run_with_a_varied_reward_and_a_kl_penalty_is_silent(tmp_path: Path, tokenizer: Any) -> None:
    rng = random.Random(0)

    def random_reward(completions: list[Any], **kwargs: Any) -> list[float]:
        return [rng.random() for _ in completions]

    # every default plugin: loss_baseline included (GRPO's first loss, a policy-gradient surrogate near 0, is not held
    # against ln(vocab) as a token loss would be)
    out = _grpo(tmp_path, tokenizer, random_reward, max_steps=8, max_completion_length=8, eos_sampling_bias=4.5, beta=0.1,
                config={})
    metrics = [row for row in read_jsonl(out / "harness" / "metrics.jsonl") if "kl" in row]
    assert len(metrics) == 8 and all(math.isfinite(row["kl"]) for row in metrics)  # kl is logged and checked
    assert [f for f in findings_of(out) if f["severity"] in ("warning", "error", "critical")] == []
    assert "grpo_health" in json.loads((out / "harness" / "run.json").read_text())["plugins"]  # silent while watching

