"""dpo_health on real TRL trainers: length bias, saturated accuracy, NaN rewards, few SFT label tokens; clean runs stay silent."""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import harness
from conftest import FAULTS, REPO, findings_of

COMMON: dict[str, Any] = dict(per_device_train_batch_size=4, learning_rate=1e-3, report_to="none", logging_steps=1, use_cpu=True,
                              save_strategy="no", disable_tqdm=True, dataloader_num_workers=0, seed=0)


def _sentences(n: int) -> list[str]:
    from harness.lib.tiny import corpus_lines

    return [line for line in corpus_lines() if line.count(" ") >= 6][:n]


def _dpo(tmp_path: Path, tokenizer: Any, rows: list[dict[str, str]], faults: dict[str, Any], max_steps: int, learning_rate: float = 1e-3) -> Path:
    from datasets import Dataset
    from trl import DPOConfig, DPOTrainer

    from harness.lib.tiny import build_tiny_llama

    args = DPOConfig(output_dir=str(tmp_path / "dpo"), max_length=64, max_steps=max_steps, beta=0.1, **{**COMMON, "learning_rate": learning_rate})
    trainer = DPOTrainer(model=build_tiny_llama(tokenizer), ref_model=build_tiny_llama(tokenizer), args=args,
                         train_dataset=Dataset.from_list(rows), processing_class=tokenizer)
    harness.attach(trainer, config={"plugins": ["dpo_health", "nan_guard", FAULTS], "fault_injector": faults})
    trainer.train()
    return Path(args.output_dir)


def _codes(out: Path, prefix: tuple[str, ...] = ("DPO_", "SFT_")) -> list[tuple[str, int]]:
    return [(f["code"], f["step"]) for f in findings_of(out) if f["code"].startswith(prefix)]


def test_chosen_always_longer_is_a_length_bias_and_nan_log_probs_are_nonfinite_rewards(tmp_path: Path, tokenizer: Any) -> None:
    lines = _sentences(48)
    rows = [{"prompt": "Tell me more.", "chosen": " " + a + " " + b, "rejected": " " + a.split(".")[0][:20]} for a, b in zip(lines[::2], lines[1::2])]
    out = _dpo(tmp_path, tokenizer, rows, {"nonfinite_loss_at_steps": [2], "stop_at_step": 3}, max_steps=8)
    (bias,) = findings_of(out, "DPO_LENGTH_BIAS")  # from the tokenised pairs, before the first step
    assert bias["step"] == 0 and bias["evidence"]["chosen_longer_fraction"] == 1.0 and bias["evidence"]["pairs_compared"] == 24
    assert bias["evidence"]["mean_chosen_tokens"] > 2 * bias["evidence"]["mean_rejected_tokens"]
    (nonfinite,) = findings_of(out, "DPO_NONFINITE_REWARDS")  # the NaN step's logged rewards
    assert nonfinite["step"] == 2 and nonfinite["severity"] == "error"


def test_easy_pairs_saturate_accuracy_early(tmp_path: Path, tokenizer: Any) -> None:
    rows = [json.loads(line) for line in (REPO / "examples" / "data" / "dpo.jsonl").read_text().splitlines()[:64]]  # rejected = shuffled words
    out = _dpo(tmp_path, tokenizer, rows, {"stop_at_step": 5}, max_steps=16)
    (saturated,) = findings_of(out, "DPO_ACCURACY_SATURATED")
    assert saturated["step"] == 4 and min(saturated["evidence"]["accuracies"]) >= 0.98
    margins = saturated["evidence"]["margins"]
    assert margins == sorted(margins) and margins[-1] > margins[0]


def test_a_learning_rate_far_too_high_lets_the_chosen_log_probs_fall(tmp_path: Path, tokenizer: Any) -> None:
    lines = _sentences(96)
    rows = [{"prompt": "Continue:", "chosen": " " + a, "rejected": " " + a[: len(a) // 2] + " " + b} for a, b in zip(lines[::2], lines[1::2])]
    out = _dpo(tmp_path, tokenizer, rows, {}, max_steps=12, learning_rate=2e-2)
    (falling,) = findings_of(out, "DPO_CHOSEN_LOGPS_FALLING")
    evidence = falling["evidence"]
    assert falling["step"] >= 6 and evidence["late_rewards_chosen"] < -2.0 and evidence["late_margin"] > evidence["early_margin"]


def test_a_clean_dpo_run_is_silent(tmp_path: Path, tokenizer: Any) -> None:
    lines = _sentences(48)
    rows = [{"prompt": "Continue:", "chosen": " " + a, "rejected": " " + b} for a, b in zip(lines[::2], lines[1::2])]
    out = _dpo(tmp_path, tokenizer, rows, {}, max_steps=6)
    assert _codes(out) == []


def _sft(tmp_path: Path, tokenizer: Any, rows: list[dict[str, str]]) -> Path:
    from datasets import Dataset
    from trl import SFTConfig, SFTTrainer

    from harness.lib.tiny import build_tiny_llama

    args = SFTConfig(output_dir=str(tmp_path / "sft"), max_length=384, max_steps=2, **COMMON)
    trainer = SFTTrainer(model=build_tiny_llama(tokenizer), args=args, train_dataset=Dataset.from_list(rows), processing_class=tokenizer)
    harness.attach(trainer, config={"plugins": ["dpo_health"]})
    trainer.train()
    return Path(args.output_dir)


def test_sft_batches_that_are_mostly_prompt_are_found_and_balanced_ones_are_not(tmp_path: Path, tokenizer: Any) -> None:
    lines = _sentences(40)
    long_prompts = [{"prompt": " ".join(lines[i:i + 3]), "completion": " Yes."} for i in range(0, 36, 3)]  # ~200 prompt tokens, ~6 labelled
    out = _sft(tmp_path / "long", tokenizer, long_prompts)
    (few,) = findings_of(out, "SFT_FEW_LABEL_TOKENS")
    assert few["step"] == 1 and 0 < few["evidence"]["fraction"] < 0.05
    balanced = [{"prompt": f"Continue: {a.split('.')[0]}.", "completion": " " + b} for a, b in zip(lines[::2], lines[1::2])]
    assert _codes(_sft(tmp_path / "balanced", tokenizer, balanced)) == []
